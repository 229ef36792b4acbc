"""One step's batch, validated and laid out once for every fill rule to read.

``Batch.build`` runs every check on the scheduled requests (so that a bad batch raises before
any buffer is touched) and computes the step sizes of the reference's setBufferSizes and the
per-request and per-sequence columns the fill rules vectorise over.

Row layout (reference, buffer-inventory §0): context requests one row each in scheduled order,
then the beams of each generation request in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import BatchError


@dataclasses.dataclass(frozen=True, slots=True)
class StepSizes:
    """The sizes of one step (the reference's setBufferSizes)."""

    num_context_requests: int
    num_context_tokens: int
    num_generation_requests: int
    num_generation_sequences: int
    num_generation_tokens: int
    num_logits: int
    num_sequences: int
    num_tokens: int
    num_requests: int
    max_context_length: int


STEP_SIZES = tuple(f.name for f in dataclasses.fields(StepSizes))


def _i64(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Batch:
    context: tuple[Any, ...]
    generation: tuple[Any, ...]
    sizes: StepSizes
    # context columns (one entry per context request)
    ctx_begin: np.ndarray
    ctx_chunk: np.ndarray
    ctx_prompt_len: np.ndarray
    ctx_drafts: np.ndarray  # draft tokens appended this step (only on a last chunk)
    ctx_input_len: np.ndarray  # chunk + drafts
    # generation columns (one entry per generation request)
    gen_beam_width: np.ndarray
    gen_prompt_len: np.ndarray
    gen_drafts: np.ndarray
    gen_max_generated: np.ndarray
    # per generation sequence (one entry per beam)
    seq_num_tokens: np.ndarray  # prompt + generated tokens of that beam
    seq_last_token: np.ndarray  # the last token of that beam
    seq_slot: np.ndarray  # per request, context first
    explicit_positions: tuple[int, ...]  # request indices (context first) with position_ids

    @staticmethod
    def build(
        context: Sequence[Any],
        generation: Sequence[Any],
        *,
        max_beam_width: int = 1,
        max_draft_tokens: int = 0,
    ) -> Batch:
        """Validate the scheduled requests and lay them out; raise BatchError on the first
        problem. O(1) Python work per request (and per beam), none per token."""
        context, generation = tuple(context), tuple(generation)
        begin, chunk, plen, cdrafts = [], [], [], []
        for i, r in enumerate(context):
            n = len(r.prompt)
            b = r.context_position
            size = r.context_chunk_size
            c = n - b if size is None else size
            drafts = len(r.draft_tokens) if r.draft_tokens else 0
            if (
                not 0 <= b < n
                or c < 1
                or b + c > n
                or r.generated
                and any(r.generated)
                or not 1 <= r.beam_width <= max_beam_width
                or drafts
                and (r.beam_width > 1 or drafts > max_draft_tokens)
                or r.position_ids is not None
                and len(r.position_ids) != n
            ):
                _reject(
                    r, f"context request {i}", max_beam_width, max_draft_tokens, is_context=True
                )
            begin.append(b)
            chunk.append(c)
            plen.append(n)
            cdrafts.append(drafts if b + c == n else 0)  # drafts ride on the last chunk only

        bw, gplen, gdrafts, gmax, seq_tokens, last_tokens = [], [], [], [], [], []
        for i, r in enumerate(generation):
            beam = r.beam_width
            gen = r.generated or ()
            n = len(r.prompt)
            drafts = len(r.draft_tokens) if r.draft_tokens else 0
            lens = list(map(len, gen))
            if (
                not 1 <= beam <= max_beam_width
                or len(lens) != beam
                or not all(lens)
                or n == 0
                or drafts
                and (beam > 1 or drafts > max_draft_tokens)
                or r.position_ids is not None
                and len(r.position_ids) != n
            ):
                _reject(
                    r, f"generation request {i}", max_beam_width, max_draft_tokens, is_context=False
                )
            bw.append(beam)
            gplen.append(n)
            gdrafts.append(drafts)
            gmax.append(max(lens))
            seq_tokens.extend([n + k for k in lens])
            last_tokens.extend([g[-1] for g in gen])

        slots = [r.seq_slot for r in context] + [r.seq_slot for r in generation]
        if (
            not all(type(x) is int or isinstance(x, np.integer) for x in slots)
            or len(set(slots)) != len(slots)
            or (slots and min(slots) < 0)
        ):
            _reject_slots(context, generation)

        ctx_begin, ctx_chunk, ctx_plen = _i64(begin), _i64(chunk), _i64(plen)
        ctx_drafts = _i64(cdrafts)
        ctx_input = ctx_chunk + ctx_drafts
        g_bw, g_drafts = _i64(bw), _i64(gdrafts)
        n_ctx, n_gen = len(context), len(generation)
        n_gen_seq = int(g_bw.sum())
        ctx_tokens = int(ctx_input.sum())
        gen_tokens = int((g_drafts + g_bw).sum())
        sizes = StepSizes(
            num_context_requests=n_ctx,
            num_context_tokens=ctx_tokens,
            num_generation_requests=n_gen,
            num_generation_sequences=n_gen_seq,
            num_generation_tokens=gen_tokens,
            num_logits=n_ctx + int(ctx_drafts.sum()) + gen_tokens,
            num_sequences=n_ctx + n_gen_seq,
            num_tokens=ctx_tokens + gen_tokens,
            num_requests=n_ctx + n_gen,
            max_context_length=int(ctx_plen.max()) if n_ctx else 0,
        )
        return Batch(
            context=context,
            generation=generation,
            sizes=sizes,
            ctx_begin=ctx_begin,
            ctx_chunk=ctx_chunk,
            ctx_prompt_len=ctx_plen,
            ctx_drafts=ctx_drafts,
            ctx_input_len=ctx_input,
            gen_beam_width=g_bw,
            gen_prompt_len=_i64(gplen),
            gen_drafts=g_drafts,
            gen_max_generated=_i64(gmax),
            seq_num_tokens=_i64(seq_tokens),
            seq_last_token=_i64(last_tokens),
            seq_slot=_i64(slots),
            explicit_positions=tuple(
                i for i, r in enumerate(context + generation) if r.position_ids is not None
            ),
        )

    def per_sequence(self, gen_values: np.ndarray) -> np.ndarray:
        """Repeat one value per generation request over its beams."""
        return np.repeat(gen_values, self.gen_beam_width)

    def past_key_value_lengths(self) -> np.ndarray:
        """KV length of each sequence after this step (reference §2.3.7)."""
        gen = self.per_sequence(self.gen_prompt_len + self.gen_max_generated - 1)
        return np.concatenate((self.ctx_begin + self.ctx_input_len, gen))


def _where(kind: str, r: Any) -> str:
    return f"{kind} (seq_slot {getattr(r, 'seq_slot', None)!r})"


def _reject(
    r: Any, kind: str, max_beam_width: int, max_draft_tokens: int, *, is_context: bool
) -> None:
    """Find what is wrong with a request the fast path flagged, and raise it (cold path)."""
    w = _where(kind, r)
    n = len(r.prompt)
    beam = r.beam_width
    drafts = len(r.draft_tokens) if r.draft_tokens else 0
    if n == 0:
        raise BatchError(f"{w}: the prompt is empty")
    if not 1 <= beam <= max_beam_width:
        raise BatchError(f"{w}: beam_width {beam} is outside 1..{max_beam_width} (max_beam_width)")
    if drafts and beam > 1:
        raise BatchError(f"{w}: draft tokens need beam_width 1, got {beam}")
    if drafts > max_draft_tokens:
        raise BatchError(f"{w}: {drafts} draft tokens exceed max_draft_tokens={max_draft_tokens}")
    if r.position_ids is not None and len(r.position_ids) != n:
        raise BatchError(f"{w}: {len(r.position_ids)} position_ids for a prompt of {n} tokens")
    if is_context:
        b = r.context_position
        c = n - b if r.context_chunk_size is None else r.context_chunk_size
        if not 0 <= b < n:
            raise BatchError(f"{w}: context_position {b} is outside the prompt of {n} tokens")
        if c < 1 or b + c > n:
            raise BatchError(
                f"{w}: context_chunk_size {c} at context_position {b} runs past the prompt of {n} tokens"
            )
        raise BatchError(f"{w}: a context request must not have generated tokens")
    gen = r.generated or ()
    if len(gen) != beam:
        raise BatchError(f"{w}: 'generated' has {len(gen)} beams, beam_width is {beam}")
    raise BatchError(f"{w}: a generation request needs at least one generated token per beam")


def _reject_slots(context: Sequence[Any], generation: Sequence[Any]) -> None:
    seen: dict[int, str] = {}
    for kind, reqs in (("context request", context), ("generation request", generation)):
        for i, r in enumerate(reqs):
            w = _where(f"{kind} {i}", r)
            slot = r.seq_slot
            if not (type(slot) is int or isinstance(slot, np.integer)):
                raise BatchError(f"{w}: seq_slot must be an integer, got {slot!r}")
            if slot < 0:
                raise BatchError(f"{w}: seq_slot must not be negative")
            if int(slot) in seen:
                raise BatchError(f"{w}: seq_slot {slot} is also used by {seen[int(slot)]}")
            seen[int(slot)] = w
