"""The step built on the device (``RuntimeBuffers(config, device, build='device')``): the host
plans and checks the step as the host build does, then sends only what changed; the family's
generated device program (``_device_fill``) writes every bound device tensor on the device,
inside one CUDA graph per bucket.

Per step, the host:

1. plans the step against the request table (``requests.step.plan``) and runs the family's
   generated checks on it (``_check``): every value the call hands over is checked there,
   before anything is sent;
2. packs the delta into one pinned half: each row's slot, the first position and size of a
   context row's chunk (-1, 1 for a generation row: the device knows where it is), whether a
   context chunk ends its prompt, the context chunks' tokens, the slots whose sampled token the
   device takes in, and the block ids the device lacks (an arrival's whole row, each id
   appended). A steady step (the last step's rows, a token longer: ``rows.decode_view``)
   leaves the rows the half holds from two steps before;
3. copies that half to the device (one copy) and replays the bucket's graph (one launch; the
   graph's key holds the tokens tensor's address, which it reads in place).

The graph writes the block ids into the device mirror, takes in the last step's sampled tokens
(the caller's tensor, indexed by slot, never read on the host; one outside the vocabulary is
written as 0 and flagged, and the next step is refused as in the host build), derives the
step's rows (``device_rows.build``), runs the family's device forms, and moves each row's slot
to its KV length after the step. The mirror is written by the graph alone: a step refused or
failed before its launch leaves the mirror and the request table at the last step (an eager
run, on the CPU or a bucket's first step, restores what it wrote if it fails).

The bound host inputs (the ``*_cpu`` tensors, FlashInfer's plan arrays) are written on the
host by their rules (the generated ``_device_host_fill``) into a staging half, as the host
build writes them; ``host_inputs=False`` in the Config binds none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import BatchError
from ..requests import device as device_limits
from ..requests import step as request_step
from ..requests.rows import decode_view
from ..requests.values import EMPTY, show
from .buckets import at_bucket
from .decl import DEVICE, Rule
from .device_rows import DeviceRows, build
from .graphs import Replays
from .step import Step, StepMode
from .tokens import tokens_on_device

if TYPE_CHECKING:
    from .buffers import RuntimeBuffers

HEADER = 1  # the delta's first element: the step's context tokens
KEPT = 64  # layouts whose views and delta offsets are kept (steps at no bucket make many)


class DeviceTargets:
    """The device tensors a device step writes, by name, each at the step's bucket shape."""

    def __init__(self, views: Mapping[str, torch.Tensor]) -> None:
        self.__dict__.update(views)


class DeviceMirror:
    """The request table's per-slot columns on the device (slot S: the spare slot, pad rows'),
    written by the device step alone."""

    def __init__(self, slots: int, groups: int, width: int, device: torch.device) -> None:
        n = slots + 1
        self.kv_len = torch.zeros(n, dtype=torch.int64, device=device)  # KV tokens so far
        self.last_token = torch.zeros(n, dtype=torch.int64, device=device)
        self.blocks = torch.zeros((groups, n, width), dtype=torch.int32, device=device)
        # per slot: 1 where the token taken in was outside the vocabulary, then that token
        self.flag = torch.zeros((2, n), dtype=torch.int64, device=device)

    def state(self) -> tuple[torch.Tensor, ...]:
        return (self.kv_len, self.last_token, self.blocks, self.flag)


class Layout:
    """Where each part of a bucket's delta lies in the delta buffer (int64 elements)."""

    def __init__(self, tokens: int, rows: int, block_ids: int, slots: int) -> None:
        self.tokens, self.rows, self.block_ids = tokens, rows, block_ids
        o = HEADER
        self.slot, self.begin, self.query, self.done = (o + k * rows for k in range(4))
        self.taken = o + 4 * rows
        self.context = self.taken + slots
        self.id_index = self.context + tokens  # each block id's place in the mirror's blocks
        self.ids = self.id_index + block_ids
        self.size = self.ids + block_ids


