"""Located diagnostics: every message the compiler prints starts with ``FILE:LINE:COL``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True, order=True)
class Location:
    """A 1-based position in a spec file."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        file = self.file if self.file.isprintable() else ascii(self.file)[1:-1]  # one line
        return f"{file}:{self.line}:{self.col}"

    def line_from(self, here: Location) -> str:
        """This position as a message written at `here` names it: ``line N`` in the same file,
        ``FILE:N`` in another (a spec that extends bufc's names bufc's lines so)."""
        return f"line {self.line}" if self.file == here.file else f"{self.file}:{self.line}"

    def shifted(self, cols: int) -> Location:
        """The position `cols` characters further on the same line (inside a formula)."""
        return Location(self.file, self.line, self.col + cols)


@dataclasses.dataclass(frozen=True, order=True)
class Diagnostic:
    loc: Location
    message: str

    def __str__(self) -> str:
        return f"{self.loc}: {self.message}"


class SpecError(Exception):
    """One or more diagnostics; raised only after a whole phase has collected them all."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.diagnostics = sorted(set(diagnostics))
        super().__init__("\n".join(str(d) for d in self.diagnostics))


class Collector:
    """Accumulates diagnostics so that all of them are reported, sorted, at once."""

    def __init__(self) -> None:
        self._items: list[Diagnostic] = []

    def error(self, loc: Location, message: str) -> None:
        self._items.append(Diagnostic(loc, message))

    def extend(self, diagnostics: Iterable[Diagnostic]) -> None:
        self._items.extend(diagnostics)

    def __bool__(self) -> bool:
        return bool(self._items)

    def raise_if_any(self) -> None:
        if self._items:
            raise SpecError(self._items)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A ' (did you mean 'x'?)' suffix, or '' when nothing is close."""
    import difflib

    close = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
