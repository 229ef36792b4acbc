"""The step program each generated module defines on its ``RuntimeBuffers``: the methods the
runtime calls, each raising until the family's module overrides it (``_admit`` and
``_scalars`` do nothing where a family declares no arrival check or step scalar)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .staging import DeviceStep, Targets
from .step import NO_SCALARS


class Program:
    """A mixin of ``RuntimeBuffers``: the generated step program's methods."""

    def _limits(self) -> Any:
        raise NotImplementedError

    def _size_bounds(self) -> Any:  # each step size's capacity: rt.SizeBounds
        raise NotImplementedError

    def _batch(self, context: Sequence[Any], generation: Sequence[Any]) -> Any:
        raise NotImplementedError

    def _in_flight(self) -> Any:
        raise NotImplementedError

    def _admit(self, r: Any) -> None:
        """The family's checks of a request arriving in flight (none unless generated)."""

    def _check(self, b: Any) -> Any:
        raise NotImplementedError

    def _fill(self, targets: Targets, checked: Any) -> Any:
        raise NotImplementedError

    def _advance_check(self, last: Any, tokens: Any, holds_run: bool) -> Any:
        raise NotImplementedError

    def _advance(self, targets: Targets, prev: Targets, advancing: Any) -> None:
        raise NotImplementedError

    def _advance_on_device(self, v: DeviceStep, advancing: Any) -> None:
        raise NotImplementedError

    def _device_fill(self, targets: Any, rows: Any) -> None:  # the device build's program
        raise NotImplementedError

    def _device_host_fill(self, targets: Targets, checked: Any) -> None:
        raise NotImplementedError

    def _device_scalars(self, sizes: Any) -> Mapping[str, int]:
        raise NotImplementedError

    def _scalars(self, targets: Targets, sizes: Any) -> Mapping[str, int]:
        """The step scalars of the step just written (none unless the family declares any)."""
        return NO_SCALARS
