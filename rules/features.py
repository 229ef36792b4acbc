"""Fill rules of the optional feature groups: beam-search copies, encoder-decoder, LoRA, prompt
tuning, recurrent state, M-RoPE, language adapters and Eagle (docs/contract.md
has the contract and where bufc departs from the reference).

Same contract as ``core``: a rule writes one step into `out` (a flat numpy view of the
staging storage; a flat torch tensor for the rules that copy request tensors on the device),
returns the elements written, and reads only the batch, its check's value and the Config values
it declares; a check raises BatchError before anything is written.
Rows follow the reference's layout: context requests one row each, then every beam of each
generation request. Where the reference has a bug, the rule says so and does it right.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BatchError
from ..requests.batch import Batch, encoder_input_length, encoder_output_length
from ..requests.values import INT32_MAX, check_int, checked_ints, show
from .batch_rows import all_requests, field, per_sequence, tokens_per_request, where
from .kv_rows import BlockPlan, check_block_lists, id_limit, write_kv_rows

if TYPE_CHECKING:
    import torch

DEFAULT_POSTERIOR_THRESHOLD = 0.09  # Eagle's default (EagleConfig)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _plain_tensor(t: Any) -> bool:
    """A dense tensor with data (a sparse or meta tensor would fail the device copy). The rules
    import no torch: where torch was never imported, nothing is a tensor."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(t, torch.Tensor):
        return False
    return t.layout == torch.strided and t.device.type != "meta"


# -------------------------------------------------------------- beam search: cache indirection
def cache_indirection_copies(
    out: np.ndarray, b: Batch, *, max_beam_width: int, max_attention_window: int
) -> int:
    """[src, dst, size] of each generation request's copy from the decoder's cache indirection
    ([slots, max_beam_width, window]) into the engine's input, bound as TensorRT-LLM's runtime
    binds it, [max_batch_size, step beam width, window] (the attention plugin reads the beam
    width from that dimension): generation request i's beams land in row i, at the step's
    stride, so the engine reads beam k of request i at [i, k, :].

    The source is strided by max_beam_width, the decoder buffer's own stride; the reference
    strides it by the first request's beam width (a bug: a later request of another width is
    read from the wrong slot; fixed)."""
    n = len(b.generation)
    out[:n] = b.seq_slot[len(b.context) :] * (max_beam_width * max_attention_window)
    out[n : 2 * n] = np.arange(n) * (b.sizes.beam_width * max_attention_window)
    out[2 * n : 3 * n] = b.gen_beam_width * max_attention_window
    return 3 * n


def cache_indirection_decoder_copies(
    out: np.ndarray, b: Batch, *, max_beam_width: int, max_attention_window: int
) -> int:
    """[src, dst, size] of each request's copy of the decoder's cache indirection from its
    output to its input, after the step: src = dst = slot * max_beam_width * window."""
    n = len(b.context) + len(b.generation)
    aw = max_attention_window
    widths = np.asarray([r.beam_width for r in b.context] + list(b.gen_beam_width), np.int64)
    out[:n] = b.seq_slot * (max_beam_width * aw)
    out[n : 2 * n] = out[:n]
    out[2 * n : 3 * n] = widths * aw
    return 3 * n


# -------------------------------------------------------------- encoder-decoder, decoder side
def encoder_output_lengths(out: np.ndarray, b: Batch) -> int:
    """Each sequence's request's encoder output length (every beam of a generation request)."""
    values = per_sequence(b, [encoder_output_length(r) for r in all_requests(b)])
    out[: len(values)] = values
    return len(values)


def check_encoder_outputs(b: Batch, *, encoder_hidden_size: int, model_dtype: torch.dtype) -> None:
    """Every context request has its encoder_output, [encoder_output_length, hidden] in the
    model dtype (the dtype of the step's encoder_output tensor: the fill copies it as it is,
    and another floating dtype would be cast without a word)."""
    for i, r in enumerate(b.context):
        _encoder_output(where(b, i), r, encoder_hidden_size, model_dtype)


