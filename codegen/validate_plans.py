"""What only the lowered families show, over the parameters' declared ranges: engine names
bound twice in a family, negative capacities and step-size bounds, constant fills outside
their dtype, and tensors, bindings, checks and check conditions that can never hold."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from . import expr as E
from . import prove, vocab
from .errors import Location
from .model import Check, Formula, Tensor
from .plan import FamilyPlan, PlannedTensor, family_flags
from .validate_names import Scope


def engine_names(scope: Scope, plans: list[FamilyPlan]) -> None:
    """Each engine input and output bound by one tensor at a time in each family (a name a
    binding repeated over index sets may take included)."""
    for plan in plans:
        fam = plan.family
        seen: dict[tuple[str, str], list[tuple[str, E.Expr | None]]] = {}
        _expansions(scope, plan)
        for pt in plan.tensors:
            for b in pt.bindings:
                key = (b.direction, b.engine_name)
                cond = _conj(pt.when, b.when)
                clash = next(
                    (n for n, c in seen.get(key, []) if not _exclusive(scope, c, cond)), None
                )
                seen.setdefault(key, []).append((pt.name, cond))
                if clash is not None:
                    other = scope.spec.tensor(clash)
                    scope.errors.error(
                        b.loc,
                        f"engine {b.direction} '{b.engine_name}' is bound by both "
                        f"'{other.name}' ({other.loc.line_from(b.loc)}) and '{pt.name}' in family "
                        f"'{fam.name}'; make their 'when' conditions exclusive",
                    )


def _expansions(scope: Scope, plan: FamilyPlan) -> None:
    """A plain engine name that a binding repeated over index sets can also take (`out1` and
    `out{layer}`): both would bind it."""
    repeated = [
        (pt, b, _pattern(scope, b.engine_name))
        for pt in plan.tensors
        for b in pt.bindings
        if b.each
    ]
    for pt in plan.tensors:
        for b in pt.bindings:
            if b.each:
                continue
            for other, r, pattern in repeated:
                if (
                    r.direction == b.direction
                    and pattern.fullmatch(b.engine_name)
                    and not _exclusive(scope, _conj(pt.when, b.when), _conj(other.when, r.when))
                ):
                    scope.errors.error(
                        b.loc,
                        f"engine {b.direction} '{b.engine_name}' of '{pt.name}' is also a name "
                        f"that '{other.name}' binds as '{r.engine_name}' "
                        f"({scope.spec.tensor(other.name).loc.line_from(b.loc)}) in family "
                        f"'{plan.family.name}'; rename one, or make their 'when' conditions "
                        "exclusive",
                    )


def _pattern(scope: Scope, name: str) -> re.Pattern[str]:
    """The names a repeated binding's `name` takes: each {SET} one of the set's labels (a
    names parameter's values, or any number)."""
    parts = re.split(r"\{(\w+)\}", name)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(re.escape(part))
            continue
        x = next((x for x in scope.spec.index_sets if x.name == part), None)
        if x is None or not x.names:
            out.append(r"-?[0-9]+")  # a numbered set's labels
            continue
        param = next((p for p in scope.spec.parameters if p.name == x.names), None)
        values = param.values if param is not None else ()
        out.append(f"(?:{'|'.join(map(re.escape, values))})" if values else r"\w+")
    return re.compile("".join(out))


def _exclusive(scope: Scope, a: E.Expr | None, b: E.Expr | None) -> bool:
    """True when conditions `a` and `b` (None = always) never hold together: for every
    value of the boolean parameters they read, their conjunction folds to false or
    compares the parameters in ways no value satisfies (``prove.can_hold``)."""
    if a is None or b is None:
        return False
    return not scope.prover.can_hold(E.BoolOp("and", (a, b)))


def ranges(scope: Scope, plans: list[FamilyPlan]) -> None:
    """Capacities that are negative, and constant fills outside their dtype, at a point of
    the declared ranges where the family's checks and the tensor's condition hold."""
    where: dict[str, list[tuple[FamilyPlan, PlannedTensor]]] = {}
    for plan in plans:
        for pt in plan.tensors:
            where.setdefault(pt.name, []).append((plan, pt))
    dims: dict[str, tuple[Formula, ...]] = {}
    for t in scope.spec.tensors:
        if t.fill.kind != "mirror" and t.capacity is not None:
            dims[t.name] = t.capacity
    for fam in scope.spec.families:
        for o in fam.additional_outputs:
            dims.setdefault(o.name, (Formula("", E.Int(1), o.loc), *o.dims))
    reported: set[Location] = set()
    for name, present in where.items():
        if name not in dims:
            continue
        for i, f in enumerate(dims[name]):
            if f.loc in reported or scope.prover.range_of(f.expr)[0] >= 0:
                continue
            found = _witness(scope, f.expr, lambda v: v < 0, present)
            if found is not None:
                reported.add(f.loc)
                point, value = found
                scope.errors.error(
                    f.loc,
                    f"tensor '{name}': capacity dimension {i} '{f.shown}' is negative "
                    f"({value}) {scope.prover.where(f.expr, point)}",
                )
    for t in scope.spec.tensors:
        if t.fill.kind == "constant" and t.fill.value is not None and t.name in where:
            _constant_range(scope, t, t.fill.value, where[t.name])
    for z in scope.spec.sizes:
        used = [(plan, None) for plan in plans if z in plan.sizes]
        what = f"the max of step size '{z.name}'"
        _never_negative(scope, z.bound, used, what, "no step could be prepared")
    for x in scope.spec.index_sets:
        used = [(plan, None) for plan in plans if any(y.name == x.name for y in plan.index_sets)]
        what = f"the count of index set '{x.name}'"
        _never_negative(scope, x.count, used, what, "its bindings would bind nothing")


def _never_negative(
    scope: Scope,
    f: Formula | None,
    used: Sequence[tuple[FamilyPlan, PlannedTensor | None]],
    what: str,
    consequence: str,
) -> None:
    """`f` (what it is: `what`) is not negative at any point of the declared ranges where a
    family that uses it (`used`) holds; else a located error saying the `consequence`."""
    if f is None or not used or scope.prover.range_of(f.expr)[0] >= 0:
        return
    found = _witness(scope, f.expr, lambda v: v < 0, used)
    if found is not None:
        point, value = found
        scope.errors.error(
            f.loc,
            f"{what}, '{f.shown}', is negative ({value}) {scope.prover.where(f.expr, point)}: "
            f"{consequence}",
        )


def _witness(
    scope: Scope,
    e: E.Expr,
    bad: Callable[[int], bool],
    present: Sequence[tuple[FamilyPlan, PlannedTensor | None]],
) -> tuple[prove.Point, int] | None:
    """A point where `bad(e)`, in a family where its checks (and the tensor's condition,
    when there is a tensor) hold."""

    def valid(env: prove.Env) -> bool:
        return any(
            all(scope.prover.holds(c.require.expr, env) for c in plan.checks)
            and (pt is None or pt.when is None or scope.prover.holds(pt.when, env))
            for plan, pt in present
        )

    return scope.prover.find(e, bad, valid)


def _constant_range(
    scope: Scope, t: Tensor, f: Formula, present: Sequence[tuple[FamilyPlan, PlannedTensor]]
) -> None:
    lo, hi = scope.prover.range_of(f.expr)
    for dtype in scope.dtype_choices(t.dtype):
        dlo, dhi = vocab.DTYPE_RANGES[dtype]
        span = f"{dtype} holds {dlo} to {dhi}" if dtype != "bool" else "bool holds 0 or 1"
        if hi < dlo or lo > dhi:
            scope.errors.error(
                f.loc,
                f"tensor '{t.name}': constant fill '{f.shown}' is always outside its dtype "
                f"({span})",
            )
            return
        if dlo <= lo and hi <= dhi:
            continue
        found = _witness(scope, f.expr, _outside(dlo, dhi), present)
        if found is not None:
            point, value = found
            scope.errors.error(
                f.loc,
                f"tensor '{t.name}': constant fill '{f.shown}' is {value} "
                f"{scope.prover.where(f.expr, point)}, outside its dtype ({span})",
            )
            return


def conditions(scope: Scope, plans: list[FamilyPlan]) -> None:
    """Tensors and bindings whose 'when' holds in no family (a contradiction, or flags no
    family sets), checks that can never hold (alone or with the checks before them), and
    check conditions ('when') true in no family."""
    present: dict[str, list[PlannedTensor]] = {}
    for plan in plans:
        for pt in plan.tensors:
            if scope.prover.can_hold(pt.when):
                present.setdefault(pt.name, []).append(pt)
    by_name = {t.name: t for t in scope.spec.tensors}
    spec = scope.spec
    for t in spec.tensors:
        if spec.extends is not None and t.loc.file != spec.file:
            continue  # the extended spec's tensors: only its families it generates hold them
        src = by_name.get(t.fill.target or "") if t.fill.kind == "mirror" else None
        if t.name not in present:
            if t.when is not None and (src is None or src.name in present):
                scope.errors.error(
                    t.when.loc,
                    f"tensor '{t.name}' exists in no family: its 'when' '{t.when.shown}' "
                    "never holds (a contradiction, or flag values no family sets)",
                )
            continue
        for b in t.bind:
            if b.when is None:
                continue
            if not any(
                scope.prover.can_hold(_conj(pt.when, pb.when))
                for pt in present[t.name]
                for pb in pt.bindings
                if pb.loc == b.loc
            ):
                scope.errors.error(
                    b.when.loc,
                    f"the binding of '{t.name}' to engine {b.direction} '{b.engine_name}' "
                    f"never applies: its 'when' '{b.when.shown}' never holds where "
                    f"'{t.name}' exists",
                )
    reported: set[Location] = set()
    applied: set[Location] = set()
    for plan in plans:
        before: list[Check] = []
        for c in plan.checks:
            applied.add(c.loc)
            if c.loc not in reported and not scope.prover.can_hold(c.require.expr):
                reported.add(c.loc)
                scope.errors.error(
                    c.require.loc,
                    f"check '{c.require.shown}' can never hold for the parameters' declared "
                    "ranges: every Config would fail it",
                )
            elif c.loc not in reported and not scope.prover.can_hold(_all([*before, c])):
                # the earlier checks it cannot hold with: those without which it could
                needed = [
                    b
                    for b in before
                    if scope.prover.can_hold(_all([x for x in before if x is not b] + [c]))
                ]
                lines = ", ".join(str(b.loc.line) for b in needed or before)
                reported.add(c.loc)
                scope.errors.error(
                    c.require.loc,
                    f"check '{c.require.shown}' contradicts the check(s) at line(s) {lines} "
                    f"in family '{plan.family.name}': every Config would fail one of them",
                )
            before.append(c)
    for c in scope.spec.checks:
        if c.when is not None and c.loc not in applied:
            flags = [family_flags(scope.spec, f) for f in scope.spec.families]
            if all(E.fold(c.when.expr, fl) == E.FALSE for fl in flags):
                scope.errors.error(
                    c.when.loc,
                    f"the check '{c.require.shown}' applies to no family: its 'when' "
                    f"'{c.when.shown}' is false in every family",
                )


def _conj(a: E.Expr | None, b: E.Expr | None) -> E.Expr | None:
    if a is None or b is None:
        return a if b is None else b
    return E.BoolOp("and", (a, b))


def _outside(lo: int, hi: int) -> Callable[[int], bool]:
    return lambda v: not lo <= v <= hi


def _all(checks: list[Check]) -> E.Expr:
    return E.BoolOp("and", tuple(c.require.expr for c in checks))
