"""The continue program of a family: `_continues`, `_continue_check` and `_continue`, for a
step of requests in flight whose context rows repeat the last step's layout.

Each rule tensor is written by its continue form, which writes the whole step as its fill
would, the generation rows from the last step's values. A family continues only where every
rule tensor the Config allocates has a continue form and starts with its rows (its dimensions
before the first that counts rows are 1), and every request check it runs is one a continue
check stands in for (the continue check of the rule that takes its result, for the context
and generation rows alike): `_continues` says so for the Config, decided once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import emit_lines as L
from . import expr as E
from .emit_formulas import construct_source
from .model import Impl
from .plan import FamilyPlan


def continue_program(
    plan: FamilyPlan, alias: Callable[[Impl], str], sizes: set[str]
) -> dict[str, Any]:
    """The template's context for the continue program: ``continues``, the lines of
    `_continues` (None where a rule tensor that every Config allocates has no continue form:
    the family never continues a step)."""
    program = plan.program
    assert program is not None
    shapes = {pt.name: pt.shape for pt in plan.tensors}
    conditions: list[str] = []
    for f in program.fills:
        if f.continues is None:
            if f.guard is None:
                return {"continues": None}
            conditions.append(f"not ({construct_source(f.guard)})")
            continue
        for dim in _leading(shapes[f.tensor], sizes):
            one = f"{construct_source(dim)} == 1"
            conditions.append(
                one if f.guard is None else f"(not ({construct_source(f.guard)}) or {one})"
            )
    # a continued step runs no request check: one may only be stood in for by the continue
    # check of the rule that takes its result
    covered = {f.check for f in program.fills if f.continue_check is not None}
    for chk in program.checks:
        if chk.name not in covered:
            if chk.guard is None:
                return {"continues": None}
            conditions.append(f"not ({construct_source(chk.guard)})")
    checks: list[str] = []
    results: list[dict[str, Any]] = []
    fills = []
    for f in program.fills:
        if f.continues is None:
            continue
        if f.continue_check is not None:
            L.step_check(
                f,
                alias(f.continue_check),
                "g",
                f.continue_check_state,
                f.continue_check_reads,
                f.continue_check_result,
                checks,
                results,
            )
        form = [alias(f.continues), f"t.{f.tensor}.out", f"p.{f.tensor}.out", "g"]
        if f.continue_check_result:
            form.append(f"k.{f.tensor}")
        fills.append(
            {"doc": L.fill_doc(f), "lines": L.write(f, [*form, *L.kwargs(f.advance_reads)])}
        )
    conditions = list(dict.fromkeys(conditions))
    one = " and ".join(conditions) or "True"
    return {
        "continues": [f"return {one}"]
        if len(one) <= 80
        else ["return (", f"    {conditions[0]}", *(f"    and {x}" for x in conditions[1:]), ")"],
        "continue_checks": checks,
        "continue_results": results,
        "continuing_lines": L.construction("Continuing", "g", results),
        "continue_fills": fills,
    }


def _leading(shape: tuple[E.Expr, ...], sizes: set[str]) -> list[E.Expr]:
    """The dimensions before the first that reads a step size (each must be 1 for the rows to
    lead the tensor), literal 1s left out."""
    out: list[E.Expr] = []
    for dim in shape:
        if any(n.id in sizes for n in E.names(dim)):
            return out
        if dim != E.Int(1):
            out.append(dim)
    return out