def admit_encoder_output(r: Any, *, encoder_hidden_size: int, model_dtype: torch.dtype) -> None:
    """A request arriving in flight (in its context phase) carries its encoder_output."""
    _encoder_output(f"request (seq_slot {r.seq_slot})", r, encoder_hidden_size, model_dtype)


def _encoder_output(w: str, r: Any, encoder_hidden_size: int, model_dtype: torch.dtype) -> None:
    t = getattr(r, "encoder_output", None)
    if t is None:
        raise BatchError(f"{w}: a context request needs its encoder_output")
    if not _plain_tensor(t) or not t.is_floating_point():
        raise BatchError(
            f"{w}: encoder_output must be a dense floating-point torch.Tensor, "
            f"got {type(t).__name__}"
        )
    want = (encoder_output_length(r), encoder_hidden_size)
    if tuple(t.shape) != want:
        raise BatchError(f"{w}: encoder_output has shape {list(t.shape)}, expected {list(want)}")
    if t.dtype != model_dtype:
        raise BatchError(
            f"{w}: encoder_output is {t.dtype}, expected the model dtype "
            f"{model_dtype} (model_dtype); cast it with .to({model_dtype})"
        )


def encoder_output(out: torch.Tensor, b: Batch, *, encoder_hidden_size: int) -> int:
    """The encoder outputs of the context requests, concatenated (device copies)."""
    h = encoder_hidden_size
    o = 0
    for r in b.context:
        rows = r.encoder_output.shape[0]
        out[o * h : (o + rows) * h].view(rows, h).copy_(r.encoder_output, non_blocking=True)
        o += rows
    return o * h


def check_cross_kv_blocks(
    b: Batch,
    *,
    max_cross_blocks_per_seq: int,
    tokens_per_block: int,
    num_local_layers: int,
    num_kv_blocks: int = 0,
) -> BlockPlan:
    """Every sequence's cross_kv_block_ids cover its request's encoder output; returns the
    converted lists for the fill."""
    width = max_cross_blocks_per_seq
    tokens = per_sequence(b, [encoder_output_length(r) for r in all_requests(b)])
    return check_block_lists(
        b,
        "cross_kv_block_ids",
        tokens=tokens.astype(np.int64),
        tokens_per_block=tokens_per_block,
        width=width,
        width_name="max_cross_blocks_per_seq",
        limit=id_limit(num_local_layers, num_kv_blocks),
        what="cross KV",
    )


def cross_kv_cache_block_offsets(
    out: np.ndarray,
    b: Batch,
    plan: BlockPlan,
    *,
    max_cross_blocks_per_seq: int,
    num_local_layers: int,
) -> int:
    """[pools=1, sequences, K/V, max_cross_blocks_per_seq] cross-attention block indices, with
    the encoding of kv_cache_block_offsets; columns past a sequence's blocks hold 0."""
    width = max_cross_blocks_per_seq
    n = b.sizes.num_sequences
    rows = out[: n * 2 * width].reshape(n, 2, width)
    write_kv_rows(rows, plan.blocks, plan.lengths, num_local_layers)
    return rows.size


def _token_positions(b: Batch) -> np.ndarray:
    """The position of every input token of the step, in token order (context chunk and
    drafts, then per generation beam its last token and the request's drafts)."""
    counts = np.concatenate((b.ctx_input_len, b.per_sequence(1 + b.gen_drafts)))
    first = np.concatenate((b.ctx_begin, b.seq_num_tokens - 1))
    starts = np.cumsum(counts) - counts
    return np.repeat(first - starts, counts) + np.arange(int(counts.sum()))


def check_cross_attention_masks(b: Batch) -> None:
    """Each request's cross_attention_mask, if any: booleans, [rows >= 1, <= longest input]."""
    width = b.sizes.max_encoder_input_length
    for i, r in enumerate(all_requests(b)):
        m = getattr(r, "cross_attention_mask", None)
        if m is not None and np.asarray(m).dtype.kind not in "biu":
            raise BatchError(
                f"{where(b, i)}: cross_attention_mask must hold booleans, got {np.asarray(m).dtype}"
            )
        if m is not None and (np.ndim(m) != 2 or np.shape(m)[1] > width or np.shape(m)[0] < 1):
            raise BatchError(
                f"{where(b, i)}: cross_attention_mask must be [rows >= 1, encoder input length "
                f"<= {width}], got shape {list(np.shape(m))}"
            )


