"""Fill rules of the optional feature groups: beam-search copies, prompt tuning, recurrent
state, M-RoPE, language adapters and Eagle (encoder-decoder models: ``encoder_decoder``; LoRA:
``adapters`` (docs/contract.md
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
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BatchError
from ..requests.batch import Batch
from ..requests.values import INT32_MAX, check_int, show
from .batch_rows import all_requests, field, per_sequence, plain_tensor, tokens_per_request, where

if TYPE_CHECKING:
    import torch

DEFAULT_POSTERIOR_THRESHOLD = 0.09  # Eagle's default (EagleConfig)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


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
    if not plain_tensor(t):
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
    if t is not None and not plain_tensor(t):
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
