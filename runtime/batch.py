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

STEP_SIZES = (
    "num_context_requests",
    "num_context_tokens",
    "num_generation_requests",
    "num_generation_sequences",
    "num_generation_tokens",
    "num_logits",
    "num_sequences",
    "num_tokens",
    "num_requests",
    "max_context_length",
)


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


def _i32(values: Sequence[int] | np.ndarray) -> np.ndarray:
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
    seq_slot: np.ndarray  # per request, context first

    @staticmethod
    def build(
        context: Sequence[Any],
        generation: Sequence[Any],
        *,
        max_beam_width: int = 1,
        max_draft_tokens: int = 0,
    ) -> Batch:
        context, generation = tuple(context), tuple(generation)
        slots: dict[int, str] = {}

        def where(kind: str, i: int, r: Any) -> str:
            return f"{kind} request {i} (seq_slot {getattr(r, 'seq_slot', None)!r})"

        def check_common(kind: str, i: int, r: Any) -> tuple[int, int]:
            w = where(kind, i, r)
            slot = getattr(r, "seq_slot", None)
            if type(slot) is not int and not isinstance(slot, np.integer):
                raise BatchError(f"{w}: seq_slot must be an integer, got {slot!r}")
            slot = int(slot)
            if slot < 0:
                raise BatchError(f"{w}: seq_slot must not be negative")
            if slot in slots:
                raise BatchError(f"{w}: seq_slot {slot} is also used by {slots[slot]}")
            slots[slot] = w
            beam = int(getattr(r, "beam_width", 1))
            if not 1 <= beam <= max_beam_width:
                raise BatchError(
                    f"{w}: beam_width {beam} is outside 1..{max_beam_width} (max_beam_width)"
                )
            drafts = len(getattr(r, "draft_tokens", None) or ())
            if drafts and beam > 1:
                raise BatchError(f"{w}: draft tokens need beam_width 1, got {beam}")
            if drafts > max_draft_tokens:
                raise BatchError(
                    f"{w}: {drafts} draft tokens exceed max_draft_tokens={max_draft_tokens}"
                )
            if len(r.prompt) == 0:
                raise BatchError(f"{w}: the prompt is empty")
            pos = getattr(r, "position_ids", None)
            if pos is not None and len(pos) != len(r.prompt):
                raise BatchError(
                    f"{w}: {len(pos)} position_ids for a prompt of {len(r.prompt)} tokens"
                )
            return beam, drafts

        begin, chunk, plen, cdrafts = [], [], [], []
        for i, r in enumerate(context):
            _, drafts = check_common("context", i, r)
            w = where("context", i, r)
            n = len(r.prompt)
            b = int(getattr(r, "context_position", 0))
            size = getattr(r, "context_chunk_size", None)
            c = n - b if size is None else int(size)
            if not 0 <= b < n:
                raise BatchError(f"{w}: context_position {b} is outside the prompt of {n} tokens")
            if c < 1 or b + c > n:
                raise BatchError(
                    f"{w}: context_chunk_size {c} at context_position {b} runs past the prompt of {n} tokens"
                )
            if any(len(beam) for beam in (getattr(r, "generated", None) or ())):
                raise BatchError(f"{w}: a context request must not have generated tokens")
            begin.append(b)
            chunk.append(c)
            plen.append(n)
            cdrafts.append(drafts if b + c == n else 0)  # drafts ride on the last chunk only

        bw, gplen, gdrafts, gmax, seq_tokens = [], [], [], [], []
        for i, r in enumerate(generation):
            beam, drafts = check_common("generation", i, r)
            w = where("generation", i, r)
            gen = getattr(r, "generated", None) or ()
            if len(gen) != beam:
                raise BatchError(f"{w}: 'generated' has {len(gen)} beams, beam_width is {beam}")
            lens = [len(g) for g in gen]
            if min(lens) == 0:
                raise BatchError(
                    f"{w}: a generation request needs at least one generated token per beam"
                )
            n = len(r.prompt)
            bw.append(beam)
            gplen.append(n)
            gdrafts.append(drafts)
            gmax.append(max(lens))
            seq_tokens.extend(n + k for k in lens)

        ctx_begin, ctx_chunk, ctx_plen = _i32(begin), _i32(chunk), _i32(plen)
        ctx_drafts = _i32(cdrafts)
        ctx_input = ctx_chunk + ctx_drafts
        g_bw, g_drafts = _i32(bw), _i32(gdrafts)
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
            gen_prompt_len=_i32(gplen),
            gen_drafts=g_drafts,
            gen_max_generated=_i32(gmax),
            seq_num_tokens=_i32(seq_tokens),
            seq_slot=_i32(list(slots)),
        )

    def per_sequence(self, gen_values: np.ndarray) -> np.ndarray:
        """Repeat one value per generation request over its beams."""
        return np.repeat(gen_values, self.gen_beam_width)

    def past_key_value_lengths(self) -> np.ndarray:
        """KV length of each sequence after this step (reference §2.3.7)."""
        gen = self.per_sequence(self.gen_prompt_len + self.gen_max_generated - 1)
        return np.concatenate((self.ctx_begin + self.ctx_input_len, gen))
