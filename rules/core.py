"""The core fill rules: the reference's setFromInputs (docs/contract.md, TensorRT-LLM) for token ids,
positions, lengths, request types, logit rows, slots and paged KV rows, with their advance forms
and the checks they rely on.

A fill writes one step's values into the flat buffer `out` (a numpy view of the tensor's
capacity), starting at element 0, and returns how many elements it wrote. It reads the
validated ``Batch``, the value its check returned, and the Config values it declares (by
keyword); nothing else. A check raises BatchError before any buffer is written. An advance
form writes the next decode step of the same requests from the last step's values `prev`, in
O(1) Python work. Where the reference has a bug, the rule says so and does it right.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BatchError
from ..requests.batch import Batch
from ..requests.values import INT32_MAX, check_int
from .decode import Decode

if TYPE_CHECKING:
    import torch

    from ..runtime.device_rows import DeviceRows

GLM_MASK_TOKENS = (50260, 50263, 50264)  # [MASK], [sMASK], [gMASK] in GLM-10B's vocabulary


def token_ids(out: np.ndarray, b: Batch) -> int:
    """Context chunks (plus drafts on a last chunk), then each beam's last token and drafts."""
    o = 0
    if b.context:
        for i, (r, begin, chunk, drafts) in enumerate(
            zip(b.context, b.ctx_begin.tolist(), b.ctx_chunk.tolist(), b.ctx_drafts.tolist())
        ):
            out[o : o + chunk] = b.prompt_array(i)[begin : begin + chunk]
            o += chunk
            if drafts:
                out[o : o + drafts] = r.draft_tokens
                o += drafts
    # generation: per beam, its last token then the request's drafts (drafts imply one beam)
    n = o + b.sizes.num_generation_tokens
    if not b.has_generation_drafts:
        out[o:n] = b.seq_last_token
        return n
    starts = b.gen_starts
    beam_in_request = np.arange(len(b.seq_last_token)) - np.repeat(
        np.cumsum(b.gen_beam_width) - b.gen_beam_width, b.gen_beam_width
    )
    out[np.repeat(starts, b.gen_beam_width) + beam_in_request] = b.seq_last_token
    for j in np.flatnonzero(b.gen_drafts):
        out[starts[j] + 1 : starts[j] + 1 + b.gen_drafts[j]] = b.generation[j].draft_tokens
    return n


def _ctx_default_positions(out: np.ndarray, b: Batch) -> int:
    """begin, begin+1, ... for every context input token (drafts included); returns count."""
    n = b.sizes.num_context_tokens
    if n:
        out[:n] = b.ctx_positions
    return n


def position_ids(out: np.ndarray, b: Batch) -> int:
    """The position of each input token (one per generation beam); explicit position ids where
    a request has them."""
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
                # Reference bug (docs/contract.md): no positions for the drafts of a last chunk,
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


def context_position_ids(out: np.ndarray, b: Batch) -> int:
    """The context tokens' positions only: with lookahead and ReDrafter the drafter writes the
    generation tokens' positions on the device after the step's copy (the reference skips
    generation requests here for these modes)."""
    n = position_ids(out, b)
    o = b.sizes.num_context_tokens
    out[o:n] = 0
    return o


def admit_two_rows(r: Any) -> None:
    """A request arriving in flight for a two-row layout (GLM): no explicit position ids."""
    if getattr(r, "position_ids", None) is not None:
        raise BatchError(
            f"request (seq_slot {r.seq_slot}): explicit position_ids are not supported by the "
            "ChatGLM/GLM two-row position layout"
        )


def admit_chatglm(r: Any) -> None:
    """admit_two_rows, and a prompt of at least 2 tokens (ChatGLM's [gMASK] and <sop>)."""
    admit_two_rows(r)
    if len(r.prompt) < 2:
        raise BatchError(
            f"request (seq_slot {r.seq_slot}): a ChatGLM prompt ends with its [gMASK] and <sop> "
            "tokens, so it has at least 2 tokens"
        )


