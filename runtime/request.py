"""The request record the runtime reads (field names follow the reference's LlmRequest)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


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
    mask_position: int | None = None
    """GLM: set by the runtime during the context step, read in generation."""
    kv_block_ids: Sequence[Sequence[int]] | None = None
    """Paged KV cache: the request's block ids, one list per beam (or one shared list)."""
