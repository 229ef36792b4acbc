"""The checks a generated ``Config`` runs on its parameters, in plain Python (no torch).

``bufc report FAMILY --set name=value`` runs them on the values it is given (it reads the spec
and needs no torch), so that a value the family's Config refuses is refused with the Config's
own message. ``bufc.runtime.config`` (the generated ``__post_init__`` calls its ``check_*``)
implements the same checks and messages; a test keeps the two in step.

Each ``check_*`` reads ``getattr(config, name)``, stores the normalised value back (as the
frozen Config does, through ``object.__setattr__``) and appends what is wrong to `errors`.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Set
from typing import Any

INT_LIMIT = 1 << 62
"""Integer parameters are below this (sizes beyond it are mistakes, and the formulas over them
must stay within int64)."""


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + "..." + text[-12:]


def check_int(config: Any, name: str, *, minimum: int = 0, errors: list[str]) -> None:
    """An integer (numpy integers too, stored as int; not a bool) in [minimum, INT_LIMIT)."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        errors.append(f"{name} must be an int, got {short(value)}")
        return
    value = int(value)
    object.__setattr__(config, name, value)
    if value < minimum:
        errors.append(f"{name} must be at least {minimum}, got {value}")
    elif value >= INT_LIMIT:
        errors.append(f"{name} must be below 2**62, got {value}")


def _sequence(config: Any, name: str, what: str, errors: list[str]) -> tuple | None:
    """The parameter `name` read once as a tuple (not a string), or None with the problem
    added to `errors`. A set or a dict (its keys) is refused: its order is not the caller's,
    and the order is the meaning (a value per layer, a module's index)."""
    value = getattr(config, name)
    if isinstance(value, (Set, Mapping)):
        errors.append(
            f"{name} must be a sequence of {what} (a list or tuple, in order), got a "
            f"{type(value).__name__}: {short(value)}"
        )
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        errors.append(f"{name} must be a sequence of {what}, got {short(value)}")
        return None
    try:
        return tuple(value)
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the caller's value
        errors.append(f"{name} could not be read as a sequence of {what}: {exc}")
        return None


def check_ints(config: Any, name: str, *, minimum: int = 0, errors: list[str]) -> None:
    """A sequence of integers (numpy integers too; not bools), each in [minimum, INT_LIMIT),
    stored as a tuple of ints (an iterator is read once, before it is checked)."""
    value = _sequence(config, name, "ints", errors)
    if value is None:
        return
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in value):
        errors.append(f"{name} must be a sequence of ints, got {short(value)}")
        return
    value = tuple(int(v) for v in value)
    object.__setattr__(config, name, value)
    bad = [v for v in value if not minimum <= v < INT_LIMIT]
    if bad:
        errors.append(
            f"{name}: every value must be at least {minimum} and below 2**62, got {bad[0]}"
        )


def check_bool(config: Any, name: str, errors: list[str]) -> None:
    value = getattr(config, name)
    if type(value) is not bool:
        errors.append(f"{name} must be True or False, got {short(value)}")


def check_names(config: Any, name: str, allowed: tuple[str, ...], errors: list[str]) -> None:
    """A sequence of distinct names from `allowed`, stored as a tuple (an iterator is read
    once, before it is checked)."""
    value = _sequence(config, name, "names", errors)
    if value is None:
        return
    object.__setattr__(config, name, value)
    if not all(isinstance(v, str) for v in value):
        errors.append(f"{name} must be a sequence of names, got {short(value)}")
        return
    unknown = [v for v in value if v not in allowed]
    if unknown:
        errors.append(f"{name}: {', '.join(map(repr, unknown))} not in {', '.join(allowed)}")
    elif len(set(value)) != len(value):
        errors.append(f"{name} names a module twice: {value!r}")


def failure(where: str, errors: list[str]) -> str:
    """The text of the one ConfigError that lists every problem of a Config (`where`: the
    Config's qualified name)."""
    if len(errors) == 1:
        return f"{where}: {errors[0]}"
    return f"{where}: {len(errors)} errors:\n" + "\n".join(f"  {e}" for e in errors)