def _two_row_check(b: Batch) -> None:
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


def chatglm_position_ids(out: np.ndarray, b: Batch) -> int:
    """ChatGLM-6B's two rows: row 1 ends at prompt length - 2, row 2 counts generated tokens."""
    return _two_rows(out, b, b.ctx_input_len - 2, b.gen_prompt_len - 2)


def check_glm(b: Batch) -> None:
    """The two-row layout's limits, and every generation request's mask_position."""
    _two_row_check(b)
    for i, r in enumerate(b.generation):
        w = f"generation request {i} (seq_slot {r.seq_slot})"
        mask = getattr(r, "mask_position", None)
        if mask is None:
            raise BatchError(
                f"{w}: mask_position is unset; GLM sets it on the request during its context step"
            )
        check_int(mask, "mask_position", w, 0, INT32_MAX + 1)


def glm_position_ids(out: np.ndarray, b: Batch) -> int:
    """GLM-10B's two rows with the mask position (found in the context step, kept on the
    request for generation)."""
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


def context_lengths(out: np.ndarray, b: Batch) -> int:
    """Input tokens of each sequence: chunk plus drafts, or prompt plus drafts."""
    n_ctx, n = b.sizes.num_context_requests, b.sizes.num_sequences
    out[:n_ctx] = b.ctx_input_len
    out[n_ctx:n] = b.per_sequence(b.gen_prompt_len + b.gen_drafts)
    return n


def sequence_lengths(out: np.ndarray, b: Batch) -> int:
    """Tokens of each sequence once this step's inputs are appended."""
    n_ctx, n = b.sizes.num_context_requests, b.sizes.num_sequences
    out[:n_ctx] = b.ctx_begin + b.ctx_input_len
    out[n_ctx:n] = b.per_sequence(b.gen_prompt_len + b.gen_drafts + b.gen_max_generated)
    return n


def past_key_value_lengths(out: np.ndarray, b: Batch) -> int:
    """Past KV length of each sequence as the reference sets it (docs/contract.md): a context chunk's
    tokens through this step, a generation sequence's before it (prompt + generated - 1)."""
    n = b.sizes.num_sequences
    gen = b.per_sequence(b.gen_prompt_len + b.gen_max_generated - 1)
    out[b.sizes.num_context_requests : n] = gen
    out[: b.sizes.num_context_requests] = b.ctx_begin + b.ctx_input_len
    return n


def request_types(out: np.ndarray, b: Batch) -> int:
    """0 for each context sequence, 1 for each generation sequence."""
    n_ctx, n = b.sizes.num_context_requests, b.sizes.num_sequences
    out[:n_ctx] = 0
    out[n_ctx:n] = 1
    return n


def last_token_ids(out: np.ndarray, b: Batch) -> int:
    """1-based index in the packed tokens of the last token of each logit row."""
    # logit groups: a context chunk is one group plus one per draft; every generation token
    # (each beam, each draft) is its own group. last_token_ids is their inclusive prefix sum.
    s = b.sizes
    if not s.num_context_requests and s.num_logits == s.num_tokens:
        out[: s.num_logits] = np.arange(1, s.num_logits + 1)  # one token per group
        return s.num_logits
    if not b.has_context_drafts:  # a group per chunk, then one per generation token
        n_ctx = s.num_context_requests
        np.add.accumulate(b.ctx_input_len, out=out[:n_ctx])
        out[n_ctx : s.num_logits] = np.arange(
            s.num_context_tokens + 1, s.num_context_tokens + s.num_generation_tokens + 1
        )
        return s.num_logits
    groups = np.ones(b.sizes.num_logits, dtype=np.int64)
    groups[b.ctx_logit_rows] = b.ctx_chunk
    np.cumsum(groups, out=out[: b.sizes.num_logits])
    return b.sizes.num_logits


def generation_beam_widths(out: np.ndarray, b: Batch) -> int:
    """Beam width of each generation request."""
    n = b.sizes.num_generation_requests
    out[:n] = b.gen_beam_width
    return n


