"""What every call into the buffers is held to: one call at a time, and each step size within
its capacity (the generated checks call ``check_size``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import BatchError

_F = TypeVar("_F", bound=Callable[..., Any])


def exclusive(method: _F) -> _F:
    """One call into the buffers at a time: a call made while another runs (from a rule the
    step calls, or from a second thread) is refused before it reads or writes anything, and
    the running call is unaffected."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._busy.acquire(blocking=False):
            raise BatchError(
                f"{method.__name__}(): another call into these buffers is running (a call "
                "from inside a step, or from a second thread); drive one RuntimeBuffers from "
                "one thread, one call at a time"
            )
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy.release()

    return call  # type: ignore[return-value]


class SizeBounds:
    """Each step size's capacity (the family's generated ``_size_bounds``, made once): a call
    checks a step's sizes against them. Serving repeats a step's counts, and with them one
    ``StepSizes`` object (``batch.step_sizes`` keeps the recent ones): the sizes that last
    passed are not checked again."""

    __slots__ = ("bounds", "passed")

    def __init__(self, **bounds: int) -> None:
        self.bounds = tuple(bounds.items())
        self.passed: Any = None

    def __call__(self, s: Any) -> None:
        if s is self.passed:
            return
        for name, bound in self.bounds:
            check_size(name, getattr(s, name), bound)
        self.passed = s


def check_size(name: str, value: int, bound: int) -> None:
    """A step size within its capacity (the generated checks call this for each size)."""
    if value > bound:
        raise BatchError(
            f"{name} = {value} exceeds its capacity {bound}; schedule fewer requests or tokens"
        )
