"""Validation helpers the generated ``Config`` classes call in ``__post_init__``."""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigBase:
    """Base of every generated Config: a frozen record of construct-time parameters."""


def check_int(config: Any, name: str, *, minimum: int = 0) -> None:
    value = getattr(config, name)
    if type(value) is not int:
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")


def check_dtype(config: Any, name: str, allowed: tuple[str, ...] = ()) -> None:
    value = getattr(config, name)
    names = allowed or tuple(_DTYPES)
    if isinstance(value, str) and value in _DTYPES:
        value = _DTYPES[value]
        object.__setattr__(config, name, value)
    elif not isinstance(value, torch.dtype):
        raise ConfigError(
            f"{name} must be a torch.dtype or one of {', '.join(names)}, got {value!r}"
        )
    if allowed and value not in tuple(_DTYPES[n] for n in allowed):
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value}")


def check_bool(config: Any, name: str) -> None:
    value = getattr(config, name)
    if type(value) is not bool:
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def check_names(config: Any, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{name} must be a sequence of names, got {value!r}")
    value = tuple(value)
    for v in value:
        if v not in allowed:
            raise ConfigError(f"{name}: {v!r} is not one of {', '.join(allowed)}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{name} names a module twice: {value!r}")
    object.__setattr__(config, name, value)


def require(config: Any, condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(f"{type(config).__module__}.Config: {message}")


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as the formula language defines it."""
    return -(-a // b)
