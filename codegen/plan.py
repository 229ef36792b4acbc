"""Lowering: one family's view of the spec, with every generate-time decision taken.

Flags are folded into every condition: tensors and bindings whose condition folds to false
disappear, true conditions vanish, and what remains is a residual condition over construct-time
parameters, evaluated once in the generated constructor. The plan also records which
parameters and derived values the family actually uses, and which capacities are proven to
hold every step shape (the rest get a run-time guard).
"""

from __future__ import annotations

import dataclasses

from . import expr as E
from . import prove, vocab
from .errors import Location
from .model import Check, Derived, Family, Parameter, Spec, StepSize, Tensor


@dataclasses.dataclass(frozen=True)
class PlannedBinding:
    direction: str
    engine_name: str
    when: E.Expr | None  # residual construct-time condition, None = always
    loc: Location
    each: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PlannedIndexSet:
    name: str
    doc: str
    names: str | None
    first: E.Expr | None
    count: E.Expr | None
    where: E.Expr | None  # residual (flags folded); None = keep every member


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    name: str
    doc: str
    dtype: str  # a vocab dtype or a dtype parameter name
    dtype_is_param: bool
    memory: str
    capacity: tuple[E.Expr, ...]
    shape: tuple[E.Expr, ...]
    when: E.Expr | None
    fill_kind: str
    fill_target: str | None
    constant: E.Expr | None
    pad: int | None
    bindings: tuple[PlannedBinding, ...]
    checked: bool  # capacity not proven at generate time: guard it every step
    loc: Location
    ring: int | None = None


@dataclasses.dataclass(frozen=True)
class FamilyPlan:
    family: Family
    flags: tuple[tuple[str, str | bool], ...]
    parameters: tuple[Parameter, ...]
    derived: tuple[Derived, ...]
    checks: tuple[Check, ...]
    sizes: tuple[StepSize, ...]
    tensors: tuple[PlannedTensor, ...]
    index_sets: tuple[PlannedIndexSet, ...] = ()
    dtype_values: tuple[tuple[str, tuple[str, ...]], ...] = ()  # each dtype parameter's choices


def _conj(a: E.Expr | None, b: E.Expr | None) -> E.Expr | None:
    if a is None:
        return b
    if b is None:
        return a
    return E.BoolOp("and", (a, b))


def _fold(cond: E.Expr | None, flags: dict[str, str | bool]) -> E.Expr | None:
    """Fold flags; None means 'always'; E.FALSE means 'never'."""
    if cond is None:
        return None
    folded = E.fold(cond, flags)
    return None if folded == E.TRUE else folded


def lower_family(spec: Spec, family: Family) -> FamilyPlan:
    prover = prove.prover(spec)
    flags = family_flags(spec, family)
    by_name = {t.name: t for t in spec.tensors}
    tensors: list[PlannedTensor] = []
    for t in spec.tensors:
        src: Tensor = by_name[t.fill.target] if t.fill.kind == "mirror" else t  # type: ignore[index]
        own = t.when.expr if t.when else None
        # a mirror exists only where its source does
        when = _fold(
            _conj(src.when.expr if src.when else None, own) if src is not t else own, flags
        )
        if when == E.FALSE:
            continue
        binds = []
        for b in t.bind:
            bw = _fold(b.when.expr if b.when else None, flags)
            if bw != E.FALSE:
                binds.append(PlannedBinding(b.direction, b.engine_name, bw, b.loc, b.each))
        assert src.dtype is not None and src.capacity is not None and src.shape is not None
        capacity = tuple(f.expr for f in src.capacity)
        shape = tuple(f.expr for f in src.shape)
        proven = all(
            prover.at_least(cap, step, prove.VAR, prove.UPPER) for cap, step in zip(capacity, shape)
        )
        tensors.append(
            PlannedTensor(
                name=t.name,
                doc=t.doc,
                dtype=src.dtype,
                dtype_is_param=src.dtype not in _dtypes(),
                memory=t.memory,
                capacity=capacity,
                shape=shape,
                when=when,
                fill_kind=t.fill.kind,
                fill_target=t.fill.target,
                constant=t.fill.value.expr if t.fill.value else None,
                pad=src.pad,
                bindings=tuple(binds),
                checked=not proven,
                loc=t.loc,
                ring=src.ring,
            )
        )

    tensors += _additional_outputs(spec, family, flags)
    set_names = {n for pt in tensors for b in pt.bindings for n in b.each}
    index_sets = tuple(
        PlannedIndexSet(
            x.name,
            x.doc,
            x.names,
            x.first.expr if x.first else None,
            x.count.expr if x.count else None,
            _fold(x.where.expr if x.where else None, flags),
        )
        for x in spec.index_sets
        if x.name in set_names
    )

    # Which construct-time names does this family read?
    used: set[str] = set()

    def use(e: E.Expr | None) -> None:
        if e is not None:
            used.update(n.id for n in E.names(e))

    for pt in tensors:
        if pt.fill_kind == "rule":
            used.update(vocab.FILL_RULES[pt.fill_target or ""].needs)
        use(pt.when)
        for e in (*pt.capacity, *pt.shape, pt.constant):
            use(e)
        for pb in pt.bindings:
            use(pb.when)
        if pt.dtype_is_param:
            used.add(pt.dtype)
    read = {n.id for pt in tensors for e in pt.shape for n in E.names(e)}
    sizes = tuple(z for z in spec.sizes if z.name not in vocab.ENCODER_SIZES or z.name in read)
    for z in sizes:
        use(z.bound.expr if z.bound else None)
    for x in index_sets:
        for e in (x.first, x.count, x.where):
            use(e)
        if x.names:
            used.add(x.names)
    used.discard("index")
    derived_by_name = {d.name: d for d in spec.derived}

    def close(names: set[str]) -> set[str]:
        todo = list(names)
        out = set(names)
        while todo:
            d = derived_by_name.get(todo.pop())
            if d:
                for n in E.names(d.value.expr):
                    if n.id not in out:
                        out.add(n.id)
                        todo.append(n.id)
        return out

    used = close(used)
    checks = []
    for c in spec.checks:
        if c.when is not None and _fold(c.when.expr, flags) == E.FALSE:
            continue  # not this family's check
        needs = close({n.id for n in E.names(c.require.expr)})
        params_needed = {n for n in needs if n not in derived_by_name}
        if params_needed <= used:
            checks.append(c)
            used |= needs
    parameters = tuple(p for p in spec.parameters if p.name in used)
    return FamilyPlan(
        family=family,
        flags=tuple(flags.items()),
        parameters=parameters,
        derived=tuple(_topo(d for d in spec.derived if d.name in used)),
        checks=tuple(checks),
        sizes=sizes,
        tensors=tuple(tensors),
        index_sets=index_sets,
        dtype_values=tuple(
            (p.name, dtype_values(spec, p)) for p in parameters if p.kind == "dtype"
        ),
    )


