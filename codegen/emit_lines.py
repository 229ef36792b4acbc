"""The line printers of the generated step program: calls, conditions, comments and the
constructor calls of the records a step's checks return."""

from __future__ import annotations

import textwrap
from typing import Any

from . import expr as E
from .emit_formulas import construct_source
from .plan import PlannedFill


def comment(text: str) -> str:
    """Text safe inside a ``#`` comment or a triple-quoted docstring.

    Docs are one line of printable ASCII (the schema); control characters are dropped anyway,
    and backslashes and quotes are escaped so a doc can never close its docstring.
    """
    text = "".join(ch for ch in text if " " <= ch <= "~")
    return text.replace("\\", "\\\\").replace('"', '\\"')


def kwargs(reads: tuple[str, ...]) -> list[str]:
    return [f"{n}=c.{n}" for n in reads]


def call(fn: str, args: list[str]) -> str:
    return f"{fn}({', '.join(args)})"


def lines(fn: str, args: list[str], indent: int) -> list[str]:
    """The call as one line, or with one argument a line where that would pass 100 columns."""
    one = call(fn, args)
    if indent + len(one) <= 100:
        return [one]
    return [f"{fn}(", *(f"    {a}," for a in args), ")"]


def under(cond: E.Expr | None, body: list[str]) -> list[str]:
    """`body`, under a construct-time condition where there is one."""
    if cond is None:
        return body
    return [f"if {construct_source(cond)}:", *(f"    {x}" for x in body)]


def guarded(cond: E.Expr | None, fn: str, args: list[str]) -> list[str]:
    """The call, under the tensor's construct-time condition where it has one."""
    return under(cond, lines(fn, args, 8 if cond is None else 12))


def value(name: str, fn: str, args: list[str], guard: E.Expr | None) -> list[str]:
    """`name=CALL,` (or `CALL if GUARD else None`) as lines of a constructor call."""
    one = f"{name}={call(fn, args)}"
    if guard is not None:
        one += f" if {construct_source(guard)} else None"
    if 12 + len(one) < 100:
        return [one + ","]
    head = [f"{name}={fn}(", *(f"    {a}," for a in args)]
    return [
        *head,
        f"){' if ' + construct_source(guard) + ' else None' if guard is not None else ''},",
    ]


def construction(cls: str, first: str, results: list[dict[str, Any]]) -> list[str]:
    """`return CLS(first, name=value, ...)`, one value a line when there are any."""
    if not results:
        return [f"return {cls}({first})"]
    return [
        f"return {cls}(",
        f"    {first},",
        *(f"    {x}" for r in results for x in r["lines"]),
        ")",
    ]


def wrapped(text: str) -> list[str]:
    """A comment's lines inside a method body (at most 100 columns)."""
    return textwrap.wrap(text, width=90, break_long_words=False, break_on_hyphens=False)


def fill_doc(f: PlannedFill) -> list[str]:
    """The comment above a tensor's fill: its name and doc."""
    return wrapped(f"{f.tensor}: {comment(f.doc)}")


def write(f: PlannedFill, call: list[str]) -> list[str]:
    """`t.TENSOR.wrote(RULE(t.TENSOR.out, ...))` (the rule returns the elements it wrote),
    under the tensor's construct-time condition where it has one."""
    indent = 8 if f.guard is None else 12
    inner = lines(call[0], call[1:], indent + len(f"t.{f.tensor}.wrote("))
    if len(inner) == 1:
        return under(f.guard, [f"t.{f.tensor}.wrote({inner[0]})"])
    return under(f.guard, [f"t.{f.tensor}.wrote(", *(f"    {x}" for x in inner), ")"])


def step_check(
    f: PlannedFill,
    fn: str,
    first: str,
    state: str | None,
    reads: tuple[str, ...],
    result: bool,
    checks: list[str],
    results: list[dict[str, Any]],
) -> None:
    """A rule's advance check, `fn(first, [state.STATE], **reads)`: its lines
    into `checks`, or, where the form takes what it returns, an entry of the record the
    checks return into `results` (named by the tensor)."""
    args = [first, *([f"state.{state}"] if state else []), *kwargs(reads)]
    if result:
        entry = {"name": f.tensor, "lines": value(f.tensor, fn, args, f.guard)}
        results.append({**entry, "guarded": f.guard is not None})
    else:
        checks.extend(guarded(f.guard, fn, args))
