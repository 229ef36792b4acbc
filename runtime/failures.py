"""What a step that fails after its checks leaves: the staging half it was writing is
abandoned (re-padded in full when next written), the device arena restored from the last
step's half, and the error says what stays current. A mixin of ``RuntimeBuffers``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from ..errors import BatchError, RuleError
from .staging import HALVES, Targets
from .storage import Stored
from .transfer import Transfer


class Failures:
    """The failure paths of ``RuntimeBuffers``, which sets what they read."""

    double_buffered: bool
    state: Any
    state_type: ClassVar[type]
    _targets: list[Targets]
    _t: dict[str, Stored]
    _half_run: list[int | None]
    _decode: Any
    _io: Transfer

    def _rule_error(self, exc: Exception, where: str = "") -> RuleError | None:
        raise NotImplementedError

    def _abandon_half(self, h: int) -> None:
        """Half h was partly written by a step that failed: the current half stays the last
        step's, h holds no run any more, and every row of h is re-padded when it is next
        written (its high-water marks at capacity, no repeated tail known). Rule state is
        rebuilt from the requests. Without double buffering h is the last step's half too: no
        half holds a run and nothing continues from it (the next step is prepared in full)."""
        self._half_run[h] = None
        for name, target in vars(self._targets[h]).items():
            target.written[:] = [self._t[name].numel, None]
        self.state = self.state_type()
        if not self.double_buffered:
            self._half_run[:] = [None] * HALVES
            self._decode = None

    def _noted(self, error: BatchError) -> BatchError:
        """A failure after the step started writing, as raised: without double buffering it
        says what the one staging half lost."""
        if not self.double_buffered:
            error.add_note(
                "with one staging half (double_buffered=False) the last step's buffers hold "
                "part of the failed step: the next step is prepared in full"
            )
        return error

    def _to_device(self, h: int, work: Callable[[], None]) -> None:
        """The device work of the step written into half h (its copy, or a decode step on
        the device), all or nothing: should it raise, the device arena is restored from the
        last step's half, half h is abandoned and the error is a BatchError."""
        high_water = self._io.high_water
        try:
            work()
        except Exception as exc:
            if self.double_buffered:
                self._io.restore(h, high_water)
            else:  # no other half: the device is sent everything with the next step
                self._io.forget()
            self._abandon_half(h)
            named = self._rule_error(exc, ", on the host and the device")
            if named is not None:  # a project's device advance form raised
                raise self._noted(named) from exc
            raise self._noted(
                BatchError(
                    f"the step's device work failed ({type(exc).__name__}: {exc}); the step "
                    "was abandoned and the last step stays current, on the host and the device"
                )
            ) from exc