def dtype_values(spec: Spec, param: Parameter) -> tuple[str, ...]:
    """The dtypes dtype parameter `param` may take: its declared values; without them, the
    dtypes every fill rule of a tensor declared with it can write (all dtypes if none)."""
    if param.values:
        return tuple(param.values)
    allowed = tuple(vocab.DTYPES)
    for t in spec.tensors:
        if t.dtype == param.name and t.fill.kind == "rule":
            rule = vocab.FILL_RULES.get(t.fill.target or "")
            if rule is not None:
                allowed = tuple(d for d in allowed if d in rule.dtypes)
    return allowed


def _additional_outputs(
    spec: Spec, family: Family, flags: dict[str, str | bool]
) -> list[PlannedTensor]:
    """A family's extra engine outputs as engine-written tensors: one row per token (capacity:
    the bound of num_tokens), where their `when` holds."""
    if not family.additional_outputs:
        return []
    rows = next(z for z in spec.sizes if z.name == "num_tokens")
    assert rows.bound is not None
    out = []
    for o in family.additional_outputs:
        when = _fold(o.when.expr if o.when else None, flags)
        if when == E.FALSE:
            continue
        dims = tuple(f.expr for f in o.dims)
        out.append(
            PlannedTensor(
                name=o.name,
                doc=o.doc,
                dtype=o.dtype,
                dtype_is_param=o.dtype not in _dtypes(),
                memory="device",
                capacity=(rows.bound.expr, *dims),
                shape=(E.Name("num_tokens"), *dims),
                when=when,
                fill_kind="engine",
                fill_target=None,
                constant=None,
                pad=None,
                bindings=(PlannedBinding("output", o.name, None, o.loc),),
                checked=False,
                loc=o.loc,
            )
        )
    return out


def family_flags(spec: Spec, family: Family) -> dict[str, str | bool]:
    """Every flag's value in `family`: its own setting, else the flag's default (in the
    order the flags are declared)."""
    given = dict(family.flags)
    return {
        f.name: given.get(f.name, f.default)  # type: ignore[misc]
        for f in spec.flags
        if f.name in given or f.default is not None
    }


def _dtypes() -> dict[str, str]:
    from .vocab import DTYPES

    return DTYPES


def _topo(items: object) -> list[Derived]:
    """Derived values in an order where each comes after the ones it reads."""
    pending = list(items)  # type: ignore[call-overload]
    names = {d.name for d in pending}
    done: list[Derived] = []
    placed: set[str] = set()
    while pending:
        for d in pending:
            deps = {n.id for n in E.names(d.value.expr)} & names
            if deps <= placed:
                done.append(d)
                placed.add(d.name)
                pending.remove(d)
                break
        else:  # pragma: no cover - cycles are rejected by validate
            raise ValueError("cycle in derived values")
    return done
