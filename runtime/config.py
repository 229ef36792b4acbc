"""Validation helpers the generated ``Config`` classes call in ``__post_init__``.

A generated ``__post_init__`` checks every parameter (each ``check_*`` records what is wrong in
a list instead of raising), raises one ConfigError listing every problem (``require(self,
errors)``), computes the derived values, then evaluates every check of buffers.yaml and raises
one ConfigError listing every check that fails. Called without an error list, the ``check_*``
helpers raise at the first problem, as they always did.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .errors import ConfigError

_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
    )
}

INT_LIMIT = 1 << 62
"""Integer parameters are below this (sizes beyond it are mistakes, and the formulas over them
must stay within int64)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigBase:
    """Base of every generated Config: a frozen record of construct-time parameters."""


def _report(errors: list[str] | None, message: str) -> None:
    if errors is None:
        raise ConfigError(message)
    errors.append(message)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + "..." + text[-12:]


def check_int(config: Any, name: str, *, minimum: int = 0, errors: list[str] | None = None) -> None:
    """An integer (numpy integers too, stored as int; not a bool) in [minimum, INT_LIMIT)."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return _report(errors, f"{name} must be an int, got {_short(value)}")
    value = int(value)
    object.__setattr__(config, name, value)
    if value < minimum:
        return _report(errors, f"{name} must be at least {minimum}, got {value}")
    if value >= INT_LIMIT:
        return _report(errors, f"{name} must be below 2**62, got {value}")
    return None


def check_dtype(
    config: Any, name: str, allowed: tuple[str, ...] = (), errors: list[str] | None = None
) -> None:
    """A torch dtype, or its name, among `allowed` (default: every dtype buffers.yaml knows;
    never complex, float8 or other dtypes no buffer is written in)."""
    value = getattr(config, name)
    names = allowed or tuple(_DTYPES)
    if isinstance(value, str) and value in _DTYPES:
        value = _DTYPES[value]
        object.__setattr__(config, name, value)
    elif not isinstance(value, torch.dtype):
        return _report(
            errors,
            f"{name} must be a torch.dtype or one of {', '.join(names)}, got {_short(value)}",
        )
    if value not in tuple(_DTYPES[n] for n in names if n in _DTYPES):
        return _report(errors, f"{name} must be one of {', '.join(names)}, got {value}")
    return None


def check_bool(config: Any, name: str, errors: list[str] | None = None) -> None:
    value = getattr(config, name)
    if type(value) is not bool:
        return _report(errors, f"{name} must be True or False, got {_short(value)}")
    return None


def check_names(
    config: Any, name: str, allowed: tuple[str, ...], errors: list[str] | None = None
) -> None:
    """A sequence of distinct names from `allowed`, stored as a tuple (an iterator is read
    once, before it is checked)."""
    value = getattr(config, name)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return _report(errors, f"{name} must be a sequence of names, got {_short(value)}")
    try:
        value = tuple(value)
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the caller's value
        return _report(errors, f"{name} could not be read as a sequence of names: {exc}")
    object.__setattr__(config, name, value)
    if not all(isinstance(v, str) for v in value):
        return _report(errors, f"{name} must be a sequence of names, got {_short(value)}")
    unknown = [v for v in value if v not in allowed]
    if unknown:
        return _report(
            errors, f"{name}: {', '.join(map(repr, unknown))} not in {', '.join(allowed)}"
        )
    if len(set(value)) != len(value):
        return _report(errors, f"{name} names a module twice: {value!r}")
    return None


def require(config: Any, errors: list[str], *checks: tuple[Callable[[], bool], str]) -> None:
    """Evaluate every (condition, message) check, add the messages of those that fail (or
    cannot be evaluated) to `errors`, then raise one ConfigError listing all of `errors`, if
    any."""
    for condition, message in checks:
        try:
            ok = bool(condition())
        except ArithmeticError as exc:
            ok, message = False, f"{message} ({exc})"
        if not ok:
            errors.append(message)
    if errors:
        where = f"{type(config).__module__}.Config"
        if len(errors) == 1:
            raise ConfigError(f"{where}: {errors[0]}")
        raise ConfigError(f"{where}: {len(errors)} errors:\n" + "\n".join(f"  {e}" for e in errors))


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as the formula language defines it."""
    return -(-a // b)
