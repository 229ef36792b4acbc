"""Errors the runtime raises for bad configs and bad batches."""

from __future__ import annotations


class ConfigError(ValueError):
    """A Config value is out of range or violates a check of buffers.yaml."""


class BatchError(ValueError):
    """A scheduled batch cannot be prepared; the buffers are left exactly as they were."""


class FillCountError(BatchError):
    """A rule's fill (or its advance form) returned something other than the number of
    elements it wrote, an int in 0..len(out): a bug of that rule, which the message names. The
    step is abandoned; the last step stays current."""

    def __init__(self, tensor: str, rule: str, value: object, size: int, form: str = "fill"):
        shown = repr(value)
        if len(shown) > 60:  # e.g. an array returned by mistake
            shown = shown[:57] + "..."
        what = (
            f"fill of tensor {tensor!r} (rule {rule})"
            if form == "fill"
            else f"advance(): the advance form of rule {rule} (tensor {tensor!r})"
        )
        super().__init__(
            f"{what} returned {shown}; {'a' if form == 'fill' else 'an'} {form} returns the number of elements it wrote, an "
            f"int in 0..{size}. The step was abandoned and the last step stays current"
        )
        self.tensor, self.rule, self.value, self.size, self.form = tensor, rule, value, size, form

    def __reduce__(self) -> tuple:  # pickled with its own arguments (not the message)
        return (type(self), (self.tensor, self.rule, self.value, self.size, self.form))

    def in_advance(self) -> FillCountError:
        """The same error raised by the rule's advance form (advance(), or a steady step)."""
        return FillCountError(self.tensor, self.rule, self.value, self.size, "advance form")


class RuleError(BatchError):
    """One of the spec's own implementations (a project's rule, request check or advance form)
    raised at step time: a bug or a limit of that rule, which the message names with its
    implementation (the original exception is its ``__cause__``). The step is abandoned; the
    last step stays current."""

    def __init__(self, what: str, impl: str, error: str, where: str = "") -> None:
        super().__init__(
            f"{what} ({impl}) raised {error}; the step was abandoned and the last step stays "
            f"current{where}"
        )
        self.what, self.impl, self.error, self.where = what, impl, error, where

    def __reduce__(self) -> tuple:  # pickled with its own arguments (not the message)
        return (type(self), (self.what, self.impl, self.error, self.where))
