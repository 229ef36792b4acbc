"""One step of the requests in flight, planned against the request table: the tokens the last
step produced, accepted and new drafts, KV blocks appended, context chunks; each checked before
anything is kept, the step's ``Batch`` laid out (``rows.step_view``), and a ``Plan`` that the
table commits once the step has run (``Plan.undo`` restores the block lists and drafts a failed
step set). A step where only the tokens changed is planned without a batch (``_steady``), and
so is one whose context rows repeat the last step's layout (``_continued``: a
``decode.Continue`` for the family's continue forms).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from itertools import chain
from typing import Any

import numpy as np

from ..errors import BatchError
from ..rules.decode import Continue, Sampled
from ..rules.sizes import StepSizes
from .batch import Batch, FlightLists, Limits, generation_length, step_sizes
from .blocks import BlockTable, check_window_keys, window_lists
from .rows import (
    TokenGather,
    _beam_values,
    _sequence_values,
    device_gather,
    step_view,
)
from .table import _EMPTY, Entry, RequestTable, _beam_index
from .values import BOOLS, INT32_MAX, check_token_dtype, in_range, int_array, is_int, show

FEW_BLOCKS = 8  # block appends to more slots than this are checked and written at once


@dataclasses.dataclass(frozen=True)
class OnDevice:
    """Sampled tokens that stay on the buffers' device: what the host knows of them (the
    runtime checked the tensor's shape and dtype)."""

    columns: int  # per seq slot: tokens[slot] (1) or tokens[slot, beam]


@dataclasses.dataclass
class Plan:
    """One checked step of the requests in flight, not yet committed: the batch its rules
    fill (None for a steady decode step, which continues from the last step's buffers with
    `tokens`) and the state it leaves once it has run."""

    batch: Batch | None
    tokens: Sampled | None  # steady: each sequence's new input token, in row order (checked)
    generated: np.ndarray | None  # None: a steady step, applied to the rows at commit
    last: np.ndarray | None
    ndraft: np.ndarray
    drafted: list[int]
    positions: list[tuple[int, int]]  # context slots and their prompt position after the step
    promoted: list[int]  # last step's finished prompts, generation rows from this step
    completing: list[int]  # context slots whose last chunk this step runs
    undo_blocks: list[tuple[BlockTable, int, int]]  # (table, row, its list's length before)
    undo_drafts: list[tuple[Entry, Any]]
    generation: bool = True  # the generation rows ran (and produce tokens)
    # tokens that stay on the device: the gather the step runs there, and the (slot, beam) of
    # each value it copies back (their state entries once they land)
    gather: TokenGather | None = None
    gathered: tuple[np.ndarray, np.ndarray] | None = None
    # a step that continues the last one in place (no batch): what its continue forms write
    continued: Continue | None = None

    def undo(self) -> None:
        """The step failed: the block lists and drafts it set are as they were."""
        _undo(self.undo_blocks, self.undo_drafts)


def _undo(
    blocks: list[tuple[BlockTable, int, int]],
    drafts: list[tuple[Entry, Any]],
) -> None:
    for table, row, before in blocks:
        table.undo([(row, before)])
    for entry, values in drafts:
        entry.draft_tokens = values


