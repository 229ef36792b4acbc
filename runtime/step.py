"""What one prepared step hands the engine: its IO views, its sizes and its step scalars."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import torch

NO_SCALARS: Mapping[str, int] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class Step:
    """One prepared step: engine IO views sized for this step, its sizes, and its scalars (the
    host integers the spec's `scalars` declare, also readable as attributes: ``step.NAME``)."""

    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    sizes: Any  # the family's StepSizes
    scalars: Mapping[str, int] = dataclasses.field(default_factory=lambda: NO_SCALARS)
    ring_slots: dict[str, int] = dataclasses.field(default_factory=dict)
    """The slot each ring tensor binds in this step."""

    def __getattr__(self, name: str) -> int:
        scalars = self.__dict__.get("scalars")
        if scalars is not None and name in scalars:
            return scalars[name]
        known = ", ".join(sorted(scalars or ())) or "none in this family"
        raise AttributeError(f"Step has no attribute or scalar {name!r} (scalars: {known})")
