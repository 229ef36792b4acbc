"""The staging machinery every family shares: the double-buffered host arena that the step's
one host-to-device copy reads, and the fill targets the generated step program writes.

Host tensors that are mirrored to the device live in one staging arena at fixed, aligned
offsets (smallest first), their device mirrors in one device arena with the same layout: one
copy per step moves them all, and of the largest member only its used part. The arena is
double-buffered (pinned on CUDA): step t writes half t % 2, and before writing a half the host
waits on the event recorded after that half's last copy, so a copy still in flight is never
overwritten while the host runs a step ahead of the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import FillCountError

ALIGN = 256  # bytes; every arena member starts on this boundary
HALVES = 2
# The pad policy of a cumulative tensor (a cu_seqlens, TensorRT-LLM's 1-based last-token
# indices): past the step, its last written element repeated, so a CUDA-graph bucket reads
# zero-length rows that stay in range, where a constant 0 would read as negative lengths or as
# row -1.
REPEAT_LAST = "repeat_last"


def written() -> list[Any]:
    """A storage's record of its last fill, shared by the Targets of the halves where the
    storage is: the elements it wrote, and (repeat_last) the count and value its tail was last
    padded at (None: unknown, after a failed fill); as allocated, nothing written and every
    element 0."""
    return [0, (0, 0)]


class Target:
    """One rule tensor's storage in one half: `out` (a flat numpy view of host memory, or the
    flat device tensor of a rule that copies request tensors), its pad policy, and what the
    last fill of this storage left (``written``, shared by the halves where the storage is:
    the count of elements it wrote and, under repeat_last, the count and value its tail was
    last padded at), so that the elements past a shorter step are re-padded. `tensor` and
    `rule` (the rule's ``module:function``) name it when the rule returns a bad count."""

    __slots__ = ("out", "pad", "repeat", "written", "size", "tensor", "rule")

    def __init__(
        self,
        out: Any,
        pad: int | float | str | None,
        written: list[Any],
        tensor: str = "?",
        rule: str = "?",
    ) -> None:
        self.repeat = pad == REPEAT_LAST
        self.out, self.pad, self.written = out, None if self.repeat else pad, written
        self.size = len(out)
        self.tensor, self.rule = tensor, rule

    def wrote(self, n: int) -> None:
        """A rule wrote the first `n` elements of `out` (it returns that count): the rows a
        longer step left past them get the pad value again. A count that is not an int in
        0..len(out) (a bool, a float, a negative or too large number) raises FillCountError,
        nothing changed here (the caller abandons the step)."""
        w = self.written
        if n.__class__ is not int or not w[0] <= n <= self.size or self.repeat:
            n = self._padded(n)  # (a step as long as the last one, or longer: nothing to pad)
        w[0] = n

    def _padded(self, n: Any) -> int:
        """`n` checked (``_count``), and the elements past it padded where a longer step
        left them (repeat_last: where the tail's count or value changed)."""
        if n.__class__ is not int or not 0 <= n <= self.size:
            n = self._count(n)
        w = self.written
        if self.repeat:
            self._repeat(n)
        elif self.pad is not None and w[0] > n:
            self.out[n : w[0]] = self.pad
        return n

    def _repeat(self, n: int) -> None:
        """Every element past the first `n` holds the last of them (0 when there are none);
        written only when that count or value changed since this storage was last padded."""
        value = self.out[n - 1].item() if n else 0
        if self.written[1] != (n, value):
            self.out[n:] = value
            self.written[1] = (n, value)

    def _count(self, n: Any) -> int:
        """`n` as the int it is (a numpy integer, an int subclass), or FillCountError."""
        if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and 0 <= n <= self.size:
            return int(n)
        raise FillCountError(self.tensor, self.rule, n, self.size)

    def keep(self, prev: Target, holds_run: bool) -> None:
        """The last step's values, from the other half `prev` (unless this half already holds
        them: it was written two steps back in the same run of decode steps, or `prev` is this
        target, with one staging half)."""
        n = prev.written[0]
        w = self.written
        if holds_run:
            if w[0] == n and not self.repeat:  # a decode run: this half holds it, padded
                return
        else:
            self.out[:n] = prev.out[:n]
        if self.repeat:
            self._repeat(n)
        elif self.pad is not None and w[0] > n:
            self.out[n : w[0]] = self.pad
        w[0] = n


def written_max(target: Target) -> int:
    """The largest element the last fill of `target` wrote (0 when it wrote none): what a step
    scalar's ``max_of(tensor)`` reads."""
    n = target.written[0]
    return int(np.maximum.reduce(target.out[:n])) if n else 0  # (no ndarray.max wrapper)


def write_all(target: Target, value: int) -> None:
    """`value` into every element the last fill of `target` wrote (a capture value)."""
    target.out[: target.written[0]] = value


class Targets:
    """One half's fill targets, one attribute per rule tensor of the family that the Config
    allocates (the generated program writes the others only under their conditions)."""

    def __init__(self, targets: dict[str, Target]) -> None:
        self.__dict__.update(targets)


class DeviceStep:
    """One half's device side of a decode step whose tokens stay on the device: an attribute
    per device mirror (its flat storage, holding the last step's values, for the rules' device
    forms to update in place) and ``copy(source)``, which copies the used part of the mirrored
    host tensor `source` up from the half."""

    def __init__(self, mirrors: dict[str, torch.Tensor], copy: Callable[[str], None]) -> None:
        self.__dict__.update(mirrors)
        self.copy = copy


class Staging:
    """The double-buffered host staging arena and the device arena it is copied into.

    `layout` gives each member's (offset, bytes); members are laid out smallest first, so the
    step's copy ends inside the last, largest one. `double_buffered` False: both halves are
    one host arena (and one event), written in place: a step waits for the last step's copy
    before writing, as a single-arena implementation does, and touches half the memory."""

    def __init__(self, nbytes: int, device: torch.device, double_buffered: bool = True) -> None:
        pin = device.type == "cuda"
        self.nbytes = nbytes
        self.host = [
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            for _ in range(HALVES if double_buffered else 1)
        ]
        self.host *= HALVES // len(self.host)
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # a CPU "device": the copy is a numpy memcpy on the calling thread (torch's copy_
        # hands a large copy to its intra-op thread pool, which stalls on a loaded host)
        self._numpy = (
            (self.device.numpy(), [a.numpy() for a in self.host]) if device.type == "cpu" else None
        )
        self._done: list[torch.cuda.Event] | None = None
        if pin:  # one event per host arena
            events = [torch.cuda.Event() for _ in range(HALVES if double_buffered else 1)]
            self._done = events * (HALVES // len(events))
        self.bytes_up = 0  # copied host to device so far (the pads at the start not counted)
        self._streams: dict[tuple, torch.cuda.Stream] = {}  # by the current stream's identity

    def view(self, half: int | None, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A member's flat storage in host half `half`, or in the device arena (None)."""
        arena = self.device if half is None else self.host[half]
        return arena[offset : offset + nbytes].view(dtype)

    def start(self) -> None:
        """The device arena starts with the pads written into half 0."""
        if self.nbytes:
            self.device.copy_(self.host[0])

    def wait(self, half: int) -> None:
        """Before writing `half`: its last copy has left it."""
        if self._done is not None:
            self._done[half].synchronize()

    def record(self, half: int, stream: torch.cuda.Stream | None = None) -> None:
        """Work after the copy that reads or writes `half` (sampled tokens copied back) is
        enqueued, on the current stream or on `stream` (which waited for the current one):
        the half's event moves past it."""
        if self._done is not None:
            self._done[half].record(stream if stream is not None else self.current())

    def current(self) -> torch.cuda.Stream:
        """The current CUDA stream, its Stream object kept (torch.cuda.current_stream builds
        a new one per call, which costs more than the event record itself)."""
        key = torch._C._cuda_getCurrentStream(self.device.device.index)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(
                stream_id=key[0], device_index=key[1], device_type=key[2]
            )
        return stream

    def copy_range(self, half: int, offset: int, nbytes: int) -> None:
        """Bytes `offset` .. `offset + nbytes` of `half` up (the caller records the event)."""
        end = offset + nbytes
        self.bytes_up += nbytes
        if self._numpy is not None:
            device, hosts = self._numpy
            np.copyto(device[offset:end], hosts[half][offset:end])
            return
        self.device[offset:end].copy_(self.host[half][offset:end], non_blocking=True)

    def copy(self, half: int, span: int) -> None:
        """The step's one host-to-device copy: the first `span` bytes of `half`."""
        self.bytes_up += span
        if self._numpy is not None:
            device, hosts = self._numpy
            np.copyto(device[:span], hosts[half][:span])
            return
        self.device[:span].copy_(self.host[half][:span], non_blocking=True)
        self.record(half)
