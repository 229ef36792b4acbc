"""The FlashAttention/vLLM (``engine: flash``) and FlashInfer (``engine: flashinfer``) input
contracts over a paged KV cache.

A step's sequences are its context requests (one each, its chunk plus the drafts of a last
chunk), then every generation beam (its last sampled token, plus the request's drafts: drafts
imply one beam); their tokens are packed in that order (``core.token_ids``). A sequence's
query tokens sit at KV positions ``seq_len - query_len .. seq_len - 1``, where ``seq_len`` is
its KV length once the step has written them. Block ids are the allocator's own (0-based, no
encoding): token position ``p`` of a sequence lives in slot
``block_table[seq, p // tokens_per_block] * tokens_per_block + p % tokens_per_block``.
"""

from __future__ import annotations

import numpy as np

from ..errors import BatchError
from ..requests.batch import Batch
from ..requests.values import EMPTY, INT32_MAX
from . import kv_offsets
from .core import last_token_ids, position_ids
from .kv_rows import BlockPlan, KeptRows


def query_lens(out: np.ndarray, b: Batch) -> int:
    """Query tokens of each sequence this step."""
    n = b.sizes.num_sequences
    out[:n] = b.seq_query_tokens
    return n


def query_start_loc(out: np.ndarray, b: Batch) -> int:
    """[num_sequences + 1]: 0, then the cumulative query tokens of each sequence (cu_seqlens_q);
    sequence i's tokens are rows out[i] .. out[i + 1] - 1 of the packed batch."""
    n = b.sizes.num_sequences
    out[0] = 0
    np.add.accumulate(b.seq_query_tokens, out=out[1 : n + 1])
    return n + 1


def seq_lens(out: np.ndarray, b: Batch) -> int:
    """KV tokens of each sequence once this step's tokens are written (seqused_k): a context
    chunk's first position plus its tokens, a generation sequence's tokens plus its drafts."""
    n = b.sizes.num_sequences
    out[:n] = b.seq_kv_tokens
    return n


def token_positions(out: np.ndarray, b: Batch) -> int:
    """The position of every token of the packed batch (core.position_ids, whose generation
    part is one position per beam, with each draft token one further than the token before
    it); explicit position ids where a request has them."""
    n = position_ids(out, b)
    if not b.has_generation_drafts:
        return n
    o = b.sizes.num_context_tokens
    first = out[o:n].copy()  # each generation sequence's first position
    counts = b.per_sequence(1 + b.gen_drafts)
    total = int(counts.sum())
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    out[o : o + total] = np.repeat(first, counts) + within
    return o + total


def _token_kv_positions(b: Batch) -> tuple[np.ndarray, np.ndarray]:
    """Each token's sequence and its KV position in that sequence (its index there, whatever
    explicit position ids say)."""
    q = b.seq_query_tokens
    seq = np.repeat(np.arange(len(q)), q)
    starts = np.cumsum(q) - q
    last = b.seq_kv_tokens - q  # each sequence's first query position
    return seq, np.repeat(last - starts, q) + np.arange(len(seq))


