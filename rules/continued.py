"""The continue forms of the core rules: a step of requests in flight whose context rows have
the last step's layout continues the last step's buffers in place (``decode.Continue``).

A continue form writes the whole step into ``out`` (this step's buffer half) and returns the
elements written, as the rule's fill would: the context rows from the step's few context
requests, and the generation rows, which start where the last step's did. A per-sequence value
is written whole from the columns the plan computed for every row anyway (its tokens after the
step, its prompt length): one numpy call, as cheap as continuing it; the KV rows, [rows,
K/V, max_blocks_per_seq], continue from ``prev`` (the last step's half), only the rows that
changed rewritten. One call per tensor and a constant number of numpy calls, whatever the batch
size, beyond the rows that changed. A continue check runs before anything is written.
"""

from __future__ import annotations

import numpy as np

from ..errors import BatchError
from .core import chunk_positions
from .decode import Continue
from .kv_rows import _EMPTY, Held, KeptRows, SlotRows, write_lists

# Kept KV rows past this many elements are not copied from the last step's half: the rows that
# differ from what this half holds are found and rewritten instead (on the 2-core machine the
# copy of 32k int32 costs about what the comparison of 1024 rows does)
KEPT_COPY = 1 << 15


def continue_tokens(out: np.ndarray, prev: np.ndarray, g: Continue) -> int:
    """Each context chunk's prompt tokens, then each generation row's new token."""
    o = 0
    for prompt, begin, k in zip(g.ctx_prompts, g.ctx_begin, g.ctx_chunk):
        out[o : o + k] = prompt[begin : begin + k]
        o += k
    n = o + len(g.tokens)
    out[o:n] = g.tokens
    return n


def continue_positions(out: np.ndarray, prev: np.ndarray, g: Continue) -> int:
    """Each chunk's positions; a generation row's one position, its tokens before this step."""
    o = chunk_positions(out, g.ctx_begin, g.ctx_chunk)
    n = len(g.tokens)
    np.subtract(g.seq_tokens[len(g.ctx_chunk) :], 1, out=out[o : o + n])
    return o + n


def continue_sequence_lengths(out: np.ndarray, prev: np.ndarray, g: Continue) -> int:
    """Each row's tokens after this step (a chunk's through it)."""
    n = len(g.seq_tokens)
    out[:n] = g.seq_tokens
    return n


def continue_past_key_value_lengths(out: np.ndarray, prev: np.ndarray, g: Continue) -> int:
    """A chunk's tokens through this step; a generation row's tokens before it (tokens - 1,
    past_key_value_lengths' convention)."""
    n, n_ctx = len(g.seq_tokens), len(g.ctx_ends)
    out[:n_ctx] = g.ctx_ends
    np.subtract(g.seq_tokens[n_ctx:], 1, out=out[n_ctx:n])
    return n


def continue_context_lengths(out: np.ndarray, prev: np.ndarray, g: Continue) -> int:
    """A chunk's tokens; a generation row its prompt length (no drafts)."""
    n_ctx = len(g.ctx_chunk)
    out[:n_ctx] = g.ctx_chunk
    n = n_ctx + len(g.gen_prompt_len)
    out[n_ctx:n] = g.gen_prompt_len
    return n


def continue_seq_slots(out: np.ndarray, prev: np.ndarray, g: Continue) -> int:
    """Each request's seq slot, context requests first: the generation rows are the step's
    rows (``g.rows``), written whole."""
    n_ctx = len(g.ctx_slots)
    out[:n_ctx] = g.ctx_slots
    n = n_ctx + len(g.rows)
    out[n_ctx:n] = g.rows
    return n


def continue_request_types(out: np.ndarray, prev: np.ndarray, g: Continue) -> int:
    """0 for each context row, 1 for each generation row."""
    n_ctx, n = len(g.ctx_slots), g.sizes.num_sequences
    out[:n_ctx] = 0
    out[n_ctx:n] = 1
    return n


