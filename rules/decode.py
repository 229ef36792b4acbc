"""The decode step advance() writes: every sequence of the last step one token longer."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..errors import BatchError
from ..requests.batch import Batch, Limits
from ..requests.sampled import Sampled
from ..requests.values import check_token_dtype, in_range, int_array


@dataclasses.dataclass(slots=True)
class Decode:
    """A decode step that follows a generation-only step without draft tokens.

    `seq_tokens` is each sequence's token count after this step (its KV length), `tokens` its
    new input token; `batch` is the last step prepared in full (requests, beams). `holds_run`
    says the buffer half being written already holds this run of decode steps two steps back,
    so values that stay fixed over the run are there."""

    batch: Batch
    tokens: np.ndarray
    seq_tokens: np.ndarray
    holds_run: bool = False


def start(b: Batch) -> Decode | None:
    """The state advance() continues from after step `b`: only a generation-only step without
    draft tokens can be followed by one."""
    s = b.sizes
    if not s.num_sequences or s.num_context_requests or b.has_generation_drafts:
        return None
    return Decode(b, b.seq_last_token, b.seq_num_tokens)


def next_step(d: Decode, tokens: Any, limits: Limits, holds_run: bool) -> Decode:
    """The decode step after `d` with the sampled `tokens`, one per sequence: integers in the
    vocabulary (BatchError otherwise)."""
    count = len(d.tokens)
    if type(tokens) is Sampled:
        assert len(tokens.values) == count  # the in-flight state lays out both
        return Decode(d.batch, tokens.values, d.seq_tokens + 1, holds_run)
    L = limits  # (a torch tensor of tokens reaches here as numpy: runtime.tokens.tokens_on_host)
    if isinstance(tokens, np.ndarray) and tokens.dtype.kind in "iu":
        check_token_dtype(tokens.dtype, L.token_limit, L.token_limit_text, "advance()", False)
    a = int_array(np.ravel(tokens) if isinstance(tokens, np.ndarray) else tokens)
    if a is None:
        raise BatchError("advance() needs integer tokens, one per sequence")
    if a.size != count:
        raise BatchError(f"advance() needs {count} tokens, one per sequence, got {a.size}")
    if not in_range(a, 0, limits.token_limit):
        i = int(np.flatnonzero((a < 0) | (a >= limits.token_limit))[0])
        raise BatchError(
            f"advance(): token {a[i]} of sequence {i} is outside 0 .. "
            f"{limits.token_limit - 1} ({limits.token_limit_text})"
        )
    return Decode(d.batch, a, d.seq_tokens + 1, holds_run)