def _sequence_blocks(b: Batch, plan: BlockPlan, width: int) -> np.ndarray:
    """[num_sequences, width] block ids of each sequence (0 past its blocks), from the request
    table's block table in flight, else from the lists the KV check converted."""
    if plan.slots is not None:  # in flight: the ids the table checked when it took them
        return np.take(plan.slots.blocks.ids, plan.slots.index, axis=0, mode="clip")
    if plan.changed is not None:  # pragma: no cover - only the TensorRT-LLM rows keep lists
        raise AssertionError("the block table needs every list converted")
    n = b.sizes.num_sequences
    rows = np.zeros((n, width), np.int64)
    lengths = plan.lengths
    seq = np.repeat(np.arange(n), lengths)
    col = np.arange(len(seq)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    rows[seq, col] = plan.blocks
    return rows


def block_table(out: np.ndarray, b: Batch, plan: BlockPlan, *, max_blocks_per_seq: int) -> int:
    """[num_sequences, max_blocks_per_seq]: each sequence's KV block ids in order (the
    allocator's ids, no encoding); 0 past its blocks."""
    n, width = b.sizes.num_sequences, max_blocks_per_seq
    rows = out[: n * width].reshape(n, width)
    if plan.slots is not None:  # in flight: one gather from the block table
        np.take(plan.slots.blocks.ids, plan.slots.index, axis=0, out=rows, mode="clip")
    else:
        rows[:] = _sequence_blocks(b, plan, width)
    return n * width


def kv_slot_mapping(
    out: np.ndarray, b: Batch, plan: BlockPlan, *, max_blocks_per_seq: int, tokens_per_block: int
) -> int:
    """The KV-cache slot of each token: its block's id x tokens_per_block + its offset in the
    block (the block of KV position p is column p // tokens_per_block of the block table)."""
    return _kv_slots(out, b, *_block_rows(b, plan, max_blocks_per_seq), tokens_per_block)


def _block_rows(b: Batch, plan: BlockPlan, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Block rows and the row of each sequence in them: in flight the request table's block
    table itself (each token's block read straight from it), else the lists converted."""
    if plan.slots is not None:
        return plan.slots.blocks.ids, plan.slots.index
    rows = _sequence_blocks(b, plan, width)
    return rows, np.arange(len(rows))


def _block_offset(positions: np.ndarray, tpb: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.divmod(positions, tpb)``: each KV position's block column and its offset in the
    block, as an arithmetic shift and a mask for a power-of-two block size (numpy's int64
    division is about five times slower)."""
    if tpb & (tpb - 1):
        return np.divmod(positions, tpb)
    return positions >> (tpb.bit_length() - 1), positions & (tpb - 1)


def _kv_slots(out: np.ndarray, b: Batch, ids: np.ndarray, index: np.ndarray, tpb: int) -> int:
    """Each token's KV-cache slot from the block rows `ids` (sequence i's at row index[i]).
    A sequence's query tokens are its last KV positions: a context chunk's a run of them
    (``Batch.ctx_positions``), a generation sequence's one (without drafts); with drafts,
    token by token."""
    s = b.sizes
    n_ctx = s.num_context_requests
    kv = b.seq_kv_tokens
    if b.has_generation_drafts:
        seq, pos = _token_kv_positions(b)
        column, offset = _block_offset(pos, tpb)
        block = ids[index[seq], column]
        n = len(seq)
        np.add(np.multiply(block, tpb, dtype=np.int64), offset, out=out[:n], casting="unsafe")
        return n
    flat, width = ids.reshape(-1), ids.shape[1]
    o = s.num_context_tokens
    if n_ctx:  # the context tokens' positions (shared with the position rule), row by row
        block, offset = _block_offset(b.ctx_positions, tpb)
        block += np.repeat(index[:n_ctx] * width, b.ctx_input_len)
        np.multiply(flat.take(block), tpb, out=out[:o], dtype=np.int64)
        out[:o] += offset
    # each generation sequence's one token, at KV position kv - 1: its block from the flat
    # table (row index x width + column)
    block, offset = _block_offset(kv[n_ctx:] - 1, tpb)
    n = o + len(block)
    block += index[n_ctx:] * width
    np.multiply(flat.take(block), tpb, out=out[o:n], dtype=np.int64)
    out[o:n] += offset
    return n


def check_kv_tokens(
    b: Batch, *, max_blocks_per_seq: int, tokens_per_block: int, max_kv_read_tokens: int
) -> None:
    """The KV tokens of the step's sequences after it, all together, fit cu_seqlens_k's int32
    and the read index (when the Config keeps one). Summed only where the step's rows times a
    whole block row could pass either bound."""
    n = b.sizes.num_sequences
    bound = n * max_blocks_per_seq * tokens_per_block  # (a longer sequence is refused anyway)
    if bound <= INT32_MAX and (not max_kv_read_tokens or bound <= max_kv_read_tokens):
        return
    total = int(b.seq_kv_tokens.sum())
    if total > INT32_MAX:
        raise BatchError(
            f"the step's sequences hold {total} KV tokens after it, more than cu_seqlens_k's "
            f"int32 holds ({INT32_MAX}): schedule fewer or shorter sequences"
        )
    if max_kv_read_tokens and total > max_kv_read_tokens:
        raise BatchError(
            f"the step's sequences hold {total} KV tokens after it, more than the read "
            f"index holds (max_kv_read_tokens={max_kv_read_tokens}): schedule fewer or "
            "shorter sequences, or raise max_kv_read_tokens"
        )


def kv_read_index(
    out: np.ndarray, b: Batch, plan: BlockPlan, *, max_blocks_per_seq: int, tokens_per_block: int
) -> int:
    """The KV-cache slot of every KV position of every sequence, sequence after sequence:
    sequence i's positions 0 .. seq_lens[i] - 1 at out[cu_seqlens_k[i] .. cu_seqlens_k[i + 1] -
    1] (what a gather of each sequence's K/V reads, e.g. transformers' read_index). Returns the
    entries written (check_kv_tokens bounds them)."""
    ids, index = _block_rows(b, plan, max_blocks_per_seq)
    lens = b.seq_kv_tokens
    total = int(lens.sum())
    starts = np.add.accumulate(lens) - lens
    seq = np.repeat(np.arange(len(lens)), lens)
    column, offset = _block_offset(np.arange(total) - starts[seq], tokens_per_block)
    block = ids[index[seq], column]
    np.add(
        np.multiply(block, tokens_per_block, dtype=np.int64),
        offset,
        out=out[:total],
        casting="unsafe",
    )
    return total


def _group_tables(plan: BlockPlan) -> tuple:
    """The block table of each attention window (several windows run only in flight)."""
    if plan.slots is None:  # pragma: no cover - the stateless step refuses several windows
        raise AssertionError("KV-cache groups need the requests in flight")
    return plan.slots.per_window()


def group_block_tables(
    out: np.ndarray, b: Batch, plan: BlockPlan, *, max_blocks_per_seq: int
) -> int:
    """[groups, num_sequences, max_blocks_per_seq]: ``block_table`` of each KV-cache group,
    from that attention window's block lists (windows ascending)."""
    tables = _group_tables(plan)
    n, width = b.sizes.num_sequences, max_blocks_per_seq
    rows = out[: len(tables) * n * width].reshape(len(tables), n, width)
    index = plan.slots.index  # type: ignore[union-attr]
    for k, table in enumerate(tables):
        rows[k] = table.ids[index]
    return rows.size


def group_slot_mappings(
    out: np.ndarray, b: Batch, plan: BlockPlan, *, tokens_per_block: int
) -> int:
    """[groups, num_tokens]: ``slot_mapping`` of each KV-cache group, each token's slot in
    that attention window's blocks."""
    tables = _group_tables(plan)
    n = b.sizes.num_tokens
    index = plan.slots.index  # type: ignore[union-attr]
    for k, table in enumerate(tables):
        _kv_slots(out[k * n : (k + 1) * n], b, table.ids, index, tokens_per_block)
    return len(tables) * n


def _pages(b: Batch, tokens_per_block: int) -> np.ndarray:
    """KV pages each sequence's KV after the step fills (its first blocks): the block of its
    last KV position, plus one (0 for none: -1 >> k is -1)."""
    return _block_offset(b.seq_kv_tokens - 1, tokens_per_block)[0] + 1


def paged_kv_indptr(out: np.ndarray, b: Batch, *, tokens_per_block: int) -> int:
    """[num_sequences + 1]: 0, then the cumulative KV pages of each sequence (FlashInfer's
    paged_kv_indptr): sequence i's pages are paged_kv_indices[out[i] .. out[i + 1] - 1]."""
    n = b.sizes.num_sequences
    out[0] = 0
    np.cumsum(_pages(b, tokens_per_block), out=out[1 : n + 1])
    return n + 1


def paged_kv_indices(
    out: np.ndarray, b: Batch, plan: BlockPlan, *, max_blocks_per_seq: int, tokens_per_block: int
) -> int:
    """The page ids of every sequence in turn: the first ceil(KV length / page size) blocks of
    its block list (the ids as allocated). Returns the pages written (the rows past them keep
    the pad)."""
    rows = _sequence_blocks(b, plan, max_blocks_per_seq)
    pages = _pages(b, tokens_per_block)
    used = np.arange(max_blocks_per_seq) < pages[:, None]
    n = int(pages.sum())
    out[:n] = rows[used]  # row by row, each row's first pages
    return n


def paged_kv_last_page_len(out: np.ndarray, b: Batch, *, tokens_per_block: int) -> int:
    """KV tokens in each sequence's last page, 1 .. tokens_per_block (FlashInfer's
    paged_kv_last_page_len): KV length - (pages - 1) x page size."""
    n = b.sizes.num_sequences
    lens = b.seq_kv_tokens
    out[:n] = lens - (_pages(b, tokens_per_block) - 1) * tokens_per_block
    return n


def logits_indices(out: np.ndarray, b: Batch) -> int:
    """0-based row in the packed tokens of each logit row's token: the last token of a context
    chunk (and each draft of a last chunk), every generation token (drafts included)."""
    n = last_token_ids(out, b)
    out[:n] -= 1
    return n


def cu_seqlens_k(out: np.ndarray, b: Batch) -> int:
    """[num_sequences + 1]: 0, then the cumulative KV tokens of each sequence after the step
    (FlashAttention's cu_seqlens_k): sequence i's keys are rows out[i] .. out[i + 1] - 1 of a
    gathered K/V."""
    n = b.sizes.num_sequences
    out[0] = 0
    np.add.accumulate(b.seq_kv_tokens, out=out[1 : n + 1])
    return n + 1


def produces_token(out: np.ndarray, b: Batch) -> int:
    """1 where a logit row's sampled token is kept: every generation token, and a context
    chunk's last token (with its drafts) when the chunk ends the prompt; 0 for a chunk that
    stops mid-prompt, whose sampled token is discarded (vLLM's discard mask, inverted)."""
    s = b.sizes
    n = s.num_logits
    out[:n] = 1
    if s.num_context_requests:
        # only a chunk's own logit row can be a discarded one (drafts ride on a last chunk)
        out[b.ctx_logit_rows] = b.ctx_begin + b.ctx_chunk == b.ctx_prompt_len
    return n


def check_kv_blocks(
    b: Batch,
    kept: KeptRows,
    *,
    max_blocks_per_seq: int,
    tokens_per_block: int,
    num_local_layers: int,
    num_kv_blocks: int = 0,
) -> BlockPlan:
    """Every sequence's kv_block_ids cover its tokens after the step (every attention window's,
    in flight), with ids in the pool (``kv_offsets.check_kv_blocks``); this contract has no cyclic
    window, so a list that fills its row covers no more than max_blocks_per_seq blocks of
    tokens. In flight, one comparison per window: the ids were checked when the block table
    took them."""

    def walk() -> BlockPlan:  # a sequence that outgrows its row, then each list's check
        check_kv_within_blocks(
            b, max_blocks_per_seq=max_blocks_per_seq, tokens_per_block=tokens_per_block
        )
        return kv_offsets.check_kv_blocks(
            b,
            kept,
            max_blocks_per_seq=max_blocks_per_seq,
            tokens_per_block=tokens_per_block,
            num_local_layers=num_local_layers,
            num_kv_blocks=num_kv_blocks,
        )

    flight = b.flight
    if flight is None:  # a stateless step: the requests' own lists
        return walk()
    lens = b.seq_kv_tokens
    for table in flight.per_window():
        if np.count_nonzero(table.count[flight.index] * tokens_per_block < lens):
            walk()  # the cold path names the sequence
            raise AssertionError("a short block list passed the KV check")  # pragma: no cover
    return BlockPlan([], EMPTY, EMPTY, None, kept, slots=flight)


def check_kv_within_blocks(b: Batch, *, max_blocks_per_seq: int, tokens_per_block: int) -> None:
    """Every sequence's KV after the step fits its block table row (this contract has no
    cyclic window: a sequence longer than max_blocks_per_seq blocks has nowhere to go)."""
    most = max_blocks_per_seq * tokens_per_block
    lens = b.seq_kv_tokens
    over = np.flatnonzero(lens > most)
    if over.size:
        i = int(over[0])
        n_ctx = b.sizes.num_context_requests
        if i < n_ctx:
            r, what = b.context[i], f"context request {i}"
        else:
            j = int(b.seq_request[i - n_ctx])
            r, what = b.generation[j], f"generation request {j}"
        raise BatchError(
            f"{what} (seq_slot {r.seq_slot}): its {int(lens[i])} tokens after this step exceed "
            f"max_blocks_per_seq x tokens_per_block = {most} (max_attention_window rounded up "
            "to blocks); finish it, or raise max_attention_window"
        )
