"""The device side of every step: the one host-to-device copy, sampled tokens gathered on the
device, and a decode step done there (each mirror updated in place, replayed as a CUDA graph).

``Transfer`` owns what these share: the staging arena, the copy's plan (whole members but the
last, of the last the used prefix plus the rows the device still holds from a longer step, the
high-water mark), the token gather and the graph replays. ``restore`` undoes a failed step's
device work: the device arena is copied back from the last step's half.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .decl import Mirror, Rule
from .graphs import Replays
from .staging import HALVES, DeviceStep, Targets
from .storage import Storage, Stored
from .tokens import Gather, TokenGather


class Transfer:
    def __init__(
        self,
        storage: Storage,
        device: torch.device,
        sampled: str | None,
        mirror: str | None,
        gather_rows: int,
    ) -> None:
        self.staging = storage.staging
        self._t = storage.tensors
        self.tokens: TokenGather | None = None
        if sampled and mirror:
            s = self._t[sampled]
            self.tokens = TokenGather(
                self.staging, gather_rows, list(s.flat), self._t[mirror].flat[0], s.decl.initial
            )
        self.gathered: int | None = None  # the half whose gathered tokens are in flight
        sources, end = storage.sources, storage.end
        last = sources[-1] if sources else None
        self._last: Stored | None = last if last and isinstance(last.decl.fill, Rule) else None
        self._base = last.offset if self._last and last and last.offset is not None else end
        self._itemsize = last.dtype.itemsize if last else 0
        self.high_water = 0  # rows of the last member the device holds
        self.copies_per_step = 1 if end else 0
        self._mirrored = [[t.targets[h] for t in sources if t.targets] for h in range(HALVES)]
        mirrors = {n: t.flat[0] for n, t in self._t.items() if isinstance(t.decl.fill, Mirror)}
        self.device_steps = [
            DeviceStep(mirrors, lambda source, h=h: self._copy_member(h, source))  # type: ignore[misc]
            for h in range(HALVES)
        ]
        self.replays = Replays(device)

    def copy(self, h: int, targets: Targets, gather: Gather | None = None) -> None:
        """The step's one copy from half h. With `gather`, its indices go up with it and the
        device then writes the sampled tokens."""
        if not self.copies_per_step:
            return
        tokens = self.tokens if gather is not None else None
        if self.tokens is not None:
            self.tokens.settle()  # the last step's rows have gone back before the copy lands
        if tokens is not None:
            tokens.stage(h, gather)  # type: ignore[arg-type]
        elif self.tokens is not None:
            self.tokens.sent = None  # the copy carries this half's stale indices up
        span = self._base
        if self._last is not None:
            used = self._last.targets[h].written[0]
            span += max(used, self.high_water) * self._itemsize
            self.high_water = used
        else:
            span = self.staging.nbytes
        self.staging.copy(h, span)
        if tokens is not None:
            assert gather is not None
            tokens.load(gather, direct=True)
            tokens.counted(h, gather)
            tokens.gather(h, gather)
            tokens.write(h, gather)
            self.staging.record(h, tokens.send_back(h, gather))
            self.gathered = h

    def _copy_member(self, h: int, source: str) -> None:
        """The used part of the mirrored host tensor `source` up from half h (a decode step
        on the device), with the rows the device still holds from a longer step."""
        t = self._t[source]
        used = t.targets[h].written[0]
        if t is self._last:
            used, self.high_water = max(used, self.high_water), used
        assert t.offset is not None
        self.staging.copy_range(h, t.offset, used * t.dtype.itemsize)

    def device_step(
        self, h: int, gather: Gather, sizes: Any, advance: Callable[[DeviceStep], None]
    ) -> None:
        """A decode step whose tokens stay on the device: the tokens gathered there and each
        mirror updated in place by `advance` (or its host tensor copied up), replayed as one
        CUDA graph per key once the key recurs (``graphs.Replays``)."""
        tokens, staging, v = self.tokens, self.staging, self.device_steps[h]
        assert tokens is not None
        tokens.settle()
        tokens.send(h, gather)
        tokens.counted(h, gather)
        up, high_water = staging.bytes_up, self.high_water

        def work() -> None:
            tokens.gather(h, gather)  # nothing shared written before this returns
            advance(v)
            tokens.write(h, gather)

        def load_and_work() -> None:
            tokens.load(gather, direct=True)  # its graph is keyed by the tokens' address
            work()

        def effects() -> Callable[[], None]:  # what a replay does again on the host
            grew, after = staging.bytes_up - up, self.high_water

            def again() -> None:
                staging.bytes_up += grew
                self.high_water = after

            return again

        def undo() -> None:
            staging.bytes_up, self.high_water = up, high_water

        # what the work enqueues depends on: the half, the sizes, the gather's shape, and
        # the used part of each mirrored host tensor a device step may copy up; with the
        # load of the tokens, also their tensor's address (a sampler's persistent buffer
        # keeps it: then the load is part of the graph)
        spans = tuple(t.written[0] for t in self._mirrored[h])
        key = (h, sizes, high_water, spans, tokens.key(gather))
        replays, loading = self.replays, (key, tokens.source(gather))
        if replays.seen(loading):
            replays.run(loading, load_and_work, effects, undo)
        else:
            replays.note(loading)
            tokens.load(gather, direct=False)  # eagerly, into the copy the graph of `key` reads
            replays.run(key, work, effects, undo)
        # the copies back run eagerly after the graph, beside the model (tokens.py)
        staging.record(h, tokens.send_back(h, gather))
        self.gathered = h

    def restore(self, h: int, high_water: int) -> None:
        """The device work of half h failed: the device arena is the last step's again."""
        prev = h ^ 1
        if self.tokens is not None:
            self.tokens.settle()
        self.staging.wait(prev)  # its rows copied back from the device have landed
        self.staging.copy(prev, self.staging.nbytes)
        self.high_water = high_water
        if self.tokens is not None:
            self.tokens.sent = None  # the arena holds the last half's indices now

    def forget(self) -> None:
        """The device work of a step failed with no other half to restore from: the device
        arena holds no known step, so the next copy sends the whole last member."""
        if self.tokens is not None:
            self.tokens.settle()
            self.tokens.sent = None
        self.high_water = self._last.numel if self._last is not None else 0

    def tokens_back(self) -> np.ndarray | None:
        """The values the last step gathered on the device, once they have landed (None if
        it gathered none)."""
        h = self.gathered
        if h is None or self.tokens is None:
            return None
        self.staging.wait(h)
        self.gathered = None
        return self.tokens.values(h)
