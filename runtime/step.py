"""What one prepared step hands the engine: its IO views, its sizes, its step scalars and its
mode. Each family's generated module subclasses ``StepInputs`` with one typed attribute per
bound input and per step scalar (``step.inputs.NAME``); by engine name
(``step.inputs['NAME']``) the inputs read as a read-only mapping."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

NO_SCALARS: Mapping[str, int] = types.MappingProxyType({})


class StepMode(str, enum.Enum):
    """What a step runs (SGLang's ForwardMode): prompt chunks only, generation rows only,
    both, or nothing."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"

    def __str__(self) -> str:
        return self.value

    @staticmethod
    def of(sizes: Any) -> StepMode:
        """The mode of a step of these sizes."""
        context = sizes.num_context_requests > 0
        generation = getattr(sizes, "num_generation_requests", 0) > 0
        if context:
            return StepMode.MIXED if generation else StepMode.PREFILL
        return StepMode.DECODE if generation else StepMode.IDLE


class UnknownInput(KeyError):
    """An engine name the step does not bind: the message names the nearest ones."""

    def __str__(self) -> str:  # KeyError would print the message's repr
        return str(self.args[0])


def _nearest(name: str, known: Any) -> str:
    close = [repr(c) for c in difflib.get_close_matches(name, sorted(known), n=3)]
    if not close:
        return ""
    return f"; did you mean {', '.join(close[:-1]) + ' or ' if close[1:] else ''}{close[-1]}?"


class StepInputs(Mapping[str, torch.Tensor]):
    """A step's engine inputs, read-only: by engine name, and (in a family's generated
    subclass) by attribute, with the step scalars and the step mode. Built once per step
    around the views the step binds."""

    __slots__ = ("_views", "_scalars", "_mode", "_each")
    _views: dict[str, torch.Tensor]
    _scalars: Mapping[str, int]
    _mode: StepMode
    _each: Mapping[str, tuple[str, ...]]
    FAMILY: ClassVar[str] = ""  # the generated subclass's family

    def __init__(
        self,
        views: dict[str, torch.Tensor],
        scalars: Mapping[str, int] = NO_SCALARS,
        mode: StepMode = StepMode.IDLE,
        each: Mapping[str, tuple[str, ...]] = NO_SCALARS,  # type: ignore[assignment]
    ) -> None:
        object.__setattr__(self, "_views", views)
        object.__setattr__(self, "_scalars", scalars)
        object.__setattr__(self, "_mode", mode)
        object.__setattr__(self, "_each", each)  # a repeated binding's engine names, by tensor

    @property
    def mode(self) -> StepMode:
        """prefill, decode, mixed or idle (StepMode)."""
        return self._mode

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._views[name]
        except KeyError:
            raise UnknownInput(
                f"the step binds no input {name!r}{_nearest(name, self._views)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._views

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._mode.value}: {', '.join(self._views)}>"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a step's inputs are read-only (setting {name!r})")

    def __reduce__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle build a new one
        return (type(self), (dict(self._views), dict(self._scalars), self._mode, dict(self._each)))

    if not TYPE_CHECKING:  # mypy reports an unknown attribute itself

        def __getattr__(self, name: str) -> Any:  # a name no attribute has, or whose raised
            if name.startswith("__"):
                raise AttributeError(name)
            reads = getattr(type(self), name, None)
            if isinstance(reads, property):  # an input this step lacks: the property says so
                return reads.fget(self)  # type: ignore[misc]
            if name in self._views:  # an engine name no attribute can take
                raise AttributeError(f"read the input {name!r} by name: inputs[{name!r}]")
            known = {n for n in dir(type(self)) if not n.startswith("_")} | set(self._scalars)
            raise AttributeError(
                f"{type(self).__name__} has no input or scalar {name!r}{_nearest(name, known)}"
            )

    # ---- what the generated attributes read
    def _input(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            raise AttributeError(
                f"{name!r} is not among this step's inputs: this Config binds it elsewhere "
                "(a static input: static_inputs) or not at all (its condition does not hold)"
            )
        return view

    def _inputs(self, tensor: str) -> tuple[torch.Tensor, ...]:
        """A repeated binding's views, in the order of its index sets."""
        names = self._each.get(tensor)
        if names is None:
            self._input(tensor)  # raises: not among this step's inputs
        return tuple(self._views[name] for name in names or ())

    def _scalar(self, name: str) -> int:
        value = self._scalars.get(name)
        if value is None:
            raise AttributeError(f"the step scalar {name!r} is not computed under this Config")
        return value


InputsT = TypeVar("InputsT", bound=StepInputs)


@dataclasses.dataclass(frozen=True)
class Step(Generic[InputsT]):
    """One prepared step: engine IO views sized for this step (``inputs``: the family's
    StepInputs), its sizes, its scalars (also readable as attributes: ``step.NAME``) and its
    mode."""

    inputs: InputsT
    outputs: dict[str, torch.Tensor]
    sizes: Any  # the family's StepSizes
    scalars: Mapping[str, int] = dataclasses.field(default_factory=lambda: NO_SCALARS)
    ring_slots: dict[str, int] = dataclasses.field(default_factory=dict)
    """The slot each ring tensor binds in this step."""

    @property
    def mode(self) -> StepMode:
        """prefill, decode, mixed or idle: what the step runs (``inputs.mode``)."""
        return self.inputs.mode

    def __getattr__(self, name: str) -> int:
        scalars = self.__dict__.get("scalars")
        if scalars is not None and name in scalars:
            return scalars[name]
        known = ", ".join(sorted(scalars or ())) or "none in this family"
        raise AttributeError(f"Step has no attribute or scalar {name!r} (scalars: {known})")
