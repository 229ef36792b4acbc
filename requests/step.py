"""One step of the requests in flight, planned against the request table: the tokens the last
step produced, accepted and new drafts, KV blocks appended, context chunks; each checked before
anything is kept, the step's ``Batch`` laid out (``rows.step_view``), and a ``Plan`` that the
table commits once the step has run (``Plan.undo`` restores the block lists and drafts a failed
step set). A step where only the tokens changed is planned without a batch (``_steady``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import BatchError
from .batch import Batch, Limits
from .blocks import BlockTable, check_window_keys, window_lists
from .rows import (
    TokenGather,
    _sequence_values,
    device_gather,
    step_view,
)
from .sampled import Sampled, check_tokens, produced_tokens, row_tokens, token_table
from .table import Entry, RequestTable
from .values import EMPTY, beam_index, check_draft_count, in_range, int_array, is_int, show

FEW_BLOCKS = 8  # block appends to more slots than this are checked and written at once


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
    # (table, row, its list's length before): rows and lengths may be arrays of them
    undo_blocks: list[tuple[BlockTable, Any, Any]]
    undo_drafts: list[tuple[Entry, Any]]
    generation: bool = True  # the generation rows ran (and produce tokens)
    # tokens that stay on the device: the gather the step runs there, and the (slot, beam) of
    # each value it copies back (their state entries once they land)
    gather: TokenGather | None = None
    gathered: tuple[np.ndarray, np.ndarray] | None = None
    # the step's generation rows when each produced one token, `tokens` (the table's counts
    # and last tokens are moved in place at commit, `generated` and `last` its own)
    in_place: np.ndarray | None = None
    # the slots whose last step produced the tokens this step takes in
    producers: np.ndarray = dataclasses.field(default_factory=lambda: EMPTY)

    def undo(self) -> None:
        """The step failed: the block lists and drafts it set are as they were."""
        _undo(self.undo_blocks, self.undo_drafts)


def _undo(
    blocks: list[tuple[BlockTable, Any, Any]],
    drafts: list[tuple[Entry, Any]],
) -> None:
    for table, row, before in blocks:
        table.undo(row, before)
    for entry, values in drafts:
        entry.draft_tokens = values


def commit(t: RequestTable, plan: Plan) -> None:
    """The planned step ran: the table holds the state it leaves (its only writer besides
    ``add``, ``finish`` and ``tokens_back``)."""
    in_place = plan.generated is None  # a steady step's tokens
    if plan.gathered is not None:
        slots, beams = plan.gathered
        # a steady step of one-beam rows: the serials are read only if a request arrives
        # or leaves before the values are back (_serials_pending)
        one_beam = in_place and not t.n_wide
        t.pending = (slots, beams, None if one_beam else t.serial[slots])
    if in_place:  # the rows, each one token longer; nothing else changed
        assert plan.tokens is not None
        rows = t.rows[: t.n_rows]
        t.generated[rows] += 1
        widths = t.beam_width[rows] if t.n_wide else None
        if plan.gathered is not None:
            pass  # the tokens are the device's: tokens_back sets them
        elif plan.tokens.values is EMPTY:
            pass  # the device keeps them (a plan without a gather)
        elif widths is None or not (widths > 1).any():
            t.last[:, 0][rows] = plan.tokens.values  # one axis: a cheaper scatter
        else:
            t.last[beam_index(rows, widths)] = plan.tokens.values
        return
    assert plan.last is not None and plan.generated is not None
    t.generated, t.last, t.ndraft, t.drafted = (
        plan.generated,
        plan.last,
        plan.ndraft,
        plan.drafted,
    )
    if plan.in_place is not None:  # each row one token longer
        assert plan.tokens is not None
        t.generated[plan.in_place] += 1
        t.last[:, 0][plan.in_place] = plan.tokens.values
    t.steady_gather = None  # rows may have joined
    for slot in plan.promoted:
        n = t.n_rows
        t.rows[n] = slot
        t.row_of[slot] = n
        t.row_entries.append(t.held(slot))
        t.n_rows = n + 1
    for slot, position in plan.positions:
        t.position[slot] = position
    for slot in plan.completing:
        del t.waiting[slot]
    t.completing = plan.completing
    t.produced = t.rows[: t.n_rows].copy() if plan.generation else EMPTY
    t.rows_produced = plan.generation
    t.left = []
    t.changed = False


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
    gather: bool = True,
) -> Plan:
    """Check the next step and lay it out; nothing is committed (``commit``) and only the
    block lists and drafts are set on the entries and the block table (``Plan.undo`` restores
    them). Every block id handed over is checked as it is appended, whether its request runs
    in this step or waits.

    `steady`: the last step can be continued in place (generation only, no drafts); the
    plan then has no batch when nothing but the tokens changed. `gather`: False for tokens the
    device keeps (the device build): no gather is laid out, the plan names the slots that
    produced (``Plan.producers``). `on_device`: `tokens` is ``OnDevice``, a tensor on the
    buffers' device gathered there (``Plan.gather``)."""
    if t.bad:
        _refuse_bad(t)
    if (
        steady
        and generation
        and not (t.changed or t.completing or t.waiting)
        and not (drafts or accepted or t.drafted or chunks)  # (chunks: refused in full)
        and t.n_rows
        and t.rows_produced  # (the last step ran the rows: each has its new token)
    ):
        return _steady(t, tokens, blocks, on_device, gather)
    undo_blocks: list[tuple[BlockTable, Any, Any]] = []
    undo_drafts: list[tuple[Entry, Any]] = []
    try:
        # this step's generation rows: the rows in flight, then the prompts the last step
        # finished (written past n_rows, which commit moves over them)
        n_old, promoted = t.n_rows, t.completing
        if promoted:
            t.rows[n_old : n_old + len(promoted)] = promoted
        rows = t.rows[: n_old + len(promoted)].copy() if generation else EMPTY
        if promoted and generation:
            row_entries = t.row_entries + [t.held(s) for s in promoted]
        else:
            row_entries = t.row_entries if generation else []
        if drafts and not generation:
            raise BatchError("step(): drafts given, but generation=False runs no generation")
        in_place = None
        if rows.size and t.rows_produced and not (t.n_wide or on_device or accepted):
            # every row produced a token in the last step (the usual step): each row's token
            # read straight by its slot, the counts moved at commit
            in_place = producers = rows
            seq_last = row_tokens(tokens, rows, t.limits)
            check_tokens(seq_last, t.limits)
            generated, last = t.generated, t.last
            g_max = generated[rows] + 1
        else:
            # the tokens the last step produced: its generation rows still in flight (a slot
            # whose request left produces nothing) and the prompts it finished
            alive = t.produced
            if t.left:
                gone = np.zeros(t.limits.max_batch_size, bool)
                gone[t.left] = True
                alive = alive[~gone[alive]]
            producers = np.concatenate((promoted, alive)) if promoted else alive
            generated, last = produced_tokens(t, tokens, producers, on_device)
            if accepted:
                generated = _accepted(t, accepted, generated, producers, promoted)
            g_max = generated[rows]
            seq_last = _sequence_values(
                last, rows, t.beam_width[rows] if t.n_wide else EMPTY, t.n_wide
            )
        ndraft, drafted = _step_drafts(t, drafts, promoted, rows, undo_drafts)
        _grow(t, blocks, undo_blocks)
        context, positions, completing = _context(t, chunks)
        batch = step_view(t, context, rows, row_entries, g_max, seq_last, ndraft)
        laid_out, gathered = (
            device_gather(t, batch, tokens.columns, producers)
            if on_device and gather and producers.size
            else (None, None)
        )
        return Plan(
            batch=batch,
            tokens=None if in_place is None else Sampled(seq_last),
            generated=generated,
            last=last,
            in_place=in_place,
            ndraft=ndraft,
            drafted=drafted,
            positions=positions,
            promoted=promoted,
            completing=completing,
            undo_blocks=undo_blocks,
            undo_drafts=undo_drafts,
            generation=generation,
            gather=laid_out,
            gathered=gathered,
            producers=producers,
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
    if drafts or drafted or (promoted and any(t.held(s).context_drafts for s in promoted)):
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
    t: RequestTable, blocks: Mapping[int, Any] | None, undo: list[tuple[BlockTable, Any, Any]]
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
        if len(blocks) > FEW_BLOCKS and kv.append_many(blocks, undo):
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
    t: RequestTable,
    tokens: Any,
    blocks: Mapping[int, Any] | None,
    on_device: bool,
    gather: bool = True,
) -> Plan:
    """A step of the same generation rows where only the tokens changed (and block lists
    may grow): the fewest calls, the state updated at commit."""
    L = t.limits
    rows = t.rows[: t.n_rows]
    widths = t.beam_width[rows] if t.n_wide else EMPTY
    values = None
    if on_device:
        k = tokens.columns
    elif not t.n_wide:  # one beam each: the slots' first column
        values, k = row_tokens(tokens, rows, L), 1
    else:
        tok = token_table(tokens, L)
        k = tok.shape[1]
    if t.n_wide and int(widths.max()) > k:
        raise BatchError(
            f"step(): tokens has {k} column(s) per slot, but a request in flight has "
            f"{int(widths.max())} beams"
        )
    laid_out, gathered = None, None
    if not on_device:
        if values is None:
            values = _sequence_values(tok, rows, widths, t.n_wide)
        check_tokens(values, L)
    elif not gather:  # the device keeps the tokens: nothing to lay out
        values = EMPTY
    else:  # the host writes the last tokens it knows; the device then writes the new
        values = _sequence_values(t.last, rows, widths, t.n_wide)
        held = t.steady_gather
        if held is None or held[0] != k:  # the rows changed since: laid out once a run
            if not t.n_wide or not (widths > 1).any():
                slots, beams = rows.copy(), np.zeros(len(rows), np.int64)
            else:
                slots, beams = beam_index(rows, widths)
            held = t.steady_gather = (
                k,
                slots * k + beams,
                np.arange(len(slots)),
                slots,
                beams,
            )
        laid_out = TokenGather(held[1], held[2])
        gathered = (held[3], held[4])
    undo: list[tuple[BlockTable, Any, Any]] = []
    try:
        _grow(t, blocks, undo)
    except BaseException:
        _undo(undo, [])
        raise
    return Plan(
        batch=None,
        tokens=Sampled(values),
        generated=None,
        last=None,
        ndraft=t.ndraft,
        drafted=[],
        positions=[],
        promoted=[],
        completing=[],
        undo_blocks=undo,
        undo_drafts=[],
        gather=laid_out,
        gathered=gathered,
        producers=rows,
    )


def _context(
    t: RequestTable, chunks: Mapping[int, int] | None
) -> tuple[list[tuple[Entry, int, int]], list[tuple[int, int]], list[int]]:
    """This step's context requests (entry, position, chunk) in arrival order, each
    slot's prompt position after the step, and the slots whose prompt it finishes."""
    if chunks is None:
        if not t.waiting:  # a decode step
            return [], [], []
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


def _drafts(values: Any, slot: int, entry: Entry, L: Limits) -> np.ndarray:
    a = int_array(values)
    w = f"step(): drafts[{slot}]"
    if a is None:
        raise BatchError(f"{w} must be a list of token ids, got {show(values)}")
    check_draft_count(len(a), entry.beam_width, L.max_draft_tokens, w)
    if not in_range(a, 0, L.token_limit):
        raise BatchError(
            f"{w}: a draft token is outside 0 .. {L.token_limit - 1} ({L.token_limit_text})"
        )
    return a
