"""The records a generated module declares its tensors with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .fills import Rule

DEVICE = "device"
HOST = "host"
PINNED = "pinned"

ConfigFn = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Mirror:
    """Filled by the per-step host-to-device copy of the host tensor `source`."""

    source: str


@dataclasses.dataclass(frozen=True)
class Constant:
    """Filled once at construction with a construct-time value."""

    value: ConfigFn


class _Engine:
    def __repr__(self) -> str:
        return "rt.ENGINE"


ENGINE = _Engine()
"""Written by the engine (outputs, and tensors the engine exchanges between ranks)."""

Fill = Rule | Mirror | Constant | _Engine


@dataclasses.dataclass(frozen=True)
class Bind:
    """An engine IO name a tensor is bound to, optionally only when `when(config)` holds."""

    engine_name: str
    when: ConfigFn | None = None


@dataclasses.dataclass(frozen=True)
class SizeBound:
    """A step size and its construct-time upper bound."""

    size: str
    bound: ConfigFn


@dataclasses.dataclass(frozen=True)
class TensorDecl:
    name: str
    dtype: torch.dtype | ConfigFn
    memory: str
    capacity: ConfigFn
    shape: Callable[[Any, Any], tuple[int, ...]]
    fill: Fill
    pad: int | None = None
    when: ConfigFn | None = None
    inputs: tuple[Bind, ...] = ()
    outputs: tuple[Bind, ...] = ()
    checked: bool = False