def continue_last_token_ids(out: np.ndarray, prev: np.ndarray, g: Continue) -> int:
    """1-based: each chunk's last token, then each generation row's one token."""
    o = 0
    for i, k in enumerate(g.ctx_chunk):
        o += k
        out[i] = o
    n_ctx, n = len(g.ctx_chunk), g.sizes.num_logits
    out[n_ctx:n] = np.arange(o + 1, o + 1 + n - n_ctx)
    return n


def check_kv_continued(
    g: Continue, kept: KeptRows, *, max_blocks_per_seq: int, tokens_per_block: int
) -> KeptRows:
    """Every row's block list, as the block table counts it (this step's appends included),
    covers its tokens after the step, or fills the window; the ids were checked when the
    table took them. Hands the KV rows' state on to the continue form."""
    flight = g.flight
    assert flight is not None  # a family with a paged KV cache
    count = flight.blocks.count[flight.index]
    below = count * tokens_per_block < g.seq_tokens  # short, unless the list fills the window
    short = below & (count < max_blocks_per_seq) if np.count_nonzero(below) else None
    if short is not None and np.count_nonzero(short):
        row = int(np.flatnonzero(short)[0])
        n_ctx = len(g.ctx_slots)
        kind = "context" if row < n_ctx else "generation"
        slot = int(flight.index[row]) // flight.blocks.lists
        tokens = int(g.seq_tokens[row])
        raise BatchError(
            f"{kind} request in seq_slot {slot}: its token {tokens} needs KV block "
            f"{(tokens - 1) // tokens_per_block}, which kv_block_ids does not hold; allocate "
            "the block before this step"
        )
    return kept


def continue_kv(
    out: np.ndarray,
    prev: np.ndarray,
    g: Continue,
    kept: KeptRows,
    *,
    max_blocks_per_seq: int,
    kv_pool_layers: tuple[int, ...],
    kv_pool_windows: tuple[int, ...],
) -> int:
    """[rows, K/V, max_blocks_per_seq] of one pool (the generator continues a family only
    with one), each row its list from the block table (K = id * 2 * layers, V = K + 1, 0 past
    the list). The last step's rows are copied from `prev` (in place already with one staging
    half) and the rows that differ from them rewritten (the context rows, the rows `g.at` and
    those whose list grew); past KEPT_COPY elements, where this half holds rows a continued step
    wrote (two steps back), only the rows whose list is another one or changed since are
    rewritten, without the copy."""
    width, per_block = max_blocks_per_seq, 2 * kv_pool_layers[0]
    flight = g.flight
    assert flight is not None
    blocks, index = flight.blocks, flight.index
    n, stride = len(index), 2 * width
    rows = out[: n * stride].reshape(n, 2, width)
    slots = kept.slots.get(id(blocks))
    if slots is None or slots.blocks is not blocks:
        slots = kept.slots[id(blocks)] = SlotRows(blocks)
    key = (id(out), 0)
    half = slots.halves.get(key)
    n_ctx, k = len(g.ctx_slots), g.kept
    # this half keeps its layout for the comparison (with one staging half the kept rows are
    # the last step's, in place: no copy to save)
    large = prev is not out and k * stride > KEPT_COPY
    version = blocks.version[index] if large else _EMPTY
    if large and half is not None and half.version is not None and half.out is out:
        m = min(n, len(half.index))
        stale = np.flatnonzero((half.index[:m] != index[:m]) | (half.version[:m] != version[:m]))
        if n > m:
            stale = np.concatenate((stale, np.arange(m, n)))
    else:
        o = n_ctx * stride
        if prev is not out:  # (with one staging half the kept rows are in place)
            out[o : o + k * stride] = prev[o : o + k * stride]
        stale = np.concatenate((np.arange(-n_ctx, 0), g.at, g.grown))
        stale += n_ctx
    if len(stale):
        write_lists(rows, stale, blocks, index[stale], per_block)
    if large:
        held = slots.halves[key] = Held(out, index, blocks.log_end, _EMPTY)
        held.version = version
    else:  # no layout kept: what the half held before is no longer there
        slots.halves.pop(key, None)
    return n * stride
