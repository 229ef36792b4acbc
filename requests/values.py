"""Checks of request values before any of them is written.

Buffers are int32 (token ids, positions, lengths, block indices) or int64 (addresses), and
numpy converts silently where it should refuse: ``np.asarray([2.7], np.int64)`` truncates,
``np.asarray(["5"], np.int64)`` parses the string, ``-1`` becomes 255 in a uint8 buffer and
2**32 + 1 wraps to 1 in an int32 one. So every request value a step writes goes through these
helpers first: integers only (Python ints, numpy integer scalars and arrays), ranges checked
against the buffer they land in, and a message that names the value.
"""

from __future__ import annotations

import functools
import numbers
import operator
import reprlib
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any

import numpy as np

from ..errors import BatchError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

_short = reprlib.Repr()
_short.maxstring = 40
_short.maxother = 40
_short.maxlist = 6


def show(value: Any) -> str:
    """A short repr for messages (a request may hold a 100k-token prompt)."""
    return _short.repr(value)


def is_int(value: Any) -> bool:
    """True for Python and numpy integers, not for bools, floats or strings."""
    if type(value) is int:  # the common case, without the ABC check (about 1 us)
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


BOOLS = frozenset((bool, np.bool_))


def int_array(values: Any) -> np.ndarray | None:
    """`values` (a flat sequence or array of integers) as an int64 array; None unless every
    value is an integer that fits int64. An empty sequence is an empty array. A bool is not
    an integer here, even among ints (numpy would read ``[True, 5]`` as ``[1, 5]``)."""
    try:
        a = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        return None
    if a.ndim != 1:
        return None
    kind = a.dtype.kind
    if kind == "i":
        # a bool reads as 0 or 1: only the values read as 0 or 1 are looked at (a llama
        # prompt starts with token 1, BOS: walking all of its types would double the cost)
        if a is not values and a.size and int(np.minimum.reduce(a)) <= 1 and _has_bool(values, a):
            return None
        return a.astype(np.int64, copy=False)
    if kind == "u":
        return a.astype(np.int64) if not a.size or int(a.max()) <= INT64_MAX else None
    if not a.size:
        return np.zeros(0, np.int64)
    return None


def _has_bool(values: Any, a: np.ndarray) -> bool:
    """A bool among `values` (read by numpy as the int array `a`): among the elements that
    read as 0 or 1, or, where those are many or `values` cannot be indexed, among all."""
    small = np.flatnonzero(a <= 1)
    if 4 * len(small) <= len(a):
        try:
            return any(type(values[i]) in BOOLS for i in small.tolist())
        except (TypeError, KeyError, IndexError):  # not indexable as a sequence
            pass
    return not BOOLS.isdisjoint(frozenset(map(type, values)))


_LISTS = frozenset((list, tuple, range))
# iterable, but not a list of ids: no order of their own (sets, a dict's keys) or characters
# and bytes where ids belong
_UNORDERED = (str, bytes, bytearray, memoryview, Set, Mapping)


def is_ordered(value: Any, ndim: int = 1) -> bool:
    """`value` is an ordered sequence, as a list of ids (`ndim` 1) or of lists (2) is handed
    over: a list, tuple or range, another Sequence but a string or bytes, or an array of `ndim`
    dimensions (numpy, torch: anything with ``__array__`` and ``ndim``); not a set, a dict
    (its keys), a string, bytes or an iterator."""
    if type(value) in _LISTS:  # the common case
        return True
    if isinstance(value, _UNORDERED):
        return False
    if hasattr(value, "__array__"):
        return getattr(value, "ndim", None) == ndim
    return isinstance(value, Sequence)


def is_unordered(value: Any) -> bool:
    """`value` is a container of values, but not an ordered one (a set, a dict, bytes)."""
    return isinstance(value, (bytes, bytearray, memoryview, Set, Mapping))


def not_a_list(where: str, what: str, value: Any, ndim: int = 1) -> BatchError:
    """The error for `value` handed over as `what`, a list of ids (`ndim` 1) or of lists (2),
    that is no ordered sequence (``is_ordered``): its type named, and what to pass instead."""
    dims = getattr(value, "ndim", None) if hasattr(value, "__array__") else None
    kind = type(value).__name__ if dims is None else f"{dims}-D {type(value).__name__}"
    of, array = ("block ids", "1-D array") if ndim == 1 else ("block lists", "2-D array")
    article = "an" if kind[0] in "aeiou" else "a"
    return BatchError(
        f"{where}: {what} must be a list of {of} (a list, tuple, range or {array}), got "
        f"{article} {kind}: {show(value)}; pass a list"
    )


def unread_getter(unread: tuple[tuple[str, Any], ...]) -> tuple[Callable[[Any], Any], tuple]:
    """What ``unread_set`` compares at once: a getter of the `unread` fields as one tuple, and
    their defaults."""
    names = tuple(name for name, _ in unread)
    get = operator.attrgetter(*names)
    if len(names) == 1:
        return (lambda r: (get(r),)), (unread[0][1],)
    return get, tuple(default for _, default in unread)


def unread_set(
    r: Any,
    unread: tuple[tuple[str, Any], ...],
    getter: tuple[Callable[[Any], Any], tuple] | None = None,
) -> tuple[str, Any] | None:
    """The first field (name, default) of `unread` (those the family never reads) that request
    `r` sets, or None when it leaves them all at their defaults. `getter` (``unread_getter``):
    a request that holds every default itself (the usual one) is seen in one comparison."""
    if getter is not None:
        get, defaults = getter
        try:
            values = get(r)
        except AttributeError:  # a field missing: field by field
            values = ()
        if len(values) == len(defaults) and all(map(operator.is_, values, defaults)):
            return None
    for name, default in unread:
        value = getattr(r, name, default)
        if value is None or value is default:
            continue
        if isinstance(default, bool) and type(value) in BOOLS and bool(value) == default:
            continue
        return name, default
    return None