def plan(
    t: RequestTable,
    tokens: Any,
    *,
    accepted: Mapping[int, int] | None = None,
    drafts: Mapping[int, Any] | None = None,
    chunks: Mapping[int, int] | None = None,
    blocks: Mapping[int, Any] | None = None,
    generation: bool = True,
    steady: bool = False,
    on_device: bool = False,
    last: StepSizes | None = None,
) -> Plan:
    """Check the next step and lay it out; nothing is committed (``commit``) and only the
    block lists and drafts are set on the entries and the block table (``Plan.undo`` restores
    them). Every block id handed over is checked as it is appended, whether its request runs
    in this step or waits.

    `steady`: the last step can be continued in place (generation only, no drafts); the
    plan then has no batch when nothing but the tokens changed. `last`: the sizes of the last
    step, whose generation rows can be continued in place (``Plan.continued``) by a step whose
    context rows have its layout. `on_device`: `tokens` is ``OnDevice``, a tensor on the
    buffers' device gathered there (``Plan.gather``)."""
    if t.bad:
        _refuse_bad(t)
    if (
        steady
        and generation
        and not (t.changed or t.completing or t.waiting)
        and not (drafts or accepted or t.drafted or chunks)  # (chunks: refused in full)
        and t.n_rows
    ):
        return _steady(t, tokens, blocks, on_device)
    if (
        last is not None
        and generation
        and not (drafts or accepted or t.drafted)
        and not (t.n_wide or t.n_explicit or t.encoder)
        and len(t.kvs) <= 1
    ):
        continued = _continued(t, tokens, chunks, blocks, last, on_device)
        if continued is not None:
            return continued
    undo_blocks: list[tuple[BlockTable, int, int]] = []
    undo_drafts: list[tuple[Entry, Any]] = []
    try:
        # the tokens the last step produced: its generation rows still in flight and the
        # prompts it finished (they join the generation rows now)
        # requests left or arrived: only those still in flight produce
        alive = t.produced[t.serial[t.produced] == t.produced_serial] if t.changed else t.produced
        promoted = [s for s, serial in t.completing if t.serial[s] == serial]
        promoted_a = np.array(promoted, np.int64) if promoted else _EMPTY
        producers = np.concatenate((promoted_a, alive)) if promoted else alive
        generated, last = _produced_tokens(t, tokens, producers, on_device)
        if accepted:
            generated = _accepted(t, accepted, generated, producers, promoted)
        # this step's generation rows: the rows in flight, then the promoted prompts
        n_old = t.n_rows
        rows = np.concatenate((t.rows[:n_old], promoted_a)) if promoted else t.rows[:n_old]
        row_entries = t.row_entries + [t.held(s) for s in promoted]
        if not generation:  # the generation requests sit this step out
            if drafts:
                raise BatchError("step(): drafts given, but generation=False runs no generation")
            rows, row_entries = _EMPTY, []
        ndraft, drafted = _step_drafts(t, drafts, promoted, rows, undo_drafts)
        _grow(t, blocks, undo_blocks)
        context, positions, completing = _context(t, chunks)
        batch = step_view(t, context, rows, row_entries, generated, last, ndraft)
        gather, gathered = (
            device_gather(t, batch, tokens.columns, producers)
            if on_device and producers.size
            else (None, None)
        )
        return Plan(
            batch=batch,
            tokens=None,
            generated=generated,
            last=last,
            ndraft=ndraft,
            drafted=drafted,
            positions=positions,
            promoted=promoted,
            completing=completing,
            undo_blocks=undo_blocks,
            undo_drafts=undo_drafts,
            generation=generation,
            gather=gather,
            gathered=gathered,
        )
    except BaseException:
        _undo(undo_blocks, undo_drafts)
        raise


def _refuse_bad(t: RequestTable) -> None:
    """A step sampled an out-of-range token on the device: no step until it is finished."""
    if t.bad:
        slot, value = next(iter(t.bad.items()))
        L = t.limits
        raise BatchError(
            f"step(): a step sampled token {value} for seq_slot {slot}, outside 0 .. "
            f"{L.token_limit - 1} ({L.token_limit_text}); the device wrote the pad token "
            f"in its place. Finish that request (finish({slot})) before the next step"
        )


