"""A step's rows from the request table: its ``Batch`` (``step_view``, through the one
builder ``batch.view``), where each generation sequence's KV row is among the last step's
(``flight_rows``), the gather of tokens that stay on the device (``device_gather``), and the sequences
whose block lists grew in a step in place (``grown_lists``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from ..errors import BatchError
from .batch import Batch, FlightRows, view
from .table import _beam_index
from .values import INT32_MAX

if TYPE_CHECKING:
    from .table import Entry, RequestTable


@dataclasses.dataclass(frozen=True)
class TokenGather:
    """A step's gather of tokens that stay on the device: value i is the flat element
    ``src[i]`` of the tokens; the first ``len(dst)`` go to input position ``dst[i]`` (the
    others only go back to the host)."""

    src: np.ndarray
    dst: np.ndarray


def step_view(
    t: RequestTable,
    context: list[tuple[Entry, int, int]],
    rows: np.ndarray,
    row_entries: list[Entry],
    generated: np.ndarray,
    last: np.ndarray,
    ndraft: np.ndarray,
    grew: set[int],
) -> Batch:
    n_ctx = len(context)
    ctx = tuple(e for e, _, _ in context)
    # one conversion for the context columns (rows of one table: a step has few context
    # requests, and numpy's cost per call outweighs its loops at these sizes)
    prompt_len = t.prompt_len
    columns = np.array(
        [
            (e.seq_slot, begin, chunk, prompt_len[e.seq_slot], len(e.context_drafts))
            for e, begin, chunk in context
        ],
        np.int64,
    ).reshape(-1, 5)
    ctx_slots, c_begin, c_chunk, c_plen, c_ndraft = columns.T
    g_bw = t.beam_width[rows]
    # no drafts in the last step nor in this one: the zero column without a gather
    undrafted = not t.drafted and ndraft is t.ndraft
    g_ndraft = t.no_drafts[: len(rows)] if undrafted else ndraft[rows]
    g_max = generated[rows]
    wide = bool(t.n_wide) and bool((g_bw > 1).any())
    explicit: tuple[int, ...] = ()
    if t.n_explicit:
        c_explicit = [i for i, e in enumerate(ctx) if e.position_ids is not None]
        g_last = t.explicit_last[rows]
        g_explicit = np.flatnonzero(g_last >= 0)
        after = g_last[g_explicit] + g_max[g_explicit]
        if after.size and int(after.max()) > INT32_MAX:
            slot = int(rows[g_explicit[np.argmax(after)]])
            raise BatchError(
                f"generation request in seq_slot {slot}: its generated tokens' positions "
                "run past the int32 range"
            )
        explicit = tuple(c_explicit + (g_explicit + n_ctx).tolist())
    return view(
        ctx,
        tuple(row_entries),
        t.limits,
        ctx=(c_begin, c_chunk, c_plen, c_ndraft),
        gen=(g_bw, prompt_len[rows], g_ndraft, g_max),
        slots=np.concatenate((ctx_slots, rows)),
        last=_sequence_values(last, rows, g_bw, t.n_wide),
        explicit=explicit,
        prompts={id(e): (e.prompt, t.prompt_arrays[e.seq_slot]) for e in ctx},
        encoder=t.encoder,
        flight=flight_rows(t, rows, g_bw, wide, grew),
    )


def flight_rows(
    t: RequestTable, rows: np.ndarray, widths: np.ndarray, wide: bool, grew: set[int]
) -> FlightRows:
    """Where this step's generation sequences are among the last step's KV rows (every
    step keeps its rows, ``core.advance_kv`` too, so a list grown in a step in place is in
    them), the sequences to rebuild (new ones, and those of slots whose lists grew in this
    step), each sequence's list length and the lists to rebuild.

    One beam each, the rows kept from the last full step are where they were, but those
    that ``finish`` refilled; the finished prompts follow them. With beams, each sequence's
    row is looked up (a refilled row of another width shifts the sequences after it)."""
    n_old = t.n_rows if len(rows) else 0  # kept rows, then the promoted ones
    moved: np.ndarray | None = None
    same = 0
    refill: tuple[tuple[int, int], ...] = ()
    if wide:
        slots, beam = _beam_index(rows, widths)
        base = t.kept_first[slots]
        moved = np.where(base >= 0, base + beam, -1)
        changed = (moved < 0).nonzero()[0].tolist()
    elif not t.kept_rows:  # the last full step ran no generation rows: none is kept
        slots, changed = rows, list(range(len(rows)))
    elif t.kept_one_beam:
        slots, same = rows, n_old
        refill = tuple((i, int(t.kept_first[rows[i]])) for i in sorted(t.refilled) if i < n_old)
        changed = list(range(n_old, len(rows)))
    else:  # the kept rows are a step's with beams: each sequence's is looked up
        slots, moved = rows, t.kept_first[rows]
        changed = (moved < 0).nonzero()[0].tolist()
    # the sequences of kept rows whose lists grew (new rows are rebuilt anyway)
    if grew and len(changed) < len(slots):
        first = np.cumsum(widths) - widths if wide else None
        for slot in grew:
            row = int(t.row_of[slot])
            if not 0 <= row < n_old:  # in its context phase, or promoted in this step
                continue
            seq = row if first is None else int(first[row])
            if moved is None or moved[seq] >= 0:
                changed.extend(range(seq, seq + int(t.beam_width[slot])))
        changed.sort()
    if t.n_unlisted:  # a request in flight whose lists the KV check walks
        n_lists = t.n_lists[slots]
        if len(slots) and not n_lists.all():
            return FlightRows(t.full, t.full + 1, moved, changed, same=same, refill=refill)
    at = slots[changed].tolist()
    entries = t.entries
    if wide:
        counts = t.n_blocks
        if grew:
            counts = counts.copy()
            for slot in grew:
                t.count_blocks(slot, t.held(slot).kv_block_ids, counts)
        column = np.where(t.n_lists[slots] > 1, beam, 0)
        lengths = counts[slots, column]
        columns = column[changed].tolist()
        lists = [entries[s].kv_block_ids[k] for s, k in zip(at, columns)]  # type: ignore[union-attr]
    else:  # one sequence per slot: its first list (the grown ones' lengths patched in,
        # rather than a copy of the whole count table)
        lengths = t.n_blocks[:, 0][slots]
        if grew:
            tail = rows[n_old:].tolist()
            for slot in grew:
                row = int(t.row_of[slot])
                if row < 0 and slot in tail:
                    row = n_old + tail.index(slot)
                if 0 <= row < len(rows):  # a slot in its context phase has no row
                    lengths[row] = len(t.held(slot).kv_block_ids[0])  # type: ignore[index]
        lists = [entries[s].kv_block_ids[0] for s in at]  # type: ignore[union-attr]
    return FlightRows(t.full, t.full + 1, moved, changed, lengths, lists, same=same, refill=refill)


def device_gather(
    t: RequestTable, b: Batch, k: int, producers: np.ndarray
) -> tuple[TokenGather, tuple[np.ndarray, np.ndarray]]:
    """The device gather of a full step: each generation sequence of a producing slot
    takes ``tokens[slot, beam]`` into its first input token (core.token_ids' layout:
    context tokens, then per request each beam's token and the drafts); the tokens of
    producing slots without a row this step are only taken back."""
    n_ctx = b.sizes.num_context_requests
    slots = b.seq_slot[n_ctx:]
    bw, starts = b.gen_beam_width, b.gen_starts
    if t.n_wide and (bw > 1).any():
        seq_slots, beams = _beam_index(slots, bw)
        dst = np.repeat(starts, bw) + beams
    else:
        seq_slots, beams, dst = slots, np.zeros(len(slots), np.int64), starts
    mask = np.zeros(t.limits.max_batch_size, bool)
    mask[producers] = True
    take = mask[seq_slots]
    if not take.all():
        seq_slots, beams, dst = seq_slots[take], beams[take], dst[take]
    if len(seq_slots) < int(t.beam_width[producers].sum()):  # producers without a row
        mask[seq_slots] = False
        rest = producers[mask[producers]]
        s, bm = _beam_index(rest, t.beam_width[rest])
        seq_slots, beams = np.concatenate((seq_slots, s)), np.concatenate((beams, bm))
    gather = TokenGather(seq_slots * k + beams, dst)
    return gather, (seq_slots, beams)


def grown_lists(t: RequestTable, grew: dict[int, list[int]], rows: np.ndarray) -> tuple:
    """(sequence, length before) for each sequence of a slot whose lists grew."""
    if not t.n_wide:  # one sequence per row
        return tuple((int(t.row_of[slot]), before[0]) for slot, before in grew.items())
    widths = t.beam_width[rows]
    first = np.cumsum(widths) - widths if t.n_wide else None
    out = []
    for slot, before in grew.items():
        row = int(t.row_of[slot])
        seq = row if first is None else int(first[row])
        for k in range(int(t.beam_width[slot])):
            out.append((seq + k, before[k if len(before) > 1 else 0]))
    return tuple(out)


def _beam_values(tok: np.ndarray, slots: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """tok[slot, beam] for each beam of each slot."""
    return tok[_beam_index(slots, widths)]


def _sequence_values(
    last: np.ndarray, rows: np.ndarray, widths: np.ndarray, wide: int
) -> np.ndarray:
    """Each generation sequence's last token, in row order."""
    if not wide or not (widths > 1).any():
        return last[rows, 0]
    return _beam_values(last, rows, widths)
