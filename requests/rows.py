"""A step's rows from the request table: its ``Batch`` (``step_view``, through the one
builder ``batch.view``), where each sequence's KV block list is in the table
(``flight_lists``) and the gather of tokens that stay on the device (``device_gather``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from ..errors import BatchError
from .batch import Batch, FlightLists, view
from .values import EMPTY, INT32_MAX, beam_index

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
    g_max: np.ndarray,
    seq_last: np.ndarray,
    ndraft: np.ndarray,
) -> Batch:
    """The step's ``Batch``: its context requests (entry, first position, chunk), then its
    generation `rows` (slots) with their tokens generated per beam once the last step's are
    in (`g_max`), each sequence's last token (`seq_last`) and each slot's drafts (`ndraft`)."""
    n_ctx, n = len(context), len(rows)
    prompt_len = t.prompt_len
    g_bw = t.beam_width[rows] if t.n_wide else t.one_beam[:n]
    wide = bool(t.n_wide) and bool((g_bw > 1).any())
    # no drafts in the last step nor in this one: the zero column without a gather
    undrafted = not t.drafted and ndraft is t.ndraft
    g_ndraft = t.no_drafts[:n] if undrafted else ndraft[rows]
    if n_ctx:
        ctx = tuple(e for e, _, _ in context)
        # the context columns from Python lists, in one array (a step has few context
        # requests: numpy's cost per call outweighs its loops at these sizes)
        ctx_slots, c_begin, c_chunk = np.array(
            [(e.seq_slot, begin, chunk) for e, begin, chunk in context], np.int64
        ).T
        ctx_drafts = [len(e.context_drafts) for e in ctx]
        drafting = any(ctx_drafts)
        c_ndraft = np.array(ctx_drafts, np.int64) if drafting else t.no_drafts[:n_ctx]
        slots = np.concatenate((ctx_slots, rows))
        c_plen = prompt_len[ctx_slots]
        counts = (sum(k for _, _, k in context), max(len(e.prompt) for e in ctx))
    else:  # a decode step
        ctx, drafting, counts = (), False, (0, 0)
        ctx_slots = c_begin = c_chunk = c_plen = c_ndraft = EMPTY
        slots = rows
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
    # one beam, no drafts: the sizes from Python's sums of the few context rows
    plain = counts if not wide and undrafted and not drafting else None
    return view(
        ctx,
        tuple(row_entries),
        t.limits,
        ctx=(c_begin, c_chunk, c_plen, c_ndraft),
        gen=(g_bw, prompt_len[rows], g_ndraft, g_max),
        slots=slots,
        last=seq_last,
        explicit=explicit,
        prompts={id(e): (e.prompt, t.prompt_arrays[e.seq_slot]) for e in ctx} if ctx else {},
        encoder=t.encoder,
        flight=flight_lists(t, ctx_slots, rows, g_bw, wide, slots),
        plain=plain,
    )


def decode_view(t: RequestTable) -> Batch:
    """The ``Batch`` of a steady step (``step.plan(..., steady=True)`` planned none): the
    table's generation rows, each one token longer, no context request, no drafts; each
    sequence's last token as the table holds it (a device that keeps the tokens knows the
    new one)."""
    rows = t.rows[: t.n_rows]
    return step_view(t, [], rows, t.row_entries, t.generated[rows] + 1, t.last[rows, 0], t.ndraft)


def flight_lists(
    t: RequestTable,
    ctx_slots: np.ndarray,
    rows: np.ndarray,
    widths: np.ndarray,
    wide: bool,
    slots: np.ndarray,
) -> FlightLists | None:
    """Each sequence's row in the block table: a context request reads its first list, a
    generation beam its own list, or the one list all its beams share (`slots`: each
    request's seq slot, context first). None for a family without a paged KV cache."""
    kv = t.kv
    if kv is None:
        return None
    if not wide and kv.lists == 1:  # one list per slot, one sequence per request
        return FlightLists(kv, slots, t.kvs if len(t.kvs) > 1 else ())
    if wide:
        gen_slots, beam = beam_index(rows, widths)
        gen_rows = gen_slots * kv.lists + np.where(kv.n_lists[gen_slots] > 1, beam, 0)
    else:
        gen_rows = rows * kv.lists
    index = np.concatenate((ctx_slots * kv.lists, gen_rows))
    return FlightLists(kv, index, t.kvs if len(t.kvs) > 1 else ())


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
        seq_slots, beams = beam_index(slots, bw)
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
        s, bm = beam_index(rest, t.beam_width[rest])
        seq_slots, beams = np.concatenate((seq_slots, s)), np.concatenate((beams, bm))
    gather = TokenGather(seq_slots * k + beams, dst)
    return gather, (seq_slots, beams)


def _beam_values(tok: np.ndarray, slots: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """tok[slot, beam] for each beam of each slot."""
    return tok[beam_index(slots, widths)]


def _sequence_values(
    last: np.ndarray, rows: np.ndarray, widths: np.ndarray, wide: int
) -> np.ndarray:
    """Each generation sequence's last token, in row order."""
    if not wide or not (widths > 1).any():
        return last[rows, 0]
    return _beam_values(last, rows, widths)