def cross_attention_mask(out: np.ndarray, b: Batch) -> int:
    """[tokens, longest encoder input] mask. Every row starts all true; a context request
    without a mask gets the padding mask (its encoder input positions only); a request with a
    mask gives each of its tokens the mask row of the token's position (clamped to the last
    row) over the mask's columns. The reference gives a generation request one row, not one
    per beam and draft token, so later rows are stale; here every token gets its row."""
    width = b.sizes.max_encoder_input_length
    n = b.sizes.num_tokens
    rows = out[: n * width].reshape(n, width)
    rows[:] = True
    positions = _token_positions(b)
    counts = tokens_per_request(b)
    starts = np.cumsum(counts) - counts
    for i, r in enumerate(all_requests(b)):
        lo, hi = int(starts[i]), int(starts[i] + counts[i])
        if lo == hi:
            continue
        m = getattr(r, "cross_attention_mask", None)
        if m is None:
            if i < len(b.context):
                rows[lo:hi, encoder_input_length(r) :] = False
            continue
        m = np.asarray(m, dtype=bool)
        rows[lo:hi, : m.shape[1]] = m[np.minimum(positions[lo:hi], m.shape[0] - 1)]
    return rows.size


def skip_cross_attn_blocks(out: np.ndarray, b: Batch) -> int:
    """True when every scheduled request skips the cross-attention blocks (a request without
    the field does not; an empty step skips nothing)."""
    requests = all_requests(b)
    out[0] = bool(requests) and all(getattr(r, "skip_cross_attn_blocks", False) for r in requests)
    return 1


# ------------------------------------------------------------------ encoder engine inputs
def check_encoder_inputs(b: Batch) -> None:
    """The encoder engine runs context requests only, each with its encoder_input_ids."""
    if b.generation:
        raise BatchError(
            "the encoder engine runs context requests only; got "
            f"{len(b.generation)} generation requests"
        )
    for i, r in enumerate(b.context):
        ids = getattr(r, "encoder_input_ids", None)
        if ids is None or len(ids) == 0:
            raise BatchError(f"{where(b, i)}: the encoder needs the request's encoder_input_ids")
        checked_ints(ids, "encoder_input_ids", where(b, i), 0, INT32_MAX + 1)
        if encoder_input_length(r) != len(ids):
            raise BatchError(
                f"{where(b, i)}: encoder_input_length {encoder_input_length(r)} differs from "
                f"its {len(ids)} encoder_input_ids"
            )


def encoder_input_ids(out: np.ndarray, b: Batch) -> int:
    o = 0
    for r in b.context:
        ids = r.encoder_input_ids
        out[o : o + len(ids)] = ids
        o += len(ids)
    return o


def encoder_position_ids(out: np.ndarray, b: Batch) -> int:
    lengths = np.asarray([encoder_input_length(r) for r in b.context], np.int64)
    n = int(lengths.sum())
    out[:n] = np.arange(n) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return n


def encoder_input_lengths(out: np.ndarray, b: Batch) -> int:
    values = [encoder_input_length(r) for r in all_requests(b)]
    out[: len(values)] = values
    return len(values)


# ---------------------------------------------------------------------------- prompt tuning
def check_prompt_tables(
    b: Batch,
    *,
    hidden_size: int,
    max_prompt_vocab_size: int,
    model_dtype: torch.dtype,
    vocab_size: int,
) -> None:
    """Each prompt_table is a dense [rows <= max_prompt_vocab_size, hidden_size] tensor of the
    model dtype, and every token id past the vocabulary names a row of its own request's
    table."""
    for i, r in enumerate(all_requests(b)):
        _prompt_table(where(b, i), r, hidden_size, max_prompt_vocab_size, model_dtype)
    # a token id v >= vocab_size reads row v - vocab_size of its own request's table: the row
    # must exist (a request without a table would read another request's rows)
    for i, largest in enumerate(_largest_input_tokens(b)):
        _prompt_row(where(b, i), all_requests(b)[i], largest, vocab_size)