class DeviceBuild:
    """One RuntimeBuffers' device build (see the module docstring)."""

    def __init__(self, buffers: RuntimeBuffers[Any]) -> None:
        self.b = buffers
        flight, limits = buffers._flight, buffers.limits
        if flight.kv is None:  # pragma: no cover - a family's device forms read its blocks
            raise ValueError("the device build needs a paged KV cache")
        self.slots = limits.max_batch_size
        self.groups, self.width = len(flight.kvs), limits.kv_width
        bounds = dict(buffers._sizes_within.bounds)
        most_rows, most_tokens = bounds["num_sequences"], bounds["num_tokens"]
        self.mirror = DeviceMirror(self.slots, self.groups, self.width, buffers.device)
        # block ids: every row of every group (arrivals), and as many appended (a slot that
        # arrived and grew in one step is sent twice)
        self.most_ids = 2 * self.groups * self.slots * self.width
        top = Layout(most_tokens, most_rows, self.most_ids, self.slots)
        cuda = buffers.device.type == "cuda"
        self.host = [torch.zeros(top.size, dtype=torch.int64, pin_memory=cuda) for _ in (0, 1)]
        self.host_np = [h.numpy() for h in self.host]
        self.delta = torch.zeros(top.size, dtype=torch.int64, device=buffers.device)
        # each half's last step done on the device: its delta copied (the half may be
        # written again), its flag back (the next step reads it)
        self.done = [torch.cuda.Event() if cuda else None for _ in (0, 1)]
        self.flag_host = torch.zeros((2, self.slots + 1), dtype=torch.int64, pin_memory=cuda)
        self.flag_np = self.flag_host.numpy()
        self.replays = Replays(buffers.device)
        self.half = 0
        self.last_layout: tuple[Any, Any, Any] | None = None  # sizes, bucket, layout
        self.rows_version = 0  # bumped by every step that is not steady (its rows may differ)
        self.stamps: list[tuple[int, int, int, bool] | None] = [None, None]  # each half's rows
        self.arrived: dict[int, None] = {}  # slots whose block rows the device lacks
        self.layouts: dict[tuple[int, int, int], Layout] = {}
        self.views: dict[Any, tuple[DeviceTargets, dict, dict]] = {}
        self.token_limit = limits.token_limit
        self.written = {  # what the generated device program writes (under this Config)
            n: buffers.decls[n] for n in buffers.device_tensors if n in buffers.decls
        }
        bound = {n for _, n, _, _ in buffers._bind.inputs}  # (this Config's bindings)
        self.host_written = {  # the host inputs the host writes (_device_host_fill)
            n
            for n in bound
            if buffers.decls[n].memory != DEVICE and isinstance(buffers.decls[n].fill, Rule)
        }

    # ------------------------------------------------------------------------- arrivals
    def admitting(self, entry: Any) -> None:
        """The arrival checks of a request: the device build's, then the family's."""
        device_limits.admit(entry)
        self.b._admit(entry)

    def arrived_at(self, slot: int) -> None:
        self.arrived[slot] = None

    # ------------------------------------------------------------------------- the step
    def step(
        self,
        tokens: Any,
        *,
        accepted: Mapping[int, int] | None,
        drafts: Mapping[int, Any] | None,
        chunks: Mapping[int, int] | None,
        blocks: Mapping[int, Any] | None,
        generation: bool,
        bucket: Any,
    ) -> Step[Any]:
        device_limits.refuse_drafts(drafts, accepted)
        self._flagged()
        flight = self.b._flight
        on_device = isinstance(tokens, torch.Tensor) and tokens.device == self.mirror.kv_len.device
        if tokens is not None and not on_device:
            raise BatchError(
                f"step(): the device build takes the sampled tokens as a tensor on "
                f"{self.b.device}, indexed by seq slot (or None); got {show(tokens)}"
            )
        try:
            held = tokens_on_device(tokens, self.b.limits) if on_device else None
            plan = request_step.plan(
                flight,
                held,
                chunks=chunks,
                blocks=blocks,
                generation=generation,
                steady=True,
                on_device=on_device,
                gather=False,
            )
        except BatchError:
            raise
        except Exception as exc:  # a value a check could not even read (an odd type)
            raise BatchError(
                f"step(): a value could not be checked ({type(exc).__name__}: {exc})"
            ) from exc
        try:
            b = plan.batch
            steady = b is None  # the last step's rows, each a token longer
            if steady:
                b = decode_view(flight)
            else:
                self.rows_version += 1
            s = b.sizes
            layout = self._layout_of(s, bucket)
            checked = self.b._check(b)
            h = self.half ^ 1
            key, lay = self._pack(h, b, plan, layout, steady)
        except BaseException:
            plan.undo()
            raise
        bufs = self.b
        hh = bufs._half ^ 1  # the staging half the host inputs go to
        try:
            self._host_inputs(hh, checked, s, layout)
            step, targets = self._step(s, layout, hh)
            self._launch(h, key, lay, tokens, targets)
        except BaseException:
            bufs._abandon_half(hh)
            plan.undo()
            raise
        request_step.commit(flight, plan)
        self.arrived.clear()
        self.half, bufs._half = h, hh
        return step

    def _host_inputs(self, hh: int, checked: Any, s: Any, layout: Any) -> None:
        """The bound host inputs, written by their rules into staging half `hh` (the family's
        generated ``_device_host_fill``; nothing where the Config leaves them out), padded to
        the bucket."""
        if not self.host_written:  # the Config binds none (host_inputs=False)
            return
        bufs = self.b
        bufs._staging.wait(hh)
        targets = bufs._targets[hh]
        bufs._device_host_fill(targets, checked)
        if layout is not s:  # a host input whose rows do not lead: moved to the bucket
            moved = [n for n in bufs._relayout.moved(s, layout) if n in self.host_written]
            if moved:
                bufs._relayout.apply(targets, s, layout, moved)

    def _layout_of(self, s: Any, bucket: Any) -> Any:
        """The sizes the step is laid out at (its bucket's), checked against the capacities;
        a steady run repeats the last step's sizes and bucket: the last answer."""
        last = self.last_layout
        plain = bucket is None or (type(bucket) is tuple and all(type(x) is int for x in bucket))
        if plain and last is not None and last[0] is s and last[1] == bucket:
            return last[2]
        layout = s if bucket is None else at_bucket(s, bucket)  # (checks what it is given)
        self.b._relayout.within_capacity(layout)  # the host build's check, alike
        if plain:
            self.last_layout = (s, bucket, layout)
        return layout

    def _flagged(self) -> None:
        """A token the last step took in was outside the vocabulary: its request is marked,
        and every step refuses until it is finished (as the host build's gather does)."""
        event = self.done[self.half]
        if event is not None:
            event.synchronize()  # the last step's device work (not the model)
        marked = np.flatnonzero(self.flag_np[0])
        if not len(marked):
            return
        flight = self.b._flight
        for slot in marked.tolist():  # a request finished since is gone, flag and all
            if slot not in flight.left:
                flight.bad[slot] = int(self.flag_np[1, slot])
        self.flag_np[0] = 0

    # -------------------------------------------------------------------- the delta
    def _pack(
        self, h: int, b: Any, plan: Any, layout: Any, steady: bool
    ) -> tuple[tuple[int, int, int], Layout]:
        """Write the step's delta into pinned half `h`; its graph key and layout. A steady
        step's rows (the last step's, at the same bucket) are in the half already when it
        holds their version: then only its block rows are written."""
        S = self.slots
        where, ids = self._block_ids(plan)
        k = len(where)
        K = 0 if not k else min(1 << (k - 1).bit_length(), self.most_ids)  # few graphs
        R, T = layout.num_sequences, layout.num_tokens
        key = (T, R, K)
        lay = self.layouts.get(key)
        if lay is None:
            if len(self.layouts) >= KEPT:
                del self.layouts[next(iter(self.layouts))]
            lay = self.layouts[key] = Layout(T, R, K, S)
        event = self.done[h]
        if event is not None:
            event.synchronize()  # the copy that last read this half
        a = self.host_np[h][: lay.size]
        stamp = (self.rows_version, T, R, steady)  # (a steady step's producers: its rows)
        if not (steady and self.stamps[h] == stamp):
            self._pack_rows(a, lay, b, plan)
            self.stamps[h] = stamp
        index, values = a[lay.id_index : lay.ids], a[lay.ids : lay.ids + K]
        index[:k], values[:k] = where, ids
        index[k:], values[k:] = S * self.width, 0  # the spare slot's row stays zero
        return key, lay

    def _pack_rows(self, a: np.ndarray, lay: Layout, b: Any, plan: Any) -> None:
        """The delta's rows, sampled-token slots and context tokens."""
        S, R, s = self.slots, lay.rows, b.sizes
        n, n_ctx = s.num_sequences, s.num_context_requests
        a[0] = s.num_context_tokens
        slot = a[lay.slot : lay.slot + R]
        slot[:n] = b.seq_slot
        slot[n:] = S
        begin, query, done = (a[o : o + R] for o in (lay.begin, lay.query, lay.done))
        begin[:n_ctx], query[:n_ctx] = b.ctx_begin, b.ctx_chunk
        done[:n_ctx] = b.ctx_begin + b.ctx_chunk == b.ctx_prompt_len
        begin[n_ctx:n], query[n_ctx:n], done[n_ctx:n] = -1, 1, 1
        begin[n:], query[n:], done[n:] = 0, 0, 0
        taken = a[lay.taken : lay.taken + S]
        p = len(plan.producers)
        taken[:p] = plan.producers
        taken[p:] = S
        context = a[lay.context : lay.context + lay.tokens]
        o = 0
        for i, (start, size) in enumerate(zip(b.ctx_begin.tolist(), b.ctx_chunk.tolist())):
            context[o : o + size] = b.prompt_array(i)[start : start + size]
            o += size

    def _block_ids(self, plan: Any) -> tuple[np.ndarray, np.ndarray]:
        """The block ids the device lacks, and where each goes in the mirror's blocks (flat:
        group, slot, column): the whole row of every slot that arrived since the last step
        (the ids past its list 0), and each id this step appended. An id may be named twice,
        alike."""
        S, W = self.slots, self.width
        kvs = self.b._flight.kvs
        where, ids = [EMPTY], [EMPTY]
        if self.arrived:
            slots = np.fromiter(self.arrived, np.int64, len(self.arrived))
            columns = np.arange(W)
            for g, table in enumerate(kvs):
                where.append(((g * (S + 1) + slots)[:, None] * W + columns).ravel())
                ids.append(table.ids[slots * table.lists].ravel())
        for table, rows, before in plan.undo_blocks:  # (row, its list's length before)
            g = next(g for g, t in enumerate(kvs) if t is table)
            rows, before = np.atleast_1d(rows), np.atleast_1d(before)
            n = table.count[rows] - before
            if n.min() == n.max() == 1:  # the usual step: one new block per list
                row, column = rows, before
            else:
                row = np.repeat(rows, n)
                column = np.arange(len(row)) - np.repeat(np.cumsum(n) - n - before, n)
            where.append((g * (S + 1) + row // table.lists) * W + column)
            ids.append(table.ids[row, column])
        return np.concatenate(where), np.concatenate(ids)

    # -------------------------------------------------------------------- the device
    def _step(self, s: Any, layout: Any, hh: int) -> tuple[Step[Any], DeviceTargets]:
        """The step's views at its bucket (the host inputs in staging half `hh`), and the
        device tensors the device program writes."""
        cached = self.views.get((layout, hh))
        if cached is None:
            bufs, c = self.b, self.b.config
            bufs._layout, half = layout, bufs._half
            bufs._half = hh
            try:
                inputs, outputs = bufs._views_at(layout)
            finally:
                bufs._half = half
            targets = DeviceTargets(
                {n: bufs._view(n, tuple(d.shape(c, layout))) for n, d in self.written.items()}
            )
            if len(self.views) >= KEPT:  # the oldest layout's views (a bucket's stay hot)
                del self.views[next(iter(self.views))]
            cached = self.views[layout, hh] = (targets, inputs, outputs)
        scalars = self.b._device_scalars(s)
        self.b._scalars_now, self.b._last, self.b._layout = scalars, s, layout
        step = Step(
            inputs=self.b.step_inputs(cached[1], scalars, StepMode.of(s), self.b._each),
            outputs=dict(cached[2]),
            sizes=s,
            scalars=scalars,
        )
        return step, cached[0]

    def _launch(
        self, h: int, key: tuple[int, int, int], lay: Layout, tokens: Any, targets: DeviceTargets
    ) -> None:
        """One copy of the delta, one replay (the graph reads the tokens where the caller's
        tensor lies: its address is part of the graph's key), one event."""
        m = self.mirror
        self.delta[: lay.size].copy_(self.host[h][: lay.size], non_blocking=True)
        self.b._staging.bytes_up += lay.size * 8  # (RuntimeBuffers.bytes_to_device)
        graph: tuple[Any, ...] = key
        if tokens is not None:  # the slots' column of the caller's tokens
            tokens = tokens if tokens.ndim == 1 else tokens[:, 0]
            graph = (*key, tokens.data_ptr(), tokens.dtype, tokens.stride(0))

        def work() -> None:
            self._device_step(lay, targets, tokens)

        if self.replays.captured(graph):
            self.replays.run(graph, work, lambda: _nothing, _nothing)
        else:  # an eager run (the CPU, or a bucket's first step): undone if it fails
            saved = [t.clone() for t in (*m.state(), *vars(targets).values())]
            try:
                self.replays.run(graph, work, lambda: _nothing, _nothing)
            except BaseException:
                for t, before in zip((*m.state(), *vars(targets).values()), saved):
                    t.copy_(before)
                raise
        event = self.done[h]
        if event is not None:
            event.record()

    def _device_step(self, lay: Layout, targets: DeviceTargets, tokens: Any) -> None:
        """The step's device work (captured per bucket): block rows, sampled tokens, the
        family's device program, each row's KV length after the step."""
        m, d, S, R = self.mirror, self.delta, self.slots, lay.rows
        if lay.block_ids:
            m.blocks.view(-1).index_copy_(
                0, d[lay.id_index : lay.ids], d[lay.ids : lay.size].to(torch.int32)
            )
        if tokens is not None:  # the slots that produced take their token in
            taken = d[lay.taken : lay.taken + S]
            real = taken < S
            token = tokens.index_select(0, taken.clamp(max=S - 1)).to(torch.int64)
            bad = real & ((token < 0) | (token >= self.token_limit))
            m.last_token.index_copy_(0, taken, token.masked_fill(bad | ~real, 0))
            m.flag.zero_()  # every bad slot marked (a pad entry marks the spare slot with 0)
            m.flag[0].index_copy_(0, taken, bad.to(torch.int64))
            m.flag[1].index_copy_(0, taken, token)
        else:
            m.flag.zero_()
        rows = build(
            slot=d[lay.slot : lay.slot + R],
            begin=d[lay.begin : lay.begin + R],
            query=d[lay.query : lay.query + R],
            ends_prompt=d[lay.done : lay.done + R],
            context_tokens=d[lay.context : lay.context + lay.tokens],
            context_count=d[0],
            kv_len=m.kv_len,
            last_token=m.last_token,
            blocks=m.blocks,
        )
        self.b._device_fill(targets, rows)
        m.kv_len.index_copy_(0, rows.slot[:R], rows.kv[:R])
        self.flag_host.copy_(m.flag, non_blocking=True)  # read by the next step


def device_build_of(buffers: RuntimeBuffers[Any], build: str) -> DeviceBuild | None:
    """The device build of `buffers` for ``build='device'``, None for ``'host'``."""
    if build == "host":
        return None
    family = type(buffers).__module__.rpartition(".")[2]
    if build != "device":
        raise ValueError(f"build must be 'host' or 'device', got {build!r}")
    if not getattr(buffers, "device_build", False):
        raise ValueError(
            f"the {family} family has no device build: a tensor it binds on the device has no "
            "device form (a rule's device_fill), or a step scalar no device value; use "
            "build='host'"
        )
    return DeviceBuild(buffers)


def _nothing() -> None:
    """No host effect to repeat on a replay."""


__all__ = ["DeviceBuild", "DeviceRows", "DeviceTargets", "device_build_of"]