def _produced_tokens(
    t: RequestTable, tokens: Any, producers: np.ndarray, on_device: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The slots' generated counts and last tokens once the producers' tokens are in
    (copies; the state's own arrays when no slot produced). Tokens that stay on the
    device are counted only: their values land later (``tokens_back``)."""
    L = t.limits
    generated, last = t.generated, t.last
    if not producers.size:
        if tokens is not None and (on_device or not _empty(tokens)):
            raise BatchError(
                "step(): no request in flight produced a token in the last step; pass tokens=None"
            )
        return generated, last
    if on_device:
        k = tokens.columns
        widest = int(t.beam_width[producers].max()) if t.n_wide else 1
        if widest > k:
            raise BatchError(
                f"step(): tokens has {k} column(s) per slot, but a request in flight has "
                f"{widest} beams"
            )
        generated = generated.copy()
        generated[producers] += 1
        return generated, last
    tok = _token_table(tokens, L)
    if t.n_wide:
        widths = t.beam_width[producers]
        if int(widths.max()) > tok.shape[1]:
            raise BatchError(
                f"step(): tokens has {tok.shape[1]} column(s) per slot, but a request in "
                f"flight has {int(widths.max())} beams"
            )
        values = _beam_values(tok, producers, widths)
    else:
        values = tok[:, 0][producers]
    _check_tokens(values, L)
    generated = generated.copy()
    generated[producers] += 1
    last = last.copy()
    if t.n_wide:
        k = min(tok.shape[1], L.max_beam_width)
        last[producers, :k] = tok[producers, :k]
    else:  # one beam each: the values just checked (a one-axis scatter)
        last[:, 0][producers] = values
    return generated, last


def _accepted(
    t: RequestTable,
    accepted: Mapping[int, int],
    generated: np.ndarray,
    producers: np.ndarray,
    promoted: list[int],
) -> np.ndarray:
    """The generated counts once each slot's accepted drafts are in (checked)."""
    generated = generated if producers.size else generated.copy()
    produced = set(producers.tolist())
    for slot, n in accepted.items():
        before = t.drafts_run(slot, promoted)
        if slot not in produced or not before:
            raise BatchError(
                f"step(): accepted[{show(slot)}]: that slot verified no draft tokens in "
                "the last step"
            )
        if not is_int(n) or not 0 <= n <= before:
            raise BatchError(
                f"step(): accepted[{slot}] = {show(n)}, not a count in 0 .. {before} (the "
                "drafts it verified)"
            )
        generated[slot] += n
    return generated


def _step_drafts(
    t: RequestTable,
    drafts: Mapping[int, Any] | None,
    promoted: list[int],
    rows: np.ndarray,
    undo: list[tuple[Entry, Any]],
) -> tuple[np.ndarray, list[int]]:
    """Each slot's draft count in this step and the slots with drafts (checked); the
    entries get this step's drafts, none for the others (a promoted prompt's drafts rode
    on its last chunk), each change recorded in `undo`."""
    L = t.limits
    ndraft, drafted = t.ndraft, t.drafted
    if drafts or drafted or any(t.held(s).context_drafts for s in promoted):
        ndraft = ndraft.copy()
        ndraft[drafted] = 0
        drafted = []
        given: dict[int, np.ndarray] = {}
        for slot, values in (drafts or {}).items():
            entry = t.entry(slot, "drafts")
            if not (promoted and slot in promoted) and t.row_of[slot] < 0:
                raise BatchError(
                    f"step(): drafts[{slot}]: seq_slot {slot} is not a generation request "
                    "in this step"
                )
            a = _drafts(values, slot, entry, L)
            ndraft[slot] = len(a)
            if len(a):
                drafted.append(slot)
                given[slot] = a
        for slot in dict.fromkeys(t.drafted + promoted + drafted):
            held = t.held(slot)
            undo.append((held, held.draft_tokens))
            held.draft_tokens = given.get(slot, ())
    return ndraft, drafted


def _grow(
    t: RequestTable, blocks: Mapping[int, Any] | None, undo: list[tuple[BlockTable, int, int]]
) -> None:
    """Append the step's KV block ids to their slots' lists in the block tables, each checked
    there (integers in the pool, within the width), every append recorded in `undo` (the
    entries read their lists from the tables). With several attention windows a slot's ids
    are {window: ids}, each window's appended to its own table."""
    if not blocks:
        return
    kv = t.kv
    if kv is None:
        raise BatchError("step(): blocks given, but this family has no paged KV cache")
    if len(t.kvs) > 1:
        for slot, new in blocks.items():
            t.entry(slot, "blocks")
            w = f"step(): blocks[{slot}]"
            if isinstance(new, Mapping):
                check_window_keys(new, f"{w}:")
            if not isinstance(new, Mapping) or not set(new) <= {win for win, _ in t.kv_windows}:
                raise BatchError(
                    f"{w}: with several attention windows, the ids appended per window: "
                    f"{{window: ids}} for windows among {[win for win, _ in t.kv_windows]}; "
                    f"got {show(new)}"
                )
            for win, table in t.kv_windows:
                if win in new:
                    done = table.append(int(slot), new[win], f"{w}[{win}]")
                    undo += [(table, row, before) for row, before in done]
        return
    pairs: list[tuple[int, int]] = []
    try:
        if len(blocks) > FEW_BLOCKS and kv.append_many(blocks, pairs):
            return  # checked and written at once
        for slot, new in blocks.items():
            t.entry(slot, "blocks")
            w = f"step(): blocks[{slot}]"
            if type(new) is not list and isinstance(new, Mapping):  # {window: ids}, one window
                new = window_lists(new, [win for win, _ in t.kv_windows], w)[t.kv_windows[0][0]]
            pairs += kv.append(int(slot), new, w)
    finally:
        undo += [(kv, row, before) for row, before in pairs]


def _steady(
    t: RequestTable, tokens: Any, blocks: Mapping[int, Any] | None, on_device: bool
) -> Plan:
    """A step of the same generation rows where only the tokens changed (and block lists
    may grow): the fewest calls, the state updated at commit."""
    L = t.limits
    rows = t.rows[: t.n_rows]
    widths = t.beam_width[rows] if t.n_wide else _EMPTY
    values = None
    if on_device:
        k = tokens.columns
    elif not t.n_wide:  # one beam each: the slots' first column
        values, k = _row_tokens(tokens, rows, L), 1
    else:
        tok = _token_table(tokens, L)
        k = tok.shape[1]
    if t.n_wide and int(widths.max()) > k:
        raise BatchError(
            f"step(): tokens has {k} column(s) per slot, but a request in flight has "
            f"{int(widths.max())} beams"
        )
    gather, gathered = None, None
    if not on_device:
        if values is None:
            values = _sequence_values(tok, rows, widths, t.n_wide)
        _check_tokens(values, L)
    else:  # the host writes the last tokens it knows; the device then writes the new
        values = _sequence_values(t.last, rows, widths, t.n_wide)
        held = t.steady_gather
        if held is None or held[0] != k:  # the rows changed since: laid out once a run
            if not t.n_wide or not (widths > 1).any():
                slots, beams = rows.copy(), np.zeros(len(rows), np.int64)
            else:
                slots, beams = _beam_index(rows, widths)
            held = t.steady_gather = (
                k,
                slots * k + beams,
                np.arange(len(slots)),
                slots,
                beams,
            )
        gather = TokenGather(held[1], held[2])
        gathered = (held[3], held[4])
    undo: list[tuple[BlockTable, int, int]] = []
    try:
        _grow(t, blocks, undo)
    except BaseException:
        _undo(undo, [])
        raise
    return _in_place(t, values, undo, gather, gathered)


def _in_place(
    t: RequestTable,
    values: np.ndarray,
    undo: list[tuple[BlockTable, int, int]],
    gather: TokenGather | None,
    gathered: tuple[np.ndarray, np.ndarray] | None,
    continued: Continue | None = None,
    context: tuple[list[tuple[int, int]], list[int], list[int]] = ([], [], []),
) -> Plan:
    """The plan of a steady or continued step (no batch: the generation rows, each one token
    longer, take `values`; `context`: the prompt positions after the step, the prompts that
    join the rows and those the step finishes)."""
    positions, promoted, completing = context
    return Plan(
        batch=None,
        tokens=Sampled(values),
        generated=None,
        last=None,
        ndraft=t.ndraft,
        drafted=[],
        positions=positions,
        promoted=promoted,
        completing=completing,
        undo_blocks=undo,
        undo_drafts=[],
        gather=gather,
        gathered=gathered,
        continued=continued,
    )


def _continued(
    t: RequestTable,
    tokens: Any,
    chunks: Mapping[int, int] | None,
    blocks: Mapping[int, Any] | None,
    last: StepSizes,
    on_device: bool,
) -> Plan | None:
    """A step that continues the last one in place (one beam each, no drafts, no explicit
    positions): its context rows have the last step's layout (as many requests and tokens),
    so each tensor's generation rows start where the last step's did. Rows that held the same
    request in the last step continue; a row a finish refilled and the prompts the last step
    finished are written whole. Tokens that stay on the device (`on_device`) are gathered
    into the generation rows there; the host writes the last ones it knows. None where the
    step is not one (the full plan then runs, and raises its own errors in its own order)."""
    if len(t.produced) != last.num_generation_sequences or t.n_rows > len(t.produced):
        # the last step's rows are not the table's, or some sat it out (generation=False)
        return None
    promoted = [s for s, serial in t.completing if t.serial[s] == serial]
    if any(t.held(s).context_drafts for s in promoted):
        return None
    try:
        context, positions, completing = _context(t, chunks)
    except BatchError:
        return None
    ctx_chunk = [size for _, _, size in context]
    ctx_tokens = sum(ctx_chunk)
    if (
        len(context) != last.num_context_requests
        or ctx_tokens != last.num_context_tokens
        or any(e.context_drafts for e, _, _ in context)
    ):
        return None
    n_old = t.n_rows
    rows = np.concatenate((t.rows[:n_old], promoted)) if promoted else t.rows[:n_old]
    n = len(rows)
    kept = min(len(t.produced), n_old)
    if not n or not (context or promoted or any(r < kept for r in t.refilled)):
        # no row to write whole: a generation-only step of the last step's rows (fewer, if
        # the last ones finished), which the full plan lays out for advance() to follow
        return None
    ctx_slots = [e.seq_slot for e, _, _ in context]
    ctx_begin = [begin for _, begin, _ in context]
    ends = [b + k for b, k in zip(ctx_begin, ctx_chunk)]
    undo: list[tuple[BlockTable, int, int]] = []
    gather, gathered = None, None
    try:
        if on_device:  # every row produced a token: each is gathered into its input position
            values = t.last[:, 0][rows]
            gather = TokenGather(rows * tokens.columns, np.arange(ctx_tokens, ctx_tokens + n))
            gathered = (rows, np.zeros(n, np.int64))
        else:
            values = _row_tokens(tokens, rows, t.limits)
            _check_tokens(values, t.limits)
        _grow(t, blocks, undo)
        at = np.array(sorted(r for r in t.refilled if r < kept) + list(range(kept, n)), np.int64)
        gen_prompt_len = t.prompt_len[rows]
        gen_tokens = gen_prompt_len + t.generated[rows] + 1
        flight, grown = None, _EMPTY
        kv = t.kv
        if kv is not None:
            # its own array: the KV form keeps it as the layout a half holds, and the table's
            # rows (which `rows` may view) change with the next finish
            slots = np.concatenate((ctx_slots, rows)) if ctx_slots else rows.copy()
            flight = FlightLists(kv, slots if kv.lists == 1 else slots * kv.lists)
            if undo:  # the kept rows whose list grew (a step's few: one by one)
                row_of, lists = t.row_of.item, kv.lists
                grew = [r for r in (row_of(row // lists) for _, row, _ in undo) if 0 <= r < kept]
                grown = np.array(grew, np.int64) if grew else _EMPTY
        prompts: list[np.ndarray] = [t.prompt_arrays[s] for s in ctx_slots]  # type: ignore[misc]
        longest = max(map(len, prompts), default=0)
        cont = Continue(
            sizes=step_sizes(
                len(context), ctx_tokens, 0, longest, n, n, 0, 1, generation_length(n, 0, t.limits)
            ),
            ctx_slots=ctx_slots,
            ctx_begin=ctx_begin,
            ctx_chunk=ctx_chunk,
            ctx_prompts=prompts,
            ctx_ends=ends,
            rows=rows,
            tokens=values,
            seq_tokens=np.concatenate((ends, gen_tokens)) if ends else gen_tokens,
            kept=kept,
            at=at,
            gen_prompt_len=gen_prompt_len,
            flight=flight,
            grown=grown,
        )
    except BaseException:
        _undo(undo, [])
        raise
    return _in_place(t, values, undo, gather, gathered, cont, (positions, promoted, completing))


def _context(
    t: RequestTable, chunks: Mapping[int, int] | None
) -> tuple[list[tuple[Entry, int, int]], list[tuple[int, int]], list[int]]:
    """This step's context requests (entry, position, chunk) in arrival order, each
    slot's prompt position after the step, and the slots whose prompt it finishes."""
    if chunks is None:
        scheduled: dict[int, int | None] = {s: None for s in t.waiting}
    else:
        for slot in chunks:
            if slot not in t.waiting:
                raise BatchError(
                    f"step(): chunks[{show(slot)}]: that seq slot holds no request in its "
                    "context phase"
                )
        scheduled = {s: chunks[s] for s in t.waiting if s in chunks}
    context, positions, completing = [], [], []
    for slot, size in scheduled.items():
        entry = t.entries[slot]
        assert entry is not None
        begin, n = int(t.position[slot]), int(t.prompt_len[slot])
        if size is None:
            size = n - begin
        elif not is_int(size) or not 1 <= size <= n - begin:
            raise BatchError(
                f"step(): chunks[{slot}] = {show(size)}, not a chunk size in 1 .. "
                f"{n - begin} (the prompt tokens left)"
            )
        size = int(size)
        entry.context_position, entry.context_chunk_size = begin, size
        context.append((entry, begin, size))
        positions.append((slot, begin + size))
        if begin + size == n:
            completing.append(slot)
    return context, positions, completing


def _check_tokens(values: np.ndarray, L: Limits) -> None:
    if not in_range(values, 0, L.token_limit):
        bad = np.flatnonzero((values < 0) | (values >= L.token_limit))[0]
        raise BatchError(
            f"step(): token {values[bad]} of a request in flight is outside 0 .. "
            f"{L.token_limit - 1} ({L.token_limit_text})"
        )


def _row_tokens(tokens: Any, rows: np.ndarray, L: Limits) -> np.ndarray:
    """The sampled token of each slot in `rows` (one beam each), not yet checked."""
    if (
        type(tokens) is np.ndarray
        and tokens.ndim == 1
        and tokens.dtype == np.int64
        and len(tokens) >= L.max_batch_size
    ):  # the common case: one column, indexed by slot
        return tokens[rows]
    return _token_table(tokens, L)[:, 0][rows]


def _empty(tokens: Any) -> bool:
    try:
        return len(tokens) == 0
    except TypeError:
        return False


def _token_table(tokens: Any, L: Limits) -> np.ndarray:
    """The sampled tokens as an int64 [slots, k] table (k columns per slot, one per beam)."""
    slots = L.max_batch_size
    if tokens is None:
        raise BatchError(
            "step(): the last step produced tokens; pass them (tokens[seq_slot], or "
            "tokens[seq_slot, beam])"
        )
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64 and len(tokens) >= slots:
        if tokens.ndim == 2:  # the common cases: already a table, or one column of it
            return tokens
        if tokens.ndim == 1:
            return tokens.reshape(len(tokens), 1)
    try:
        a = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError):
        raise BatchError("step() needs integer tokens indexed by seq slot") from None
    if a.dtype.kind not in "iu" or a.ndim not in (1, 2) or len(a) < slots:
        raise BatchError(
            f"step() needs integer tokens indexed by seq slot: an array of {slots} rows "
            f"(max_batch_size), or [{slots}, beams]; got {a.dtype} of shape {list(a.shape)}"
        )
    if isinstance(tokens, np.ndarray):  # a list's ints are read as int64
        check_token_dtype(a.dtype, L.token_limit, L.token_limit_text, "step()", False)
    elif _has_bool(tokens, a.ndim):
        raise BatchError("step() needs integer tokens indexed by seq slot; got a bool among them")
    if a.dtype.kind == "u" and a.size and int(a.max()) > INT32_MAX:
        raise BatchError("step(): a token is outside the int32 range")
    a = a.astype(np.int64, copy=False)
    return a.reshape(len(a), 1) if a.ndim == 1 else a


def _has_bool(values: Any, ndim: int) -> bool:
    """A bool among a list's (or a list of lists') values, which numpy reads as 0 or 1."""
    rows = values if ndim == 1 else chain.from_iterable(values)
    return not BOOLS.isdisjoint(frozenset(map(type, rows)))


def _drafts(values: Any, slot: int, entry: Entry, L: Limits) -> np.ndarray:
    a = int_array(values)
    w = f"step(): drafts[{slot}]"
    if a is None:
        raise BatchError(f"{w} must be a list of token ids, got {show(values)}")
    if len(a) > L.max_draft_tokens:
        raise BatchError(f"{w}: {len(a)} draft tokens exceed max_draft_tokens={L.max_draft_tokens}")
    if len(a) and entry.beam_width > 1:
        raise BatchError(f"{w}: draft tokens need beam_width 1, got {entry.beam_width}")
    if not in_range(a, 0, L.token_limit):
        raise BatchError(
            f"{w}: a draft token is outside 0 .. {L.token_limit - 1} ({L.token_limit_text})"
        )
    return a
