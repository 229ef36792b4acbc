"""Fill rules of encoder-decoder models: the decoder's encoder outputs, cross-attention KV
rows and masks, and the encoder engine's own inputs (docs/contract.md has the contract and where
bufc departs from the reference). Same contract as ``core``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BatchError
from ..requests.batch import Batch, encoder_input_length, encoder_output_length
from ..requests.values import INT32_MAX, checked_ints
from .batch_rows import all_requests, per_sequence, plain_tensor, tokens_per_request, where
from .kv_rows import BlockPlan, check_block_lists, id_limit, write_kv_rows

if TYPE_CHECKING:
    import torch


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
    if not plain_tensor(t) or not t.is_floating_point():
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
