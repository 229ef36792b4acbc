"""The step sizes the batch builder computes: the one list of their names.

Plain Python (no numpy, no torch), so that the generator reads the same names the runtime
computes.
"""

from __future__ import annotations

import dataclasses


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
    # computed only for families that read them (encoder-decoder models)
    num_encoder_tokens: int = 0
    num_encoder_input_tokens: int = 0
    max_encoder_input_length: int = 0
    # the widest beam of the step's generation requests (1 without any): the beam dimension
    # TensorRT-LLM's runtime binds cache_indirection at
    beam_width: int = 1
    # the most tokens one generation request feeds (1 plus its drafts; max_draft_tokens + 1
    # without generation requests): the length TensorRT-LLM's Eagle and ReDrafter runtimes
    # bind spec_decoding_position_offsets at, which the attention plugin reads as the
    # generation input length
    max_generation_length: int = 1

    def generation_bucket(self, rows: int) -> StepSizes:
        """The sizes of a generation-only step (one token per sequence) padded to `rows`
        sequences: the shapes a CUDA graph for that batch bucket is captured with."""
        if self.num_context_requests or self.num_tokens != self.num_sequences:
            raise ValueError(
                "a generation bucket needs a generation-only step without draft tokens; "
                "pad other steps with padded(tokens, rows)"
            )
        return self.padded(rows, rows)

    def padded(self, tokens: int, rows: int) -> StepSizes:
        """The sizes of any step padded to `tokens` tokens and `rows` sequences (a token and
        batch bucket, for a CUDA graph of mixed steps): padded sequences and tokens count as
        generation ones, each padded sequence with one logit row (the pads hold what the
        contract says such rows hold)."""
        extra = rows - self.num_sequences
        if extra < 0 or tokens < self.num_tokens:
            raise ValueError(
                f"padded({tokens}, {rows}): a step of {self.num_tokens} tokens and "
                f"{self.num_sequences} sequences pads to at least as many of each"
            )
        return dataclasses.replace(
            self,
            num_generation_requests=self.num_generation_requests + extra,
            num_generation_sequences=self.num_generation_sequences + extra,
            num_generation_tokens=self.num_generation_tokens + tokens - self.num_tokens,
            num_logits=self.num_logits + extra,
            num_sequences=rows,
            num_tokens=tokens,
            num_requests=self.num_requests + extra,
        )


STEP_SIZES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StepSizes))
"""Every step size, in declaration order."""

ENCODER_SIZES: frozenset[str] = frozenset(
    {"num_encoder_tokens", "num_encoder_input_tokens", "max_encoder_input_length"}
)
"""Computed only for families whose shapes or rules read them: they read request fields
(encoder lengths) that other families' requests do not have."""
