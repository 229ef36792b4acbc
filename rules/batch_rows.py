"""Reading a step's requests, for the feature rules (``features``, ``adapters``): where a request
row is (for messages), every request in row order, per-request values spread over sequences,
input tokens per request, and a field every request must carry."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BatchError
from ..requests.batch import Batch


def where(b: Batch, i: int) -> str:
    """'context request i (seq_slot s)' or 'generation request j (...)' for request row i."""
    n_ctx = len(b.context)
    kind, j, r = (
        ("context", i, b.context[i])
        if i < n_ctx
        else ("generation", i - n_ctx, b.generation[i - n_ctx])
    )
    return f"{kind} request {j} (seq_slot {getattr(r, 'seq_slot', None)})"


def all_requests(b: Batch) -> tuple[Any, ...]:
    return b.context + b.generation


def per_sequence(b: Batch, per_request: Sequence[Any] | np.ndarray) -> np.ndarray:
    """One value per request (context first) -> one per sequence (every generation beam)."""
    values = np.asarray(per_request)
    n_ctx = len(b.context)
    return np.concatenate((values[:n_ctx], b.per_sequence(values[n_ctx:])))


def tokens_per_request(b: Batch) -> np.ndarray:
    """Input tokens of each request this step: chunk plus drafts on a last chunk, and per
    generation request its beams plus drafts (so the counts add up to num_tokens)."""
    return np.concatenate((b.ctx_input_len, b.gen_beam_width + b.gen_drafts))


def field(b: Batch, name: str, what: str) -> list[Any]:
    """Every request's `name`, raising a BatchError that names the first request without it."""
    values = [getattr(r, name, None) for r in all_requests(b)]
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        i = missing[0]
        raise BatchError(f"{where(b, i)}: {what} needs the request's {name}")
    return values


def plain_tensor(t: Any) -> bool:
    """A dense tensor with data (a sparse or meta tensor would fail the device copy). The rules
    import no torch: where torch was never imported, nothing is a tensor."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(t, torch.Tensor):
        return False
    return t.layout == torch.strided and t.device.type != "meta"