def seq_slots(out: np.ndarray, b: Batch) -> int:
    """Decoder slot of each request, context requests first."""
    n = b.sizes.num_requests
    out[:n] = b.seq_slot
    return n


def row_slots(out: np.ndarray, b: Batch) -> int:
    """The seq slot of each step row (sequence): each context request's, then each generation
    request's once per beam (vLLM's idx_mapping, with beams)."""
    s = b.sizes
    n_ctx, n = s.num_context_requests, s.num_sequences
    out[:n_ctx] = b.seq_slot[:n_ctx]
    out[n_ctx:n] = b.per_sequence(b.seq_slot[n_ctx:])
    return n


def device_token_ids(out: torch.Tensor, d: DeviceRows, pad: int | str) -> None:
    """token_ids in the device build: a context token from the step's context tokens, a
    generation row's its slot's last sampled token."""
    ids = d.context_tokens.where(d.from_context, d.last_token.index_select(0, d.token_slot))
    out.copy_(d.tokens(ids, pad))


def device_row_slots(out: torch.Tensor, d: DeviceRows, pad: int | str) -> None:
    """row_slots in the device build: each row's slot (one beam per request)."""
    out.copy_(d.rows(d.slot[:-1], pad))


def check_fixed_drafts(b: Batch, *, max_draft_tokens: int) -> None:
    """Every generation request carries exactly max_draft_tokens draft tokens: Medusa verifies a
    fixed tree (the engine reads max_decoding_tokens tokens per generation request)."""
    wrong = np.flatnonzero(b.gen_drafts != max_draft_tokens)
    if wrong.size:
        j = int(wrong[0])
        raise BatchError(
            f"generation request {j} (seq_slot {b.generation[j].seq_slot}): Medusa verifies a "
            f"fixed tree, so every generation request carries max_draft_tokens="
            f"{max_draft_tokens} draft tokens; got {int(b.gen_drafts[j])}"
        )


def check_chatglm(b: Batch) -> None:
    """The two-row layout's limits, and prompts of at least 2 tokens."""
    _two_row_check(b)
    short = np.flatnonzero(np.concatenate((b.ctx_prompt_len, b.gen_prompt_len)) < 2)
    if short.size:  # its row-1 position is the prompt length - 2
        i = int(short[0])
        kind, j = ("context", i) if i < len(b.context) else ("generation", i - len(b.context))
        r = (b.context + b.generation)[i]
        raise BatchError(
            f"{kind} request {j} (seq_slot {r.seq_slot}): a ChatGLM prompt ends with its "
            "[gMASK] and <sop> tokens, so it has at least 2 tokens"
        )


# ------------------------------------------------------------------------------ advance forms
def advance_tokens(out: np.ndarray, prev: np.ndarray, d: Decode) -> int:
    """The new token of every sequence."""
    out[: len(d.tokens)] = d.tokens
    return len(d.tokens)


def advance_plus_one(out: np.ndarray, prev: np.ndarray, d: Decode) -> int:
    """One more than the last step, per sequence (positions and lengths)."""
    n = len(d.tokens)
    np.add(prev[:n], 1, out=out[:n])
    return n


def device_plus_one(out: torch.Tensor, d: Decode) -> None:
    """advance_plus_one on the device mirror (it holds the last step's values)."""
    out[: len(d.tokens)] += 1


def device_two_rows(out: torch.Tensor, d: Decode) -> None:
    """advance_two_rows on the device mirror."""
    n = len(d.tokens)
    out[n : 2 * n] += 1


def advance_two_rows(out: np.ndarray, prev: np.ndarray, d: Decode) -> int:
    """Row 1 (the fixed position) stays, row 2 (the block position) grows by one."""
    n = len(d.tokens)
    if not d.holds_run:
        out[:n] = prev[:n]
    np.add(prev[n : 2 * n], 1, out=out[n : 2 * n])
    return 2 * n


def check_next_positions(d: Decode) -> None:
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
