"""The closed set of named fill rules that buffers.yaml may use (``fill: {rule: NAME}``).

Each rule writes one step's values into the flat host buffer `out` (a numpy view of the
tensor's capacity), starting at element 0, and returns how many elements it wrote. Rules
read only the validated ``Batch``; a rule's ``check`` runs before any rule writes, so a bad
batch leaves every buffer as it was. The semantics are the reference's setFromInputs
(buffer-inventory.md §2.3); where the reference has a bug, the rule says so and does it right.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from . import feature_fills as F
from .batch import Batch
from .errors import BatchError
from .kv_rows import (
    BlockPlan,
    KeptRows,
    check_block_lists,
    id_limit,
    required_blocks,
    write_at,
    write_kv_rows,
)
from .values import INT32_MAX, check_int, is_int

GLM_MASK_TOKENS = (50260, 50263, 50264)  # [MASK], [sMASK], [gMASK] in GLM-10B's vocabulary


@dataclasses.dataclass
class Decode:
    """A decode step that follows a generation-only step: every sequence is one token longer.

    `seq_tokens` is each sequence's token count after this step (its KV length), `tokens` its
    new input token; `batch` is the last step prepared in full (requests, beams). `holds_run`
    says the buffer half being written already holds this run of decode steps two steps back
    (so values that stay fixed over the run are there, and of the KV rows only the blocks
    entered since are missing: `kv_since`, as (sequence, column, index))."""

    batch: Batch
    tokens: np.ndarray
    seq_tokens: np.ndarray
    holds_run: bool = False
    kv_since: list = dataclasses.field(default_factory=list)
    kv_new: list = dataclasses.field(default_factory=list)  # (sequence, column, index) to write


@dataclasses.dataclass(frozen=True)
class Rule:
    """`fill(out, batch, config)` writes the step and returns the elements written;
    `check(batch, config)` raises BatchError before anything is written;
    `advance(out, prev, decode, config)` writes a decode step from the previous step's values
    `prev` (same shape) in O(1) Python work, and returns the elements written."""

    name: str
    fill: Callable[[Any, Batch, Any], int]  # out: a numpy view, or a torch device tensor
    check: Callable[[Batch, Any], None] | None = None
    advance: Callable[[Any, Any, Decode, Any], int] | None = None
    advance_check: Callable[[Decode, Any], None] | None = None

    def __repr__(self) -> str:
        return f"fills.{self.name}"


def _token_ids(out: np.ndarray, b: Batch, config: Any = None) -> int:
    o = 0
    for i, (r, begin, chunk, drafts) in enumerate(
        zip(b.context, b.ctx_begin, b.ctx_chunk, b.ctx_drafts)
    ):
        out[o : o + chunk] = b.prompt_array(i)[begin : begin + chunk]
        o += chunk
        if drafts:
            out[o : o + drafts] = r.draft_tokens
            o += drafts
    # generation: per beam, its last token then the request's drafts (drafts imply one beam)
    n = o + b.sizes.num_generation_tokens
    if not b.gen_drafts.any():
        out[o:n] = b.seq_last_token
        return n
    starts = o + np.cumsum(b.gen_beam_width + b.gen_drafts) - (b.gen_beam_width + b.gen_drafts)
    beam_in_request = np.arange(len(b.seq_last_token)) - np.repeat(
        np.cumsum(b.gen_beam_width) - b.gen_beam_width, b.gen_beam_width
    )
    out[np.repeat(starts, b.gen_beam_width) + beam_in_request] = b.seq_last_token
    for j in np.flatnonzero(b.gen_drafts):
        out[starts[j] + 1 : starts[j] + 1 + b.gen_drafts[j]] = b.generation[j].draft_tokens
    return n


def _ctx_default_positions(out: np.ndarray, b: Batch, config: Any = None) -> int:
    """begin, begin+1, ... for every context input token (drafts included); returns count."""
    if not b.sizes.num_context_requests:
        return 0
    n = b.sizes.num_context_tokens
    starts = np.cumsum(b.ctx_input_len) - b.ctx_input_len
    out[:n] = np.arange(n) + np.repeat(b.ctx_begin - starts, b.ctx_input_len)
    return n


def _position_ids(out: np.ndarray, b: Batch, config: Any = None) -> int:
    o = _ctx_default_positions(out, b)
    # generation: one position per beam, its token count - 1 (drafts take their positions
    # from the spec-decoding offsets, as in the reference)
    n = o + b.sizes.num_generation_sequences
    out[o:n] = b.seq_num_tokens - 1
    if b.explicit_positions:  # requests with explicit position ids (rare): patch their rows
        ctx_starts = np.cumsum(b.ctx_input_len) - b.ctx_input_len
        seq_starts = o + np.cumsum(b.gen_beam_width) - b.gen_beam_width
        n_ctx = len(b.context)
        for i in b.explicit_positions:
            if i < n_ctx:
                r, begin, chunk, drafts = (
                    b.context[i],
                    b.ctx_begin[i],
                    b.ctx_chunk[i],
                    b.ctx_drafts[i],
                )
                start = ctx_starts[i]
                out[start : start + chunk] = r.position_ids[begin : begin + chunk]
                # Reference bug (§3.9): it appends no positions for the drafts of a last chunk,
                # leaving the list short. Drafts continue after the last prompt position, as
                # generation continues explicit positions.
                out[start + chunk : start + chunk + drafts] = (
                    np.arange(1, drafts + 1) + r.position_ids[-1]
                )
            else:
                g = i - n_ctx
                r, start = b.generation[g], seq_starts[g]
                out[start : start + b.gen_beam_width[g]] = (
                    r.position_ids[-1] + b.gen_max_generated[g]
                )
    return n


def _context_position_ids(out: np.ndarray, b: Batch, config: Any = None) -> int:
    """The context tokens' positions only: with lookahead and ReDrafter the drafter writes the
    generation tokens' positions on the device after the step's copy (the reference skips
    generation requests here for these modes)."""
    n = _position_ids(out, b)
    o = b.sizes.num_context_tokens
    out[o:n] = 0
    return o


def _two_row_check(b: Batch, config: Any = None) -> None:
    """What the ChatGLM/GLM two-row layout cannot express: explicit position ids, and a
    context in chunks (its rows restart at 0 with every chunk, as in the reference, which
    does not chunk these models)."""
    for kind, reqs in (("context", b.context), ("generation", b.generation)):
        for i, r in enumerate(reqs):
            if getattr(r, "position_ids", None) is not None:
                raise BatchError(
                    f"{kind} request {i} (seq_slot {r.seq_slot}): explicit position_ids are not "
                    "supported by the ChatGLM/GLM two-row position layout"
                )
    chunked = np.flatnonzero((b.ctx_begin > 0) | (b.ctx_chunk < b.ctx_prompt_len))
    if chunked.size:
        i = int(chunked[0])
        raise BatchError(
            f"context request {i} (seq_slot {b.context[i].seq_slot}): ChatGLM/GLM run a "
            "prompt in one context step; a chunk of it cannot be positioned (schedule the whole "
            "prompt)"
        )


def _two_rows(out: np.ndarray, b: Batch, row1_last: np.ndarray, gen_row1: np.ndarray) -> int:
    """Shared ChatGLM/GLM layout: row 1 then row 2, each [num_context_tokens + gen sequences].

    Context rows: row 1 = 0..len-1 with its last entry replaced, row 2 = 0..0, 1. The context
    position is ignored, as in the reference (these variants do not support chunking).
    """
    n_ctx = int(b.ctx_input_len.sum())
    n = n_ctx + b.sizes.num_generation_sequences
    row1, row2 = out[:n], out[n : 2 * n]
    starts = np.cumsum(b.ctx_input_len) - b.ctx_input_len
    row1[:n_ctx] = np.arange(n_ctx) - np.repeat(starts, b.ctx_input_len)
    row2[:n_ctx] = 0
    ends = starts + b.ctx_input_len - 1
    row1[ends] = row1_last
    row2[ends] = 1
    row1[n_ctx:] = b.per_sequence(gen_row1)
    row2[n_ctx:] = b.per_sequence(b.gen_max_generated + 1)
    return 2 * n


def _chatglm_position_ids(out: np.ndarray, b: Batch, config: Any = None) -> int:
    return _two_rows(out, b, b.ctx_input_len - 2, b.gen_prompt_len - 2)


def _glm_check(b: Batch, config: Any = None) -> None:
    _two_row_check(b, config)
    for i, r in enumerate(b.generation):
        w = f"generation request {i} (seq_slot {r.seq_slot})"
        mask = getattr(r, "mask_position", None)
        if mask is None:
            raise BatchError(
                f"{w}: mask_position is unset; GLM sets it on the request during its context step"
            )
        check_int(mask, "mask_position", w, 0, INT32_MAX + 1)


def _glm_position_ids(out: np.ndarray, b: Batch, config: Any = None) -> int:
    masks = np.empty(len(b.context), dtype=np.int64)
    mask_ids = np.array(GLM_MASK_TOKENS)
    for i, (r, begin, chunk, drafts) in enumerate(
        zip(b.context, b.ctx_begin, b.ctx_chunk, b.ctx_drafts)
    ):
        # search this step's input tokens of the request (chunk, then drafts on a last chunk)
        tokens = np.concatenate(
            (
                np.asarray(r.prompt[begin : begin + chunk]),
                np.asarray(r.draft_tokens[:drafts] if drafts else [], dtype=np.int64),
            )
        )
        hits = np.flatnonzero(np.isin(tokens, mask_ids))
        masks[i] = hits[0] if hits.size else b.sizes.max_context_length
        r.mask_position = int(masks[i])
    gen_masks = np.array([r.mask_position for r in b.generation], dtype=np.int64)
    return _two_rows(out, b, masks, gen_masks)


def _context_lengths(out: np.ndarray, b: Batch, config: Any = None) -> int:
    n_ctx, n = b.sizes.num_context_requests, b.sizes.num_sequences
    out[:n_ctx] = b.ctx_input_len
    out[n_ctx:n] = b.per_sequence(b.gen_prompt_len + b.gen_drafts)
    return n


def _sequence_lengths(out: np.ndarray, b: Batch, config: Any = None) -> int:
    n_ctx, n = b.sizes.num_context_requests, b.sizes.num_sequences
    out[:n_ctx] = b.ctx_begin + b.ctx_input_len
    out[n_ctx:n] = b.per_sequence(b.gen_prompt_len + b.gen_drafts + b.gen_max_generated)
    return n


def _past_key_value_lengths(out: np.ndarray, b: Batch, config: Any = None) -> int:
    n = b.sizes.num_sequences
    out[:n] = b.past_key_value_lengths
    return n


def _request_types(out: np.ndarray, b: Batch, config: Any = None) -> int:
    n_ctx, n = b.sizes.num_context_requests, b.sizes.num_sequences
    out[:n_ctx] = 0
    out[n_ctx:n] = 1
    return n


def _last_token_ids(out: np.ndarray, b: Batch, config: Any = None) -> int:
    # logit groups: a context chunk is one group plus one per draft; every generation token
    # (each beam, each draft) is its own group. last_token_ids is their inclusive prefix sum.
    if not b.sizes.num_context_requests and b.sizes.num_logits == b.sizes.num_tokens:
        out[: b.sizes.num_logits] = np.arange(1, b.sizes.num_logits + 1)  # one token per group
        return b.sizes.num_logits
    groups = np.ones(b.sizes.num_logits, dtype=np.int64)
    heads = np.cumsum(1 + b.ctx_drafts) - (1 + b.ctx_drafts)
    groups[heads] = b.ctx_chunk
    np.cumsum(groups, out=out[: b.sizes.num_logits])
    return b.sizes.num_logits


def _generation_beam_widths(out: np.ndarray, b: Batch, config: Any = None) -> int:
    n = b.sizes.num_generation_requests
    out[:n] = b.gen_beam_width
    return n


def _seq_slots(out: np.ndarray, b: Batch, config: Any = None) -> int:
    n = b.sizes.num_requests
    out[:n] = b.seq_slot
    return n


def _kv_check(b: Batch, config: Any) -> None:
    width, tpb = config.max_blocks_per_seq, config.tokens_per_block
    tokens = np.concatenate(
        (b.ctx_begin + b.ctx_input_len, b.seq_num_tokens + b.per_sequence(b.gen_drafts))
    )
    b.scratch["kv"] = check_block_lists(  # the fill writes what the check converted
        b,
        "kv_block_ids",
        need=required_blocks(tokens, tpb, width),
        width=width,
        width_name="max_blocks_per_seq",
        limit=id_limit(config),
        what="KV",
        kept=b.carry.get("kv_rows"),
    )


def _kv_cache_block_offsets(out: np.ndarray, b: Batch, config: Any) -> int:
    """[pools=1, sequences, K/V, max_blocks_per_seq] block indices, one row per sequence.

    Index encoding (TensorRT-LLM's KVCacheIndex for a pool laid out [blocks, layers, K/V, ...]):
    (block_id * num_local_layers + 0) * 2 + (0 for K, 1 for V); the kernel adds the layer.
    Columns past a sequence's own blocks hold 0 (the reference leaves them stale); the check
    made sure every column the sequence's tokens need is given. A context request fills one
    row, even with beam_width > 1: the reference writes one row per beam but advances by one,
    so the next request overwrites them (a bug; fixed by writing one row).

    The generation rows are kept from step to step with a copy of the block lists they were
    built from: a list equal to its copy (compared by value, so a list changed in place is
    seen) keeps its row, so steady decoding converts only the lists that changed.
    """
    width, layers = config.max_blocks_per_seq, config.num_local_layers
    rows = out[: b.sizes.num_sequences * 2 * width].reshape(b.sizes.num_sequences, 2, width)
    plan: BlockPlan = b.scratch["kv"]
    n_ctx = b.sizes.num_context_requests
    k = int(plan.lengths[:n_ctx].sum())
    write_kv_rows(rows[:n_ctx], plan.blocks[:k], plan.lengths[:n_ctx], layers)
    gen = plan.lists[n_ctx:]
    kept: KeptRows | None = b.carry.get("kv_rows")
    if plan.changed is None or kept is None:
        kept = KeptRows(
            [x if type(x) is tuple else list(x) for x in gen], np.empty_like(rows[n_ctx:])
        )
        write_kv_rows(kept.table, plan.blocks[k:], plan.lengths[n_ctx:], layers)
        b.carry["kv_rows"] = kept
    elif plan.changed:
        for i in plan.changed:
            kept.snapshot[i] = gen[i] if type(gen[i]) is tuple else list(gen[i])
        write_at(kept.table, plan.changed, plan.blocks[k:], plan.lengths[n_ctx:], layers)
    rows[n_ctx:] = kept.table
    return rows.size


def _advance_tokens(out: np.ndarray, prev: np.ndarray, d: Decode, config: Any) -> int:
    out[: len(d.tokens)] = d.tokens
    return len(d.tokens)


def _advance_same(n_of: Callable[[Batch], int]) -> Callable[..., int]:
    def advance(out: np.ndarray, prev: np.ndarray, d: Decode, config: Any) -> int:
        n = n_of(d.batch)
        if not d.holds_run:
            out[:n] = prev[:n]
        return n

    return advance


def _advance_plus_one(out: np.ndarray, prev: np.ndarray, d: Decode, config: Any) -> int:
    n = len(d.tokens)
    np.add(prev[:n], 1, out=out[:n])
    return n


def _advance_two_rows(out: np.ndarray, prev: np.ndarray, d: Decode, config: Any) -> int:
    n = len(d.tokens)  # row 1 (the fixed position) stays, row 2 (the block position) grows
    if not d.holds_run:
        out[:n] = prev[:n]
    np.add(prev[n : 2 * n], 1, out=out[n : 2 * n])
    return 2 * n


def _advance_kv_check(d: Decode, config: Any) -> None:
    """Find the sequences whose new token starts a KV block and read that block's id from
    their request (the only requests read in a decode step); raise before anything is written."""
    width, tpb = config.max_blocks_per_seq, config.tokens_per_block
    starting = np.flatnonzero((d.seq_tokens - 1) % tpb == 0)
    values = []
    if starting.size:
        b = d.batch
        requests = b.seq_request[starting].tolist()
        beams = (starting - b.seq_first[b.seq_request[starting]]).tolist()
        cols = ((d.seq_tokens[starting] - 1) // tpb).tolist()
        per_block = config.num_local_layers * 2
        limit, limit_text = id_limit(config)
        for seq, req, beam, col in zip(starting.tolist(), requests, beams, cols):
            r = b.generation[req]
            w = f"generation request {req} (seq_slot {r.seq_slot})"
            ids = r.kv_block_ids
            blocks = ids[beam if len(ids) > 1 else 0]
            if col >= width:
                continue  # past the attention window the rows stay as they are (cyclic cache)
            if col >= len(blocks):
                raise BatchError(
                    f"{w}: its token {d.seq_tokens[seq]} needs KV block {col}, which "
                    f"kv_block_ids does not hold; allocate the block before advance()"
                )
            block = blocks[col]
            if not is_int(block) or not 0 <= block < limit:
                raise BatchError(
                    f"{w}: KV block {col} is {block!r}, not an id in 0 .. {limit - 1} ({limit_text})"
                )
            values.append((seq, col, int(block) * per_block))
    d.kv_new = values


def _advance_kv(out: np.ndarray, prev: np.ndarray, d: Decode, config: Any) -> int:
    width = config.max_blocks_per_seq
    n = len(d.tokens) * 2 * width
    if d.holds_run:
        entered = d.kv_since + d.kv_new  # `out` has the rows of two steps back
    else:
        out[:n] = prev[:n]
        entered = d.kv_new
    rows = out[:n].reshape(-1, 2, width)
    for seq, col, index in entered:
        rows[seq, 0, col] = index
        rows[seq, 1, col] = index + 1
    return n


_sequences = _advance_same(lambda b: b.sizes.num_sequences)
token_ids = Rule("token_ids", _token_ids, advance=_advance_tokens)


def _advance_position_check(d: Decode, config: Any = None) -> None:
    """Explicit positions grow by one each step: refuse the step that would take one past
    int32 (default positions are token counts, far below it)."""
    b = d.batch
    for i in b.explicit_positions:  # generation request indices: advance follows no context
        r = b.generation[i]
        position = r.position_ids[-1] + int(d.seq_tokens[b.seq_first[i]] - b.gen_prompt_len[i])
        if position > INT32_MAX:
            raise BatchError(
                f"generation request {i} (seq_slot {r.seq_slot}): its next position "
                f"{position} runs past the int32 range"
            )


position_ids = Rule(
    "position_ids", _position_ids, advance=_advance_plus_one, advance_check=_advance_position_check
)


def _chatglm_check(b: Batch, config: Any = None) -> None:
    _two_row_check(b, config)
    short = np.flatnonzero(np.concatenate((b.ctx_prompt_len, b.gen_prompt_len)) < 2)
    if short.size:  # its row-1 position is the prompt length - 2
        i = int(short[0])
        kind, j = ("context", i) if i < len(b.context) else ("generation", i - len(b.context))
        r = (b.context + b.generation)[i]
        raise BatchError(
            f"{kind} request {j} (seq_slot {r.seq_slot}): a ChatGLM prompt ends with its "
            "[gMASK] and <sop> tokens, so it has at least 2 tokens"
        )


chatglm_position_ids = Rule(
    "chatglm_position_ids", _chatglm_position_ids, _chatglm_check, _advance_two_rows
)
glm_position_ids = Rule("glm_position_ids", _glm_position_ids, _glm_check, _advance_two_rows)
context_lengths = Rule("context_lengths", _context_lengths, advance=_sequences)
sequence_lengths = Rule("sequence_lengths", _sequence_lengths, advance=_advance_plus_one)
past_key_value_lengths = Rule(
    "past_key_value_lengths", _past_key_value_lengths, advance=_advance_plus_one
)
request_types = Rule("request_types", _request_types, advance=_sequences)
last_token_ids = Rule(
    "last_token_ids", _last_token_ids, advance=_advance_same(lambda b: b.sizes.num_logits)
)
seq_slots = Rule("seq_slots", _seq_slots, advance=_advance_same(lambda b: b.sizes.num_requests))
generation_beam_widths = Rule(
    "generation_beam_widths",
    _generation_beam_widths,
    advance=_advance_same(lambda b: b.sizes.num_generation_requests),
)
kv_cache_block_offsets = Rule(
    "kv_cache_block_offsets", _kv_cache_block_offsets, _kv_check, _advance_kv, _advance_kv_check
)

context_position_ids = Rule("context_position_ids", _context_position_ids)
cache_indirection_copies = Rule(
    "cache_indirection_copies",
    F.cache_indirection_copies,
    advance=_advance_same(lambda b: 3 * b.sizes.num_generation_requests),
)
cache_indirection_decoder_copies = Rule(
    "cache_indirection_decoder_copies",
    F.cache_indirection_decoder_copies,
    advance=_advance_same(lambda b: 3 * b.sizes.num_requests),
)
# the feature groups' rules (runtime/feature_fills.py)
encoder_output_lengths = Rule(
    "encoder_output_lengths", F.encoder_output_lengths, F.CHECKS.get("encoder_output_lengths")
)
encoder_output = Rule("encoder_output", F.encoder_output, F.CHECKS.get("encoder_output"))
cross_kv_cache_block_offsets = Rule(
    "cross_kv_cache_block_offsets",
    F.cross_kv_cache_block_offsets,
    F.CHECKS.get("cross_kv_cache_block_offsets"),
)
cross_attention_mask = Rule(
    "cross_attention_mask", F.cross_attention_mask, F.CHECKS.get("cross_attention_mask")
)
skip_cross_attn_blocks = Rule(
    "skip_cross_attn_blocks", F.skip_cross_attn_blocks, F.CHECKS.get("skip_cross_attn_blocks")
)
encoder_input_ids = Rule(
    "encoder_input_ids", F.encoder_input_ids, F.CHECKS.get("encoder_input_ids")
)
encoder_position_ids = Rule(
    "encoder_position_ids", F.encoder_position_ids, F.CHECKS.get("encoder_position_ids")
)
encoder_input_lengths = Rule(
    "encoder_input_lengths", F.encoder_input_lengths, F.CHECKS.get("encoder_input_lengths")
)
lora_weights_pointers = Rule(
    "lora_weights_pointers", F.lora_weights_pointers, F.CHECKS.get("lora_weights_pointers")
)
lora_ranks = Rule("lora_ranks", F.lora_ranks, F.CHECKS.get("lora_ranks"))
prompt_embedding_table = Rule(
    "prompt_embedding_table", F.prompt_embedding_table, F.CHECKS.get("prompt_embedding_table")
)
prompt_tasks = Rule("prompt_tasks", F.prompt_tasks, F.CHECKS.get("prompt_tasks"))
slot_mapping = Rule(
    "slot_mapping", F.slot_mapping, F.CHECKS.get("slot_mapping"), advance=_sequences
)
mrope_rotary_cos_sin = Rule(
    "mrope_rotary_cos_sin", F.mrope_rotary_cos_sin, F.CHECKS.get("mrope_rotary_cos_sin")
)
mrope_position_deltas = Rule(
    "mrope_position_deltas", F.mrope_position_deltas, F.CHECKS.get("mrope_position_deltas")
)
language_adapter_routings = Rule(
    "language_adapter_routings",
    F.language_adapter_routings,
    F.CHECKS.get("language_adapter_routings"),
)
posterior_thresholds = Rule(
    "posterior_thresholds", F.posterior_thresholds, F.CHECKS.get("posterior_thresholds")
)
posterior_alphas = Rule("posterior_alphas", F.posterior_alphas, F.CHECKS.get("posterior_alphas"))
chunked_context_next_tokens = Rule(
    "chunked_context_next_tokens",
    F.chunked_context_next_tokens,
    F.CHECKS.get("chunked_context_next_tokens"),
)
_FEATURE_RULES = (
    encoder_output_lengths,
    encoder_output,
    cross_kv_cache_block_offsets,
    cross_attention_mask,
    skip_cross_attn_blocks,
    encoder_input_ids,
    encoder_position_ids,
    encoder_input_lengths,
    lora_weights_pointers,
    lora_ranks,
    prompt_embedding_table,
    prompt_tasks,
    slot_mapping,
    mrope_rotary_cos_sin,
    mrope_position_deltas,
    language_adapter_routings,
    posterior_thresholds,
    posterior_alphas,
    chunked_context_next_tokens,
)

RULES = {
    r.name: r
    for r in (
        context_position_ids,
        cache_indirection_copies,
        cache_indirection_decoder_copies,
        *_FEATURE_RULES,
        token_ids,
        position_ids,
        chatglm_position_ids,
        glm_position_ids,
        context_lengths,
        sequence_lengths,
        past_key_value_lengths,
        request_types,
        last_token_ids,
        seq_slots,
        generation_beam_widths,
        kv_cache_block_offsets,
    )
}
