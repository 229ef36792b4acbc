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
from collections.abc import Callable
from typing import Any

import torch

from bufc import config_checks as _checks
from bufc.config_checks import INT_LIMIT  # noqa: F401 - re-exported

from ..errors import ConfigError

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigBase:
    """Base of every generated Config: a frozen record of construct-time parameters."""


def _report(errors: list[str] | None, message: str) -> None:
    if errors is None:
        raise ConfigError(message)
    errors.append(message)


def _checked(errors: list[str] | None, found: list[str]) -> None:
    """What a shared check found: added to `errors`, or (without a list) raised."""
    for message in found:
        _report(errors, message)


_short = _checks.short


def check_int(config: Any, name: str, *, minimum: int = 0, errors: list[str] | None = None) -> None:
    """An integer (numpy integers too, stored as int; not a bool) in [minimum, INT_LIMIT)."""
    found: list[str] = []
    _checks.check_int(config, name, minimum=minimum, errors=found)
    _checked(errors, found)


def check_ints(
    config: Any, name: str, *, minimum: int = 0, errors: list[str] | None = None
) -> None:
    """A sequence of integers, each in [minimum, INT_LIMIT), stored as a tuple."""
    found: list[str] = []
    _checks.check_ints(config, name, minimum=minimum, errors=found)
    _checked(errors, found)


def derived(config: Any, name: str, value: Any, kind: str) -> Any:
    """What a derived value's function returned, checked against its declared type ('int':
    an integer, not a bool; 'ints': a sequence of them, stored as a tuple); ConfigError
    naming the value otherwise."""
    where = f"{type(config).__module__}.Config"
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"{where}: derived value {name} must be an int, got {_short(value)}")
        return int(value)
    try:
        values = tuple(value)
    except TypeError:
        values = None
    if values is None or any(
        isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values
    ):
        raise ConfigError(
            f"{where}: derived value {name} must be a sequence of ints, got {_short(value)}"
        )
    return tuple(int(v) for v in values)


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
    found: list[str] = []
    _checks.check_bool(config, name, found)
    _checked(errors, found)


def check_names(
    config: Any, name: str, allowed: tuple[str, ...], errors: list[str] | None = None
) -> None:
    """A sequence of distinct names from `allowed`, stored as a tuple (an iterator is read
    once, before it is checked)."""
    found: list[str] = []
    _checks.check_names(config, name, allowed, found)
    _checked(errors, found)


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
        raise ConfigError(_checks.failure(f"{type(config).__module__}.Config", errors))


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as the formula language defines it."""
    return -(-a // b)