def unread_error(where: str, field: tuple[str, Any], family: str) -> BatchError:
    """The error for a request that sets `field` (name, default), which `family` never reads."""
    name, default = field
    return BatchError(
        f"{where}: {name} is set, but the {family} family does not read it (leave it {default!r})"
    )


def in_range(a: np.ndarray, low: int, high: int) -> bool:
    """low <= every value of the int64 array `a` < high (vacuously true for an empty array)."""
    if not a.size:
        return True
    if low == 0:  # one reduction: negative values are >= 2**63 read as unsigned
        return int(np.maximum.reduce(a.view(np.uint64))) < high  # (no ndarray.max wrapper)
    return int(np.minimum.reduce(a)) >= low and int(np.maximum.reduce(a)) < high


def check_draft_count(n: int, beam_width: int, max_draft_tokens: int, where: str) -> None:
    """The draft tokens a request carries (on arrival, in a stateless step, or handed to
    ``step(drafts=)``): only with one beam, and at most max_draft_tokens."""
    if n and beam_width > 1:
        raise BatchError(f"{where}: draft tokens need beam_width 1, got {beam_width}")
    if n > max_draft_tokens:
        raise BatchError(f"{where}: {n} draft tokens exceed max_draft_tokens={max_draft_tokens}")


def same_requests(last: Sequence[Any], now: Sequence[Any]) -> bool:
    """`now` is the last step's requests again, in the same order: the same objects, or
    objects equal to them (a request class that compares by value), by tuple comparison
    (identity first, in C). A request class whose ``==`` cannot answer (a dataclass holding
    numpy arrays: their truth value is ambiguous) is compared by identity."""
    try:
        return bool(tuple(last) == tuple(now))
    except Exception:
        return len(last) == len(now) and all(map(operator.is_, last, now))


def check_int(value: Any, what: str, where: str, low: int, high: int, limit: str = "") -> int:
    """`value` as an int, or a BatchError naming `what` unless it is an integer in [low, high);
    `limit` says where `high` comes from (e.g. 'vocab_size=1000')."""
    if not is_int(value):
        raise BatchError(f"{where}: {what} must be an integer, got {show(value)}")
    if not low <= value < high:
        bound = f" ({limit})" if limit else ""
        raise BatchError(f"{where}: {what} {value} is outside {low}..{high - 1}{bound}")
    return int(value)


def check_ints(values: Any, what: str, where: str, low: int, high: int, limit: str = "") -> None:
    """Raise a BatchError naming the first value of `values` that is not an integer in
    [low, high); `limit` says where `high` comes from (e.g. 'vocab_size=1000')."""
    if isinstance(values, (str, bytes, set, frozenset, dict)) or not hasattr(values, "__len__"):
        raise BatchError(f"{where}: {what} must be a list of integers, got {show(values)}")
    try:
        items = list(values)
    except TypeError:
        raise BatchError(
            f"{where}: {what} must be a list of integers, got {show(values)}"
        ) from None
    for i, v in enumerate(items):
        if not is_int(v):
            raise BatchError(f"{where}: {what}[{i}] must be an integer, got {show(v)}")
        if not low <= v < high:
            bound = f" ({limit})" if limit else ""
            raise BatchError(f"{where}: {what}[{i}] = {v} is outside {low}..{high - 1}{bound}")


def checked_ints(
    values: Iterable[Any], what: str, where: str, low: int, high: int, limit: str = ""
) -> np.ndarray:
    """`values` as an int64 array, checked as ``check_ints`` does (fast when they are good)."""
    a = int_array(values)
    if a is None or not in_range(a, low, high):
        check_ints(values, what, where, low, high, limit)  # names the culprit
        raise BatchError(f"{where}: {what} must be a list of integers, got {show(values)}")
    return a


# torch gathers (index_select) no unsigned dtype wider than uint8
_UNGATHERABLE = ("uint16", "uint32", "uint64")


def check_token_dtype(dtype: Any, limit: int, limit_text: str, where: str, device: bool) -> None:
    """A BatchError unless tokens of `dtype` (a numpy or torch integer dtype) can hold every
    token id 0 .. limit - 1 and, on the device (`device`), torch can gather them: a narrower
    dtype would wrap the ids a sampler writes, or the vocabulary limit they are compared with."""
    message = _token_dtype_error(str(dtype).removeprefix("torch."), limit, limit_text, device)
    if message is not None:
        raise BatchError(f"{where}{message}")


@functools.lru_cache(maxsize=64)
def _token_dtype_error(name: str, limit: int, limit_text: str, device: bool) -> str | None:
    if device and name in _UNGATHERABLE:
        return (
            f": torch cannot gather {name} tensors on the device; pass int32 or int64 tokens "
            "(tokens.to(torch.int32))"
        )
    try:
        info = np.iinfo(name)
    except ValueError:
        return f" needs integer tokens, got {name}"
    if info.max < limit - 1:
        return (
            f": {name} tokens cannot hold every token id 0 .. {limit - 1} ({limit_text}); "
            "pass int32 or int64 tokens"
        )
    return None


EMPTY = np.zeros(0, dtype=np.int64)  # a shared empty int64 column (read-only)
EMPTY.flags.writeable = False


def beam_index(slots: np.ndarray, widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(slot, beam) of each beam of each slot, for a [slots, beams] table."""
    seq = np.repeat(slots, widths)
    return seq, np.arange(len(seq)) - np.repeat(np.cumsum(widths) - widths, widths)
