"""TensorRT-LLM's paged KV-cache block offsets: each sequence's block ids encoded as the
attention plugin reads them, for every KV pool, with their advance form and the checks they
rely on (docs/contract.md).

A sequence's row holds its block list's KVCacheIndex values ([K/V, max_blocks_per_seq], 0 past
its blocks), in each pool of its attention window. In flight the rows are gathered from the
block tables, which keep them encoded as the ids arrive (``BlockTable.encoded``); a stateless
step converts the request's lists, keeping the generation rows between steps (``KeptRows``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import BatchError
from ..requests.batch import Batch, FlightLists
from ..requests.values import is_int
from .decode import Decode
from .kv_rows import (
    BlockPlan,
    KeptRows,
    check_block_lists,
    check_cover,
    sequence_keys,
    write_at,
    write_kv_rows,
)


def check_kv_blocks(
    b: Batch,
    kept: KeptRows,
    *,
    max_blocks_per_seq: int,
    tokens_per_block: int,
    num_local_layers: int,
    num_kv_blocks: int = 0,
) -> BlockPlan:
    """Every sequence's kv_block_ids cover its tokens after the step, within
    max_blocks_per_seq, with ids in the pool; returns the converted lists for the fill (only
    those that differ from the rows kept from the last step). The id bound is the request
    table's, the one it checks appended ids against: ``b.limits.kv_limit``, made from
    `num_kv_blocks` and the layers of the largest KV pool (`num_local_layers` in a family
    with no pools)."""
    return check_block_lists(
        b,
        "kv_block_ids",
        tokens=b.seq_kv_tokens,
        tokens_per_block=tokens_per_block,
        width=max_blocks_per_seq,
        width_name="max_blocks_per_seq",
        limit=b.limits.kv_limit,  # the request table's bound (batch.limits)
        what="KV",
        kept=kept,
    )


def kv_cache_block_offsets(
    out: np.ndarray,
    b: Batch,
    plan: BlockPlan,
    *,
    max_blocks_per_seq: int,
    kv_pool_layers: tuple[int, ...],
    kv_pool_windows: tuple[int, ...],
) -> int:
    """[pools, sequences, K/V, max_blocks_per_seq] block indices, one row per sequence.

    Index encoding (TensorRT-LLM's KVCacheIndex for a pool laid out [blocks, layers in the
    pool, K/V, ...]): (block_id * layers in the pool + 0) * 2 + (0 for K, 1 for V); the kernel
    adds the layer's index in its pool. Every pool of the window holds the same block ids
    (``other_pools``); with several attention windows, the pools of each window take its own
    block lists.
    Columns past a sequence's own blocks hold 0 (the reference leaves them stale); the check
    made sure every column the sequence's tokens need is given. A context request fills one
    row, even with beam_width > 1: the reference writes one row per beam but advances by one,
    so the next request overwrites them (a bug; fixed by writing one row).

    Stateless steps keep the generation rows from step to step with a copy of the block lists
    they were built from: a list equal to its copy (compared by value, so a list changed in
    place is seen) keeps its row, so steady decoding converts only the lists that changed; when
    requests finish or arrive, a kept row moves with its sequence, and only the rows of new
    sequences and of changed lists are built. Requests in flight gather each row from its
    block table's encoded rows (``BlockTable.encoded``, written with the ids).
    """
    width, layers = max_blocks_per_seq, kv_pool_layers[0]
    kept = plan.kept
    assert kept is not None  # check_kv_blocks hands its state on
    kept.entered = []  # advance() continues from these rows
    if plan.slots is not None:  # in flight: each sequence's row from its slot's
        return _in_flight(plan.slots, out, width, kv_pool_layers, kv_pool_windows)
    rows = out[: b.sizes.num_sequences * 2 * width].reshape(b.sizes.num_sequences, 2, width)
    n_ctx = b.sizes.num_context_requests
    k = int(plan.lengths[:n_ctx].sum())
    write_kv_rows(rows[:n_ctx], plan.blocks[:k], plan.lengths[:n_ctx], layers)
    gen = plan.lists[n_ctx:]
    if plan.changed is None or kept.table is None or kept.snapshot is None:
        kept.snapshot = [x if type(x) is tuple else list(x) for x in gen]
        kept.table = np.empty_like(rows[n_ctx:])
        write_kv_rows(kept.table, plan.blocks[k:], plan.lengths[n_ctx:], layers)
        kept.requests, kept.keys = b.generation, sequence_keys(b)
    elif plan.moved is not None:  # the requests changed: kept rows follow their sequences
        assert plan.changed is not None and kept.table is not None
        old = kept.snapshot
        snapshot = [old[j] if j >= 0 else None for j in plan.moved]
        for i in plan.changed:
            snapshot[i] = gen[i] if type(gen[i]) is tuple else list(gen[i])
        table = np.empty_like(rows[n_ctx:])
        _take_rows(table, kept.table, plan.moved)
        write_at(table, plan.changed, plan.blocks[k:], plan.lengths[n_ctx:], layers)
        kept.table = table
        kept.snapshot = snapshot
        kept.requests, kept.keys = b.generation, plan.keys
    elif plan.changed:
        for i in plan.changed:
            kept.snapshot[i] = gen[i] if type(gen[i]) is tuple else list(gen[i])
        write_at(kept.table, plan.changed, plan.blocks[k:], plan.lengths[n_ctx:], layers)
    rows[n_ctx:] = kept.table
    return other_pools(out, rows.size, width, kv_pool_layers, kv_pool_windows)


def _in_flight(
    flight: FlightLists,
    out: np.ndarray,
    width: int,
    pool_layers: tuple[int, ...],
    pool_windows: tuple[int, ...],
) -> int:
    """Requests in flight: the first pool of each window gathered from that window's block
    table's encoded rows (one take), then the window's other pools from it."""
    index = flight.index
    n = len(index) * 2 * width
    for k, table in enumerate(flight.per_window()):
        p = pool_windows.index(k) if flight.tables else 0  # the window's first pool
        rows = out[p * n : (p + 1) * n].reshape(len(index), 2, width)
        np.take(table.encoded(2 * pool_layers[p]), index, axis=0, out=rows, mode="clip")
    return other_pools(out, n, width, pool_layers, pool_windows)


def other_pools(
    out: np.ndarray,
    n: int,
    width: int,
    pool_layers: tuple[int, ...],
    pool_windows: tuple[int, ...],
) -> int:
    """The rows of every pool but the first of its window, from that first pool's `n`
    elements (a window's pools take the same block ids, each encoded with its own layer
    count); returns the elements of all pools."""
    if len(pool_layers) == 1:
        return n
    first: dict[int, int] = {}
    for p, (layers, k) in enumerate(zip(pool_layers, pool_windows)):
        if k not in first:
            first[k] = p
            continue
        q = first[k]
        src = out[q * n : (q + 1) * n].reshape(-1, 2, width)
        rows = out[p * n : (p + 1) * n].reshape(-1, 2, width)
        np.multiply(src[:, 0] // pool_layers[q], layers, out=rows[:, 0])  # block id * 2 * layers
        np.add(rows[:, 0], src[:, 1] != 0, out=rows[:, 1])  # V: one further where a block is
    return n * len(pool_layers)


def _take_rows(into: np.ndarray, table: np.ndarray, moved: Any) -> None:
    """into[i] = table[moved[i]]: each kept row where its sequence now is; a row of a sequence
    the table lacks (-1) is left for the caller to build."""
    if len(into) and len(table):  # -1 wraps to some row, overwritten by the caller
        np.take(table, moved, axis=0, out=into, mode="wrap")


# ------------------------------------------------------------------------------ advance forms
def check_kv_entered(
    d: Decode,
    kept: KeptRows,
    *,
    max_blocks_per_seq: int,
    tokens_per_block: int,
    kv_pool_layers: tuple[int, ...],
) -> KvEntered:
    """Find the sequences whose new token starts a KV block and read that block's id from
    their request (the only requests read in a decode step); raise before anything is
    written. In flight every sequence's list, as the block table counts it, must cover its
    new token: the advance form then copies the rows that changed from the table."""
    width, tpb = max_blocks_per_seq, tokens_per_block
    b = d.batch
    if b.flight is not None:  # in flight: the ids from the block table, checked when appended
        check_cover(b, d.seq_tokens, tpb, width)
        return KvEntered(kept, [], b.flight)
    per_block = kv_pool_layers[0] * 2  # the first pool's (the others follow it)
    # the sequences whose new token is the first of a block (a mask for the usual power of two)
    before = d.seq_tokens - 1
    offset = before & (tpb - 1) if not tpb & (tpb - 1) else before % tpb
    starting = (offset == 0).nonzero()[0]
    values: list[tuple[int, int, int]] = []
    if not starting.size:
        return KvEntered(kept, values)
    limit, limit_text = b.limits.kv_limit

    def where(req: int) -> str:  # formatted only for a message
        return f"generation request {req} (seq_slot {b.generation[req].seq_slot})"

    requests = b.seq_request[starting].tolist()
    one_beam = b.sizes.num_generation_sequences == len(b.generation)
    beams = (
        [0] * len(requests)
        if one_beam
        else (starting - b.seq_first[b.seq_request[starting]]).tolist()
    )
    cols = (before[starting] // tpb).tolist()
    for seq, req, beam, col in zip(starting.tolist(), requests, beams, cols):
        ids = b.generation[req].kv_block_ids
        blocks = ids[beam if len(ids) > 1 else 0]
        if col >= width:
            continue  # past the attention window the rows stay as they are (cyclic cache)
        if col >= len(blocks):
            raise BatchError(
                f"{where(req)}: its token {d.seq_tokens[seq]} needs KV block {col}, which "
                f"kv_block_ids does not hold; allocate the block before this step"
            )
        block = blocks[col]
        if not is_int(block) or not 0 <= block < limit:
            raise BatchError(
                f"{where(req)}: KV block {col} is {block!r}, not an id in 0 .. {limit - 1} "
                f"({limit_text})"
            )
        values.append((seq, col, int(block) * per_block))
    return KvEntered(kept, values)


class KvEntered:
    """The KV blocks sequences enter in a decode step, as (sequence, column, index)."""

    __slots__ = ("kept", "new", "flight")

    def __init__(
        self, kept: KeptRows, new: list[tuple[int, int, int]], flight: FlightLists | None = None
    ) -> None:
        # in flight (`flight` set) the rows come from the block tables, as a full step's do
        self.kept, self.new, self.flight = kept, new, flight


def advance_kv(
    out: np.ndarray,
    prev: np.ndarray,
    d: Decode,
    entered: KvEntered,
    *,
    max_blocks_per_seq: int,
    kv_pool_layers: tuple[int, ...],
    kv_pool_windows: tuple[int, ...],
) -> int:
    """The last step's rows with the blocks entered this step (and, in a half that holds the
    rows of two steps back, those entered in the step between), in every pool."""
    width = max_blocks_per_seq
    if entered.flight is not None:  # in flight: every row from the block tables
        return _in_flight(entered.flight, out, width, kv_pool_layers, kv_pool_windows)
    n = len(d.tokens) * 2 * width
    if d.holds_run:
        written = entered.kept.entered + entered.new  # `out` has the rows of two steps back
    else:
        out[:n] = prev[:n]
        written = entered.new
    rows = out[:n].reshape(-1, 2, width)
    for seq, col, index in written:
        rows[seq, 0, col] = index
        rows[seq, 1, col] = index + 1
    entered.kept.entered = entered.new
    return other_pools(out, n, width, kv_pool_layers, kv_pool_windows)
