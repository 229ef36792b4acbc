"""Sampled tokens that stay on the device: the machinery behind ``step(tokens)`` when the
tokens are a tensor on the buffers' device.

The host cannot read such tokens without waiting for the model, so the step's fill writes the
generation rows of the token tensor from the last values it knows, and after the step's one
host-to-device copy (which also carries the gather indices, in a region at the start of the
staging arena) the device writes each row from the tokens tensor: ``input[dst[i]] =
tokens[src[i]]``. The device checks each token against the vocabulary on the way: an
out-of-range token is never written (its row gets the pad value) and the host learns of it one
step later, when the values it copies back have landed. Those copies (the gathered raw values,
and the written rows into the host half of the token tensor) keep the host tensor and the
in-flight state exact without a wait on the model. On CUDA they run on a stream of their own
(``send_back``), beside the model instead of before it: two device-to-host copies on the
step's stream would hold the model back by their own length and the switches between copy
and compute work (about 20 µs a step on an H100, measured with ``bench/serving.py``). The next
step's device work waits for them (``settle``) before it overwrites what they read. Every
buffer here is allocated once: a step allocates nothing and the addresses stay fixed (CUDA
graphs).

The work is split so that a failure changes nothing shared: ``load`` and ``gather`` write
only this object's own scratch (the tokens as int64, whatever integer dtype the sampler wrote,
so the vocabulary test cannot wrap; the raw values; the mask), ``write`` then writes the token
rows of the arena, and ``send_back`` copies the raw values and those rows to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import BatchError
from ..requests.batch import Limits
from ..requests.sampled import OnDevice
from ..requests.values import check_token_dtype
from .decl import Mirror, TensorDecl
from .staging import ALIGN, HALVES, Staging


def sampled_tokens(decls: list[TensorDecl], name: str | None) -> tuple[str | None, str | None]:
    """The host tensor `name` whose generation rows take the sampled tokens, if the family has
    it, and its device mirror."""
    sampled = name if any(d.name == name for d in decls) else None
    mirror = next(
        (d.name for d in decls if isinstance(d.fill, Mirror) and d.fill.source == sampled), None
    )
    return sampled, mirror


def tokens_on_host(tokens: Any, limits: Limits, where: str) -> Any:
    """Sampled tokens handed over as a torch tensor, as a numpy array (its layout and dtype
    checked first: a dtype that cannot hold every id is refused, not converted); anything
    else as it is (the request layer checks it)."""
    if not isinstance(tokens, torch.Tensor):
        return tokens
    if tokens.layout != torch.strided:
        raise BatchError(f"{where} needs a strided tensor of tokens, got {tokens.layout}")
    check_token_dtype(tokens.dtype, limits.token_limit, limits.token_limit_text, where, False)
    return tokens.detach().cpu().numpy()


def tokens_on_device(tokens: torch.Tensor, limits: Limits) -> OnDevice:
    """Sampled tokens that stay on the device, [slots] or [slots, k]: their shape and dtype
    checked here (their values are checked on the device), their columns per slot handed to
    the request layer."""
    slots = limits.max_batch_size
    if tokens.layout != torch.strided:
        raise BatchError(f"step() needs a strided tensor of tokens, got {tokens.layout}")
    check_token_dtype(tokens.dtype, limits.token_limit, limits.token_limit_text, "step()", True)
    shape = tokens.shape
    if tokens.ndim not in (1, 2) or shape[0] < slots or (tokens.ndim == 2 and shape[1] < 1):
        raise BatchError(
            f"step() needs integer tokens indexed by seq slot: a tensor of {slots} rows "
            f"(max_batch_size), or [{slots}, beams]; got shape {list(shape)}"
        )
    return OnDevice(1 if tokens.ndim == 1 else int(shape[1]))


@dataclass(frozen=True, slots=True)
class Gather:
    """One step's gather: value i is ``tokens[src[i]]`` (the flat, row-major element of the
    sampled tokens); the first ``len(dst)`` are written at ``dst[i]`` of the token tensor
    (the others only go back to the host: tokens of requests that sit this step out), except
    tokens outside 0 .. limit - 1."""

    tokens: torch.Tensor  # [rows] or [rows, columns], any integer dtype, on the buffers' device
    src: np.ndarray  # int64
    dst: np.ndarray  # int64, ascending, at most as long as src
    limit: int


def region_bytes(rows: int) -> int:
    """Bytes of the index region for `rows` sequences (src then dst, int64), aligned."""
    return -(-2 * 8 * rows // ALIGN) * ALIGN


class TokenGather:
    """The device side of sampled tokens for one RuntimeBuffers (see the module docstring).

    `host` holds the token tensor's host storage per half, `device` its device mirror; the
    index region is the first `region_bytes(rows)` bytes of `staging`."""

    def __init__(
        self,
        staging: Staging,
        rows: int,
        host: list[torch.Tensor],
        device: torch.Tensor,
        pad: int,
    ) -> None:
        self.staging, self.rows, self.host, self.device, self.pad = staging, rows, host, device, pad
        n = 8 * rows
        self._src_host = [staging.view(h, 0, n, torch.int64).numpy() for h in range(HALVES)]
        self._dst_host = [staging.view(h, n, n, torch.int64).numpy() for h in range(HALVES)]
        self._src = staging.view(None, 0, n, torch.int64)
        self._dst = staging.view(None, n, n, torch.int64)
        on = device.device
        pin = on.type == "cuda"
        # the sampled tokens as int64, per flat size of the tokens tensor (one size a run)
        self._inputs: dict[int, torch.Tensor] = {}
        self._source: torch.Tensor | None = None  # what ``gather`` reads: set by ``load``
        self._got = torch.empty(rows, dtype=torch.int64, device=on)  # raw: the host names a bad one
        self._written = torch.empty(rows, dtype=device.dtype, device=on)
        self._bad = torch.empty(rows, dtype=torch.bool, device=on)
        self._high = torch.empty(rows, dtype=torch.bool, device=on)
        # the raw gathered values, back on the host (per half: read one step later)
        self._values = [torch.empty(rows, dtype=torch.int64, pin_memory=pin) for _ in range(HALVES)]
        self._values_np = [v.numpy() for v in self._values]
        # the copies back run on their own stream (module docstring); `_back` marks their end
        self._stream = torch.cuda.Stream(on) if pin else None
        self._written_event = torch.cuda.Event() if pin else None
        self._back = torch.cuda.Event() if pin else None
        self._back_pending = False
        # the copies' views per (half, values, first row, end row): a steady run reuses two
        self._back_views: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
        self._count = [0] * HALVES
        self.sent: tuple[np.ndarray, np.ndarray] | None = None  # the indices the device holds
        self._key: tuple[np.ndarray, np.ndarray, tuple[int, ...]] | None = None  # the last key

    def stage(self, half: int, g: Gather) -> None:
        """Before the step's copy: its indices into the arena half."""
        self._src_host[half][: len(g.src)] = g.src
        self._dst_host[half][: len(g.dst)] = g.dst
        self.sent = (g.src, g.dst)

    def send(self, half: int, g: Gather) -> None:
        """A step without the arena copy: its indices up, unless the device holds them (a
        steady run gathers the same rows step after step)."""
        sent = self.sent
        if sent is not None and sent[0] is g.src and sent[1] is g.dst:
            return  # a steady run hands the same arrays
        if sent is not None and np.array_equal(sent[0], g.src) and np.array_equal(sent[1], g.dst):
            self.sent = (g.src, g.dst)
            return
        self.stage(half, g)
        self.staging.copy_range(half, 0, region_bytes(self.rows))

    def load(self, g: Gather, direct: bool) -> None:
        """The sampled tokens as ``gather`` reads them: int64 tokens in one piece read where
        they are, when the caller may (`direct`: the work is not replayed, or its graph is
        keyed by the tokens' address, ``source``); others cast into this object's int64 copy
        of them (the gather and the vocabulary test then run in int64, whatever the
        sampler's dtype)."""
        t = g.tokens
        if direct and t.dtype == torch.int64 and t.is_contiguous():
            self._source = t.view(-1)
            return
        numel = t.numel()
        wide = self._inputs.get(numel)
        if wide is None:  # once per tokens shape
            wide = self._inputs[numel] = torch.empty(numel, dtype=torch.int64, device=t.device)
        wide.view(t.shape).copy_(t)
        self._source = wide

    def key(self, g: Gather) -> tuple[int, ...]:
        """What ``gather`` and ``write`` enqueue depends on, beyond the half: the sizes and the
        run of rows written (the values come from the device)."""
        if self._key is not None and self._key[0] is g.src and self._key[1] is g.dst:
            return self._key[2]
        m = len(g.dst)
        first, end = (int(g.dst[0]), int(g.dst[-1]) + 1) if m else (0, 0)
        key = (g.tokens.numel(), len(g.src), m, first, end)
        self._key = (g.src, g.dst, key)
        return key

    @staticmethod
    def source(g: Gather) -> tuple:
        """What ``load`` enqueues depends on: the tokens tensor's address and layout."""
        t = g.tokens
        return (t.data_ptr(), t.dtype, t.shape, t.stride())

    def settle(self) -> None:
        """Before device work that overwrites what the last copies back read (the raw values,
        the token rows of the arena): the current stream waits for them."""
        if self._back_pending:
            assert self._back is not None
            self.staging.current().wait_event(self._back)
            self._back_pending = False

    def gather(self, half: int, g: Gather) -> None:
        """The tokens gathered into scratch, raw, and the mask of the out-of-range ones:
        nothing shared is written."""
        n = len(g.src)
        if not n:
            return
        got, bad, high = self._got[:n], self._bad[:n], self._high[:n]
        assert self._source is not None, "load() comes first"
        torch.index_select(self._source, 0, self._src[:n], out=got)
        torch.lt(got, 0, out=bad)
        torch.ge(got, g.limit, out=high)
        bad.logical_or_(high)

    def write(self, half: int, g: Gather) -> None:
        """The gathered tokens into the token rows of the device arena (after ``gather``), an
        out-of-range one as the pad."""
        _, _, m, lo, hi = self.key(g)  # dst ascends (the rows' order)
        if not m:
            return
        got, bad = self._got[:m], self._bad[:m]
        if hi - lo == m:  # consecutive rows (no drafts between them): in place, cast on the way
            rows = self.device[lo:hi]
            rows.copy_(got)
            rows.masked_fill_(bad, self.pad)
        else:
            written = self._written[:m]
            written.copy_(got)
            written.masked_fill_(bad, self.pad)
            self.device.index_copy_(0, self._dst[:m], written)

    def send_back(self, half: int, g: Gather) -> torch.cuda.Stream | None:
        """After ``write``: the raw values and the written token rows (those between the
        first and the last written; the others hold what the host wrote) copied into host
        half `half`. On CUDA they run on this object's stream, which is returned: the caller
        records the half's event on it."""
        _, n, m, lo, hi = self.key(g)
        if not n:
            return None
        views = self._back_views.get((half, n, lo, hi))
        if views is None:
            if len(self._back_views) >= 64:  # bounded: a run of changing batches starts over
                self._back_views.clear()
            views = self._back_views[(half, n, lo, hi)] = (
                self._values[half][:n],
                self._got[:n],
                self.host[half][lo:hi],  # lo == hi when no row is written (m == 0)
                self.device[lo:hi],
            )
        values, got, host_rows, device_rows = views
        stream = self._stream
        if stream is None:
            values.copy_(got)
            host_rows.copy_(device_rows)
            return None
        assert self._written_event is not None and self._back is not None
        current = self.staging.current()
        self._written_event.record(current)
        stream.wait_event(self._written_event)
        # set_stream, not the `torch.cuda.stream` context manager: a third of the cost
        torch.cuda.set_stream(stream)
        try:
            values.copy_(got, non_blocking=True)
            if m:
                host_rows.copy_(device_rows, non_blocking=True)
        finally:
            torch.cuda.set_stream(current)
        self._back.record(stream)
        self._back_pending = True
        return stream

    def counted(self, half: int, g: Gather) -> None:
        """Half `half`'s step gathers `g`: its values are read back (``values``)."""
        self._count[half] = len(g.src)

    def values(self, half: int) -> np.ndarray:
        """The raw tokens half `half`'s step gathered (wait on the half's event first)."""
        return self._values_np[half][: self._count[half]]
