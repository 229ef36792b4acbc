"""Device work replayed as CUDA graphs: the decode step whose tokens stay on the device.

Such a step enqueues about a dozen small operations (the gather, its vocabulary test, the
token rows written, each mirror's device advance form; the copies back to the host run after
the graph, on a stream of their own: tokens.py); launched one by one from Python they cost
the host more than the step they spare it. `Replays` captures that work once per key (the
half, the step's sizes and what else the work depends on) and replays it with one launch.

The work must be *graph-safe*: for one key it enqueues the same operations on the same
addresses, reads no device value on the host and allocates nothing. Its host side effects
(bytes counted, high-water marks) happen while it is captured; the caller says then what each
replay does again on the host (`effects`), and how to take them back if the capture fails. A key's first step runs eagerly (which also
initialises whatever the operations set up lazily); its second is captured and replayed.
Anything but CUDA runs eagerly, always: the result is the same.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch

CAPACITY = 32  # graphs kept per RuntimeBuffers (least recently used dropped)


class Replays:
    """The CUDA graphs of one RuntimeBuffers' device steps, by key."""

    def __init__(self, device: torch.device, capacity: int = CAPACITY) -> None:
        self.enabled = device.type == "cuda"
        self.device = device
        self.capacity = capacity
        self._graphs: OrderedDict[Hashable, tuple[torch.cuda.CUDAGraph, Callable[[], None]]] = (
            OrderedDict()
        )
        self._seen: OrderedDict[Hashable, None] = OrderedDict()  # keys run eagerly once
        self._refused: set[Hashable] = set()  # keys whose work could not be captured
        self._pool: Any = None
        self.replayed = 0  # steps replayed so far (for tests and benchmarks)

    def captured(self, key: Hashable) -> bool:
        """`key`'s work is a graph: the next run replays it."""
        return self.enabled and key in self._graphs

    def seen(self, key: Hashable) -> bool:
        """`key` ran before (or was noted)."""
        return key in self._graphs or key in self._seen

    def note(self, key: Hashable) -> None:
        """`key`'s work ran inside another key's: its next run is captured."""
        self._seen[key] = None
        if len(self._seen) > 4 * self.capacity:
            self._seen.popitem(last=False)

    def run(
        self,
        key: Hashable,
        work: Callable[[], None],
        effects: Callable[[], Callable[[], None]],
        undo: Callable[[], None],
    ) -> None:
        """Enqueue `work` for `key`: eagerly, or as its graph. After a capture, `effects()`
        returns what each replay does again on the host; `undo()` takes back the host
        effects of a capture that failed (the work then runs eagerly)."""
        if not self.enabled or key in self._refused:
            work()
            return
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            entry[0].replay()
            entry[1]()
            self.replayed += 1
            return
        if key not in self._seen:
            self.note(key)
            work()
            return
        graph = self._capture(key, work)
        if graph is None:  # not capturable (an exception inside): eagerly, as before
            undo()
            work()
            return
        self._graphs[key] = (graph, effects())
        if len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
        graph.replay()

    def _capture(self, key: Hashable, work: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    work()
                finally:
                    graph.capture_end()
        except Exception:
            if len(self._refused) >= 4 * self.capacity:  # bounded: the oldest may try again
                self._refused.clear()
            self._refused.add(key)
            return None
        finally:
            current.wait_stream(side)
        return graph
