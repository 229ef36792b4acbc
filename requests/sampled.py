"""Sampled tokens as the caller hands them to ``step``: indexed by seq slot (``tokens[slot]``,
or ``tokens[slot, beam]``), read and checked here before the plan uses them (``Sampled``, the
checked values; ``OnDevice``, what the host knows of tokens that stay on the device).
"""

from __future__ import annotations

import dataclasses
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BatchError
from .batch import Limits
from .rows import _beam_values
from .values import BOOLS, INT32_MAX, check_token_dtype, in_range

if TYPE_CHECKING:
    from .table import RequestTable


@dataclasses.dataclass(frozen=True)
class OnDevice:
    """Sampled tokens that stay on the buffers' device: what the host knows of them (the
    runtime checked the tensor's shape and dtype)."""

    columns: int  # per seq slot: tokens[slot] (1) or tokens[slot, beam]


class Sampled:
    """Sampled tokens that the caller already checked, one per sequence as an int64 array
    (the requests in flight check them with the step): ``next_step`` takes them as they are."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray) -> None:
        self.values = values


def check_tokens(values: np.ndarray, L: Limits) -> None:
    """Every value a token in the vocabulary (a BatchError naming the first that is not)."""
    if not in_range(values, 0, L.token_limit):
        bad = np.flatnonzero((values < 0) | (values >= L.token_limit))[0]
        raise BatchError(
            f"step(): token {values[bad]} of a request in flight is outside 0 .. "
            f"{L.token_limit - 1} ({L.token_limit_text})"
        )


def row_tokens(tokens: Any, rows: np.ndarray, L: Limits) -> np.ndarray:
    """The sampled token of each slot in `rows` (one beam each), not yet checked."""
    if (
        type(tokens) is np.ndarray
        and tokens.ndim == 1
        and tokens.dtype == np.int64
        and len(tokens) >= L.max_batch_size
    ):  # the common case: one column, indexed by slot
        return tokens[rows]
    return token_table(tokens, L)[:, 0][rows]


def is_empty(tokens: Any) -> bool:
    """`tokens` holds nothing (`len` 0); False for what has no length."""
    try:
        return len(tokens) == 0
    except TypeError:
        return False


def token_table(tokens: Any, L: Limits) -> np.ndarray:
    """The sampled tokens as an int64 [slots, k] table (k columns per slot, one per beam)."""
    slots = L.max_batch_size
    if tokens is None:
        raise BatchError(
            "step(): the last step produced tokens; pass them (tokens[seq_slot], or "
            "tokens[seq_slot, beam])"
        )
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64 and len(tokens) >= slots:
        if tokens.ndim == 2:  # the common cases: already a table, or one column of it
            return tokens
        if tokens.ndim == 1:
            return tokens.reshape(len(tokens), 1)
    try:
        a = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError):
        raise BatchError("step() needs integer tokens indexed by seq slot") from None
    if a.dtype.kind not in "iu" or a.ndim not in (1, 2) or len(a) < slots:
        raise BatchError(
            f"step() needs integer tokens indexed by seq slot: an array of {slots} rows "
            f"(max_batch_size), or [{slots}, beams]; got {a.dtype} of shape {list(a.shape)}"
        )
    if isinstance(tokens, np.ndarray):  # a list's ints are read as int64
        check_token_dtype(a.dtype, L.token_limit, L.token_limit_text, "step()", False)
    elif _has_bool(tokens, a.ndim):
        raise BatchError("step() needs integer tokens indexed by seq slot; got a bool among them")
    if a.dtype.kind == "u" and a.size and int(a.max()) > INT32_MAX:
        raise BatchError("step(): a token is outside the int32 range")
    a = a.astype(np.int64, copy=False)
    return a.reshape(len(a), 1) if a.ndim == 1 else a


def _has_bool(values: Any, ndim: int) -> bool:
    """A bool among a list's (or a list of lists') values, which numpy reads as 0 or 1."""
    rows = values if ndim == 1 else chain.from_iterable(values)
    return not BOOLS.isdisjoint(frozenset(map(type, rows)))


def produced_tokens(
    t: RequestTable, tokens: Any, producers: np.ndarray, on_device: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The slots' generated counts and last tokens once the producers' tokens are in
    (copies; the state's own arrays when no slot produced). Tokens that stay on the
    device are counted only: their values land later (``tokens_back``)."""
    L = t.limits
    generated, last = t.generated, t.last
    if not producers.size:
        if tokens is not None and (on_device or not is_empty(tokens)):
            raise BatchError(
                "step(): no request in flight produced a token in the last step; pass tokens=None"
            )
        return generated, last
    if on_device:
        k = tokens.columns
        widest = int(t.beam_width[producers].max()) if t.n_wide else 1
        if widest > k:
            raise BatchError(
                f"step(): tokens has {k} column(s) per slot, but a request in flight has "
                f"{widest} beams"
            )
        generated = generated.copy()
        generated[producers] += 1
        return generated, last
    if not t.n_wide:  # one beam each: the slots' first column
        values = row_tokens(tokens, producers, L)
    else:  # beams: tokens[slot, beam]
        tok = token_table(tokens, L)
        widths = t.beam_width[producers]
        if int(widths.max()) > tok.shape[1]:
            raise BatchError(
                f"step(): tokens has {tok.shape[1]} column(s) per slot, but a request in "
                f"flight has {int(widths.max())} beams"
            )
        values = _beam_values(tok, producers, widths)
    check_tokens(values, L)
    generated = generated.copy()
    generated[producers] += 1
    last = last.copy()
    if not t.n_wide:
        last[:, 0][producers] = values  # a one-axis scatter
    else:
        k = min(tok.shape[1], L.max_beam_width)
        last[producers, :k] = tok[producers, :k]
    return generated, last
