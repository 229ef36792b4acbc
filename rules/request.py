"""The request record the runtime reads (field names follow the reference's LlmRequest)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def read_by(default: T, *readers: str) -> T:
    """A field only some families read, with its `default`: `readers` are the functions of
    ``bufc.rules`` (or ``encoder_sizes``: the request layer of an encoder or encoder-decoder
    family) that read it. A family whose step program calls none of them does not read the
    field, and refuses a request that sets it (``unread_fields``)."""
    return dataclasses.field(default=default, metadata={"read_by": readers})


@dataclasses.dataclass(eq=False)
class Request:
    """One scheduled request. Any object with these attributes works just as well.

    A request is a context or a generation request by the list it is passed in.
    """

    seq_slot: int
    """Decoder slot of the request, unique among the scheduled requests."""
    prompt: Sequence[int]
    """Prompt token ids."""
    beam_width: int = 1
    """Beams of the request (a context request still counts as one sequence)."""
    context_position: int = 0
    """Prompt tokens already computed in earlier context chunks."""
    context_chunk_size: int | None = None
    """Prompt tokens computed this step; None means the rest of the prompt."""
    generated: Sequence[Sequence[int]] = ()
    """Tokens generated so far, one list per beam."""
    draft_tokens: Sequence[int] = ()
    """Speculative draft tokens to verify this step."""
    position_ids: Sequence[int] | None = None
    """Explicit position ids of the prompt (one per prompt token)."""
    mask_position: int | None = read_by(None, "check_glm", "glm_position_ids")
    """GLM: set by the runtime during the context step, read in generation."""
    kv_block_ids: Sequence[Sequence[int]] | None = None
    """Paged KV cache: the request's block ids, one list per beam (or one shared list); a
    family without a paged KV cache ignores them (not ``read_by``: harnesses hand every family
    block ids)."""
    # ---- encoder-decoder models
    encoder_input_ids: Sequence[int] | None = read_by(None, "encoder_sizes")
    """Encoder engine: the request's encoder input tokens."""
    encoder_input_length: int | None = read_by(None, "encoder_sizes")
    """Encoder input tokens (default: len(encoder_input_ids))."""
    encoder_output_length: int | None = read_by(None, "encoder_sizes")
    """Encoder output rows (default: the encoder input length)."""
    encoder_output: Any = read_by(None, "check_encoder_outputs", "admit_encoder_output")
    """Decoder of an encoder-decoder model, context phase: the encoder's output rows
    ([encoder_output_length, encoder_hidden_size] tensor, of the Config's model_dtype: another
    dtype is refused, not cast; ``.to(model_dtype)`` it first)."""
    cross_kv_block_ids: Sequence[Sequence[int]] | None = read_by(
        None, "check_cross_kv_blocks", "admit_cross_kv_blocks"
    )
    """Cross-attention KV cache block ids, one list per beam (or one shared list)."""
    cross_attention_mask: Any = read_by(None, "check_cross_attention_masks")
    """Optional [rows, encoder input length] bool array: row p is the mask of position p."""
    skip_cross_attn_blocks: bool = read_by(False, "skip_cross_attn_blocks")
    """Skip the cross-attention blocks (every scheduled request must, for the step to skip)."""
    # ---- adapters and multimodal inputs
    lora_weights: Sequence[tuple[str, int, int, int, int | None, int]] | None = read_by(
        None, "check_lora", "admit_lora"
    )
    """LoRA adapter rows: (module, global layer, A address, B address, DoRA scale address or
    None, rank)."""
    prompt_table: Any = read_by(None, "check_prompt_tables", "admit_prompt_table")
    """Prompt tuning: the request's [vocab, hidden] prompt embedding table."""
    mrope_rotary_cos_sin: Any = read_by(None, "check_mrope", "admit_mrope")
    """M-RoPE: the request's flattened cos/sin table (context phase)."""
    mrope_position_deltas: int | None = read_by(None, "check_mrope", "admit_mrope")
    """M-RoPE: the request's position delta (generation phase)."""
    language_adapter_uid: int | None = read_by(
        None, "check_language_adapters", "admit_language_adapter"
    )
    """The language adapter of the request."""
    eagle_posterior_threshold: float | None = read_by(
        None, "check_posterior_thresholds", "admit_posterior_threshold"
    )
    """Eagle: the request's posterior threshold (default 0.09)."""


def read_fields(called: Collection[str] | None = None) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each Request field that only some families read (``read_by``) and
    that one of the functions named in `called` reads (every such field, `called` None)."""
    return tuple(
        (f.name, f.default)
        for f in dataclasses.fields(Request)
        if f.metadata.get("read_by")
        and (called is None or any(r in called for r in f.metadata["read_by"]))
    )


def unread_fields(called: Collection[str]) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each Request field that only some families read (``read_by``) and
    that none of the functions named in `called` reads."""
    return tuple(
        (f.name, f.default)
        for f in dataclasses.fields(Request)
        if f.metadata.get("read_by") and not any(r in called for r in f.metadata["read_by"])
    )