def admit_prompt_table(
    r: Any,
    *,
    hidden_size: int,
    max_prompt_vocab_size: int,
    model_dtype: torch.dtype,
    vocab_size: int,
) -> None:
    """A request arriving in flight: its prompt_table as check_prompt_tables wants it, and
    every prompt id past the vocabulary a row of that table."""
    w = f"request (seq_slot {r.seq_slot})"
    _prompt_table(w, r, hidden_size, max_prompt_vocab_size, model_dtype)
    if len(r.prompt):
        _prompt_row(w, r, int(r.prompt.max()), vocab_size)


def _prompt_table(
    w: str, r: Any, hidden_size: int, max_prompt_vocab_size: int, model_dtype: torch.dtype
) -> None:
    t = getattr(r, "prompt_table", None)
    if t is None:
        return
    if not _plain_tensor(t):
        raise BatchError(f"{w}: prompt_table must be a dense torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2 or t.shape[1] != hidden_size:
        raise BatchError(
            f"{w}: prompt_table must be [vocab, hidden_size={hidden_size}], got {list(t.shape)}"
        )
    if t.shape[0] > max_prompt_vocab_size:
        raise BatchError(
            f"{w}: its prompt table has {t.shape[0]} rows, more than "
            f"max_prompt_vocab_size={max_prompt_vocab_size}"
        )
    if t.dtype != model_dtype:
        raise BatchError(f"{w}: prompt_table is {t.dtype}, the model dtype is {model_dtype}")


def _prompt_row(w: str, r: Any, largest: int, vocab: int) -> None:
    """Token `largest`, if past the vocabulary, names a row of the request's own table."""
    if largest < vocab:
        return
    t = getattr(r, "prompt_table", None)
    rows = 0 if t is None else t.shape[0]
    if largest - vocab >= rows:
        have = "the request has no prompt_table" if t is None else f"its table has {rows} rows"
        raise BatchError(
            f"{w}: token {largest} reads prompt-table row {largest - vocab}, but {have}"
        )


def _largest_input_tokens(b: Batch) -> list[int]:
    """The largest token id each request feeds this step (its chunk and drafts, or its beams'
    last tokens and drafts)."""
    out = []
    for i, (r, begin, chunk) in enumerate(zip(b.context, b.ctx_begin, b.ctx_chunk)):
        drafts = list(r.draft_tokens) if b.ctx_drafts[i] else []
        out.append(max([int(b.prompt_array(i)[begin : begin + chunk].max()), *drafts]))
    last = b.seq_last_token
    for j, r in enumerate(b.generation):
        first, width = int(b.seq_first[j]), int(b.gen_beam_width[j])
        drafts = [] if r.draft_tokens is None else list(r.draft_tokens)
        out.append(max([int(last[first : first + width].max()), *drafts]))
    return out


def prompt_embedding_table(
    out: torch.Tensor, b: Batch, *, hidden_size: int, max_prompt_vocab_size: int
) -> int:
    """Request b's table at rows [b * max_prompt_vocab_size, ...) (b counts requests, context
    first); the rows of requests without a table are left as they are (no task reads them)."""
    h, v = hidden_size, max_prompt_vocab_size
    for i, r in enumerate(all_requests(b)):
        t = getattr(r, "prompt_table", None)
        if t is not None:
            start = i * v * h
            out[start : start + t.shape[0] * h].view(t.shape[0], h).copy_(t, non_blocking=True)
    return out.numel()


def prompt_tasks(out: np.ndarray, b: Batch) -> int:
    """The task of every input token: request b's index if it has a prompt table, else 0. The
    reference gives generation draft tokens no entry (the tensor is then shorter than the
    tokens); every token gets its request's task here."""
    tasks = np.asarray(
        [
            i if getattr(r, "prompt_table", None) is not None else 0
            for i, r in enumerate(all_requests(b))
        ],
        dtype=np.int64,
    )
    values = np.repeat(tasks, tokens_per_request(b))
    out[: len(values)] = values
    return len(values)


# --------------------------------------------------------------------------- recurrent state
def check_recurrent(b: Batch) -> None:
    """The batches a recurrent model takes (TensorRT-LLM's batch manager and Mamba plugins):
    a prompt in one context step (a state is started from zero with the whole prompt), and
    context and generation in separate steps (the plugin picks one kernel for the step from
    the first request's type). Beam search is refused by the Config (max_beam_width 1)."""
    chunked = np.flatnonzero((b.ctx_begin > 0) | (b.ctx_chunk < b.ctx_prompt_len))
    if chunked.size:
        i = int(chunked[0])
        raise BatchError(
            f"{where(b, i)}: a recurrent model runs a prompt in one context step; schedule the "
            "whole prompt (chunked context is not supported)"
        )
    if b.context and b.generation:
        raise BatchError(
            f"a recurrent model runs context and generation requests in separate steps; got "
            f"{len(b.context)} context and {len(b.generation)} generation requests"
        )


def slot_mapping(out: np.ndarray, b: Batch) -> int:
    """Each sequence's state slot: its request's seq_slot (every family bounds it by
    max_batch_size, the state pools' rows)."""
    values = per_sequence(b, b.seq_slot)
    out[: len(values)] = values
    return len(values)


# ------------------------------------------------------------------------------------ M-RoPE
def check_mrope(b: Batch, *, max_position_embeddings: int, rotary_embedding_dim: int) -> None:
    """Each context request's cos/sin table, each generation request's position delta."""
    width = max_position_embeddings * rotary_embedding_dim
    for i, r in enumerate(b.context):
        _mrope_table(where(b, i), r, width)
    for j, r in enumerate(b.generation):
        _mrope_delta(where(b, len(b.context) + j), r, "a generation request")


def admit_mrope(r: Any, *, max_position_embeddings: int, rotary_embedding_dim: int) -> None:
    """A request arriving in flight: its cos/sin table for the context phase, and the position
    delta its generation steps read (both known when it arrives: get_rope_index gives them)."""
    w = f"request (seq_slot {r.seq_slot})"
    _mrope_table(w, r, max_position_embeddings * rotary_embedding_dim)
    _mrope_delta(w, r, "a request in flight")


def _mrope_table(w: str, r: Any, width: int) -> None:
    t = getattr(r, "mrope_rotary_cos_sin", None)
    if t is not None and not _plain_tensor(t):
        raise BatchError(
            f"{w}: mrope_rotary_cos_sin must be a dense torch.Tensor, got {type(t).__name__}"
        )
    if t is None or t.numel() != width:
        got = "none" if t is None else f"{t.numel()} values"
        raise BatchError(
            f"{w}: mrope_rotary_cos_sin needs max_position_embeddings * "
            f"rotary_embedding_dim = {width} values, got {got}"
        )


def _mrope_delta(w: str, r: Any, who: str) -> None:
    delta = getattr(r, "mrope_position_deltas", None)
    if delta is None:
        raise BatchError(f"{w}: {who} needs mrope_position_deltas")
    check_int(delta, "mrope_position_deltas", w, -INT32_MAX, INT32_MAX)


def mrope_rotary_cos_sin(
    out: torch.Tensor, b: Batch, *, max_position_embeddings: int, rotary_embedding_dim: int
) -> int:
    """Row i <- context request i's cos/sin table (device copies). Generation rows are not
    written: the engine reads them only in context steps."""
    width = max_position_embeddings * rotary_embedding_dim
    for i, r in enumerate(b.context):
        out[i * width : (i + 1) * width].copy_(
            r.mrope_rotary_cos_sin.reshape(-1), non_blocking=True
        )
    return b.sizes.num_sequences * width


def mrope_position_deltas(out: np.ndarray, b: Batch) -> int:
    """Each generation sequence's delta from row 0 (generation sequence j, counting generation
    sequences only, in row j), then one 0 row per context request, as the reference writes
    them. TensorRT-LLM's attention plugin reads generation request j's delta at row j of the
    step's generation requests: unlike sequence_length or the KV block offsets, it does not
    offset this pointer by the context sequences (gptAttentionPlugin.cpp, enqueueSome; the
    kernel's `mrope_position_deltas[batch_idx]`). An earlier version of this rule wrote the
    generation rows after the context rows, calling the reference's layout a bug; a real
    Qwen2-VL engine indexed as the plugin indexes then rotates every generation request of a
    mixed step at a wrong position (tests/test_qwen2_vl_model.py, logits off by ~14 against
    Hugging Face). Rows stay one per beam, as in the reference, although the plugin's index is
    the request's (batch_beam_idx / beam_width): the two differ with beams (not checked on a
    real model)."""
    n_gen, s = b.sizes.num_generation_sequences, b.sizes.num_sequences
    out[:n_gen] = b.per_sequence(
        np.asarray([r.mrope_position_deltas for r in b.generation], np.int64)
    )
    out[n_gen:s] = 0
    return s


# -------------------------------------------------------------------------- language adapter
def admit_language_adapter(r: Any, *, num_languages: int) -> None:
    """A request arriving in flight: its language_adapter_uid is below num_languages."""
    uid = getattr(r, "language_adapter_uid", None)
    w = f"request (seq_slot {r.seq_slot})"
    if uid is None:
        raise BatchError(f"{w}: the language adapter needs the request's language_adapter_uid")
    check_int(uid, "language_adapter_uid", w, 0, num_languages, "num_languages")


def check_language_adapters(b: Batch, *, num_languages: int) -> None:
    """Every request's language_adapter_uid is below num_languages."""
    for i, uid in enumerate(field(b, "language_adapter_uid", "the language adapter")):
        check_int(uid, "language_adapter_uid", where(b, i), 0, num_languages, "num_languages")


def language_adapter_routings(out: np.ndarray, b: Batch) -> int:
    """The request's adapter for every input token. The reference writes none for draft
    tokens, so the tensor is short of the tokens; every token gets its request's adapter."""
    uids = np.asarray([r.language_adapter_uid for r in all_requests(b)], np.int64)
    values = np.repeat(uids, tokens_per_request(b))
    out[: len(values)] = values
    return len(values)


# --------------------------------------------------------------------------------------- Eagle
def _thresholds(b: Batch) -> np.ndarray:
    values = [getattr(r, "eagle_posterior_threshold", None) for r in all_requests(b)]
    return per_sequence(
        b, np.asarray([DEFAULT_POSTERIOR_THRESHOLD if v is None else v for v in values], np.float64)
    )


def check_posterior_thresholds(b: Batch) -> None:
    """Each eagle_posterior_threshold, if any, is a number >= 0, finite in float32."""
    for i, r in enumerate(all_requests(b)):
        _posterior_threshold(where(b, i), r)


def admit_posterior_threshold(r: Any) -> None:
    """A request arriving in flight: its eagle_posterior_threshold, if any."""
    _posterior_threshold(f"request (seq_slot {r.seq_slot})", r)


def _posterior_threshold(w: str, r: Any) -> None:
    v = getattr(r, "eagle_posterior_threshold", None)
    if v is None:
        return
    try:
        f = float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else math.nan
    except OverflowError:
        f = math.inf
    if not 0 <= f <= _FLOAT32_MAX:  # NaN fails too; the buffers are float32
        raise BatchError(
            f"{w}: eagle_posterior_threshold {show(v)} must be a number >= 0 "
            "(and finite in float32)"
        )


def posterior_thresholds(out: np.ndarray, b: Batch) -> int:
    values = _thresholds(b)
    out[: len(values)] = values
    return len(values)


def posterior_alphas(out: np.ndarray, b: Batch) -> int:
    values = np.sqrt(_thresholds(b))
    out[: len(values)] = values
    return len(values)


def chunked_context_next_tokens(out: np.ndarray, b: Batch) -> int:
    """For a context request on a chunk that is not its last, the prompt token right after the
    chunk; -1 on a last chunk and for every generation sequence."""
    s = b.sizes.num_sequences
    out[:s] = -1
    for i, (r, begin, chunk, plen) in enumerate(
        zip(b.context, b.ctx_begin, b.ctx_chunk, b.ctx_prompt_len)
    ):
        if begin + chunk < plen:
            out[i] = r.prompt[begin + chunk]
    return s
