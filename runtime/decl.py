"""The records a generated module declares its tensors with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

DEVICE = "device"
HOST = "host"
PINNED = "pinned"

ConfigFn = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Rule:
    """Written every step by the family's generated step program, with the rule implemented
    by `fill` (the program holds the call; the record says which rule, for reports)."""

    fill: Callable[..., int]

    @property
    def name(self) -> str:
        return self.fill.__name__

    @property
    def impl(self) -> str:
        """The implementation as a spec names it, ``module:function``."""
        f = self.fill
        return f"{getattr(f, '__module__', '?')}:{getattr(f, '__qualname__', self.name)}"


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


class _External:
    def __repr__(self) -> str:
        return "rt.EXTERNAL"


EXTERNAL = _External()
"""Written by the decoder or the caller after prepare_step, on the same stream; bufc
allocates it at capacity (holding its pad value), shapes it per step and binds it."""


@dataclasses.dataclass(frozen=True)
class Static:
    """Values handed over by ``set_static`` (``static_inputs``), bound once; `value`, a
    construct-time value it holds until then (None: the pad value)."""

    value: ConfigFn | None = None

    def __repr__(self) -> str:
        return "rt.STATIC" if self.value is None else f"rt.Static({self.value!r})"


STATIC = Static()
"""Values handed to the constructor (``static_inputs``), bound once."""

Fill = Rule | Mirror | Constant | _Engine | _External | Static


@dataclasses.dataclass(frozen=True)
class IndexSet:
    """Members a binding is repeated over, as (position, label) pairs: the names of a names
    parameter, or the labels first .. first + count - 1 kept where `where(config, label)`
    holds (the position counts all members, kept or not)."""

    name: str
    names: ConfigFn | None = None
    first: ConfigFn | None = None
    count: ConfigFn | None = None
    where: Callable[[Any, int], bool] | None = None

    def members(self, config: Any) -> list[tuple[int, str]]:
        if self.names is not None:
            return [(i, str(n)) for i, n in enumerate(self.names(config))]
        assert self.first is not None and self.count is not None
        first = self.first(config)
        return [
            (i, str(first + i))
            for i in range(self.count(config))
            if self.where is None or self.where(config, first + i)
        ]


@dataclasses.dataclass(frozen=True)
class Bind:
    """An engine IO name a tensor is bound to, optionally only when `when(config)` holds.

    With `each`, the binding is repeated for every combination of the sets' members: the
    name's ``{set}`` placeholders take the members' labels and the view is the tensor's step
    view indexed by their places in the sets (one leading dimension per set)."""

    engine_name: str
    when: ConfigFn | None = None
    each: tuple[IndexSet, ...] = ()

    def expand(self, config: Any) -> list[tuple[str, tuple[int, ...]]]:
        """(engine name, index into the leading dimensions) of every repetition."""
        out: list[tuple[str, tuple[int, ...]]] = [(self.engine_name, ())]
        for s in self.each:
            members = s.members(config)
            out = [
                (name.replace("{" + s.name + "}", label), index + (pos,))
                for name, index in out
                for pos, label in members
            ]
        return out


@dataclasses.dataclass(frozen=True)
class TensorDecl:
    name: str
    dtype: torch.dtype | ConfigFn
    memory: str
    capacity: ConfigFn
    shape: Callable[[Any, Any], tuple[int, ...]]
    fill: Fill
    pad: int | str | None = None  # a constant, or REPEAT_LAST (runtime/staging.py)
    when: ConfigFn | None = None
    inputs: tuple[Bind, ...] = ()
    outputs: tuple[Bind, ...] = ()
    checked: bool = False
    ring: int | None = None  # the leading dimension is a ring of step buffers, one bound per step

    @property
    def initial(self) -> int:
        """The value the storage is allocated with: the constant pad (repeat_last pads
        repeat what a step wrote; before any, 0)."""
        return self.pad if isinstance(self.pad, int) else 0
