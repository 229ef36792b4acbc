"""Lowering: one family's view of the spec, with every generate-time decision taken.

Flags are folded into every condition: tensors and bindings whose condition folds to false
disappear, true conditions vanish, and what remains is a residual condition over construct-time
parameters, evaluated once in the generated constructor. The family's own checks fold further
(a family that requires `pp_size == 1` has `pp_rank == 0`). The plan also records which
parameters and derived values the family actually uses, which capacities are proven to hold
every step shape (the rest get a run-time guard), and the family's step program: its request
limits, its request checks in order with the values they hand on, one fill per rule tensor with
explicit arguments, the advance form of each (or the rules that rule advance() out), and the
facts the runtime reads (the past-KV-length tensor, whether encoder sizes are computed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..requests.sizes import ENCODER_SIZES
from . import expr as E
from . import prove, vocab
from .errors import Location
from .model import (
    Arrival,
    Check,
    Derived,
    Family,
    Formula,
    Impl,
    Parameter,
    Spec,
    StepSize,
    Tensor,
)

# The Config values the batch builder bounds requests by (bufc.requests.batch.limits), passed
# where the family has them.
SLOTS_LIMIT = "max_batch_size"  # the limit batch.limits requires: every family keeps it
LIMIT_VALUES = (
    SLOTS_LIMIT,
    "max_beam_width",
    "max_draft_tokens",
    "vocab_size",
    "max_prompt_vocab_size",
    "max_input_length",
    "max_encoder_length",
    "max_blocks_per_seq",
    "kv_pool_layers",
    "num_kv_blocks",
    "attention_window_sizes",
)


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
    pad: int | str | None
    bindings: tuple[PlannedBinding, ...]
    checked: bool  # capacity not proven at generate time: guard it every step
    loc: Location
    ring: int | None = None
    capture: E.Expr | None = None  # written by prepare_for_cuda_graph


@dataclasses.dataclass(frozen=True)
class PlannedScalar:
    """A step scalar of the family, computed where `guard` holds (its own condition and that
    of every tensor its max_of reads); `value` may read Config names, step sizes and max_of."""

    name: str
    doc: str
    value: E.Expr
    guard: E.Expr | None
    # its value in the device build: the declared `device` formula, else `value` where it
    # reads no tensor (None: the family has no device build)
    device: E.Expr | None = None


@dataclasses.dataclass(frozen=True)
class PlannedCapture:
    """A tensor's capture value, written by prepare_for_cuda_graph where `guard` holds (the
    tensor exists, and so does every scalar the value reads)."""

    tensor: str
    doc: str
    value: E.Expr
    guard: E.Expr | None


@dataclasses.dataclass(frozen=True)
class PlannedCheck:
    """A request check of the step, run once before any write (where `guard` holds: the
    tensors that rely on it exist)."""

    name: str
    doc: str
    impl: Impl
    reads: tuple[str, ...]
    state: Impl | None
    result: bool
    guard: E.Expr | None
    admit: Arrival | None = None  # its check of a request arriving in flight


@dataclasses.dataclass(frozen=True)
class PlannedFill:
    """One rule tensor's fill and advance calls."""

    tensor: str
    doc: str
    rule: str
    impl: Impl
    check: str | None  # the request check whose result the fill receives
    reads: tuple[str, ...]
    guard: E.Expr | None  # the tensor's residual condition
    advance: Impl | str | None  # "same", an implementation, or None (no advance form)
    advance_reads: tuple[str, ...] = ()
    advance_check: Impl | None = None
    advance_check_reads: tuple[str, ...] = ()
    advance_check_state: str | None = None  # the request check whose state it receives
    advance_check_result: bool = False  # the advance form receives what it returns
    device_advance: Impl | None = None  # the advance form on the device mirror
    device_fill: Impl | None = None  # the device build's form (on the step's device rows)


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """What a family's generated step runs, decided at generate time."""

    limits: tuple[tuple[str, str], ...]  # batch.limits keyword -> Config name
    encoder_only: bool
    encoder_sizes: bool
    checks: tuple[PlannedCheck, ...]
    fills: tuple[PlannedFill, ...]
    no_advance: tuple[str, ...]  # rules without an advance form: advance() names them
    # the host tensor whose generation rows take each sequence's sampled token (its device
    # mirror is where step() gathers tokens that stay on the device)
    sampled_tokens: str | None = None
    scalars: tuple[PlannedScalar, ...] = ()
    captures: tuple[PlannedCapture, ...] = ()

    @property
    def request_readers(self) -> tuple[str, ...]:
        """The names of the functions the step calls on requests (each check, arrival check
        and fill), and ``encoder_sizes`` where the request layer reads encoder lengths: what
        a Request field's declared readers (``bufc.rules.request.read_by``) are matched
        against, so that a family refuses a field none of them reads."""
        names = [c.impl.name for c in self.checks]
        names += [c.admit.impl.name for c in self.checks if c.admit is not None]
        names += [f.impl.name for f in self.fills]
        if self.encoder_only or self.encoder_sizes:
            names.append("encoder_sizes")
        return tuple(sorted(set(names)))


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
    program: StepProgram | None = None


def _conj(a: E.Expr | None, b: E.Expr | None) -> E.Expr | None:
    if a is None:
        return b
    if b is None:
        return a
    return E.BoolOp("and", (a, b))


def _fold(cond: E.Expr | None, flags: Mapping[str, int | str | bool]) -> E.Expr | None:
    """Fold flags (or known values); None means 'always'; E.FALSE means 'never'."""
    if cond is None:
        return None
    folded = E.fold(cond, flags)
    return None if folded == E.TRUE else folded


def lower_family(spec: Spec, family: Family) -> FamilyPlan:
    """`family`'s plan: its tensors and index sets, the names and checks it uses, the facts
    those checks pin down folded in, and its step program."""
    flags = family_flags(spec, family)
    tensors = _planned_tensors(spec, flags) + _additional_outputs(spec, family, flags)
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
    scalars = _scalars(spec, flags, tensors)
    sizes = _step_sizes(spec, tensors, scalars)
    derived_by_name = {d.name: d for d in spec.derived}
    read = _used_names(spec, tensors, sizes, index_sets) | _scalar_names(scalars, tensors)
    read |= _family_check_reads(spec, flags)
    read.add(SLOTS_LIMIT)  # the request table's slots, read by a formula or not
    used = _closure(read, derived_by_name)
    checks = []
    for c in spec.checks:
        if c.when is not None and _fold(c.when.expr, flags) == E.FALSE:
            continue  # not this family's check
        needs = _closure({n.id for n in E.names(c.require.expr)}, derived_by_name)
        params_needed = {n for n in needs if n not in derived_by_name}
        if params_needed <= used:
            checks.append(c)
            used |= needs
    parameters = tuple(p for p in spec.parameters if p.name in used)
    derived = tuple(_topo(d for d in spec.derived if d.name in used))
    # the family's own checks fold its residual conditions further (`pp_size == 1` and
    # `pp_rank < pp_size` make `pp_rank == 0` true)
    tensors = _refold(tensors, check_facts(checks, parameters, flags))
    names = {p.name for p in parameters} | {d.name for d in derived}
    return FamilyPlan(
        family=family,
        flags=tuple(flags.items()),
        parameters=parameters,
        derived=derived,
        checks=tuple(checks),
        sizes=sizes,
        tensors=tuple(tensors),
        index_sets=index_sets,
        dtype_values=tuple(
            (p.name, dtype_values(spec, p)) for p in parameters if p.kind == "dtype"
        ),
        program=_program(spec, flags, tensors, sizes, names, scalars),
    )


def _scalars(
    spec: Spec, flags: dict[str, str | bool], tensors: list[PlannedTensor]
) -> tuple[PlannedScalar, ...]:
    """The spec's step scalars in this family: each where its condition holds and every tensor
    its max_of reads exists (dropped where that is never)."""
    when_of = {pt.name: pt.when for pt in tensors}
    out = []
    for x in spec.scalars:
        value = E.fold(x.value.expr, flags)
        read = [n.tensor for n in E.walk(value) if isinstance(n, E.TensorMax)]
        if any(t not in when_of for t in read):
            continue
        guard: E.Expr | None = x.when.expr if x.when else None
        for t in read:
            guard = _conj(guard, when_of[t])
        guard = _fold(guard, flags)
        if guard != E.FALSE:
            device = E.fold(x.device.expr, flags) if x.device else None if read else value
            out.append(PlannedScalar(x.name, x.doc, value, guard, device))
    return tuple(out)


def _captures(
    spec: Spec, tensors: list[PlannedTensor], scalars: tuple[PlannedScalar, ...]
) -> tuple[PlannedCapture, ...]:
    """Each tensor's capture value, where the tensor and every scalar it reads exist (none
    where it reads a scalar this family does not have)."""
    guard_of = {x.name: x.guard for x in scalars}
    absent = {x.name for x in spec.scalars} - guard_of.keys()
    out = []
    for pt in tensors:
        if pt.capture is None:
            continue
        read = {n.id for n in E.names(pt.capture)}
        if read & absent:
            continue
        guard = pt.when
        for name in sorted(read & guard_of.keys()):
            guard = _conj(guard, guard_of[name])
        out.append(PlannedCapture(pt.name, pt.doc, pt.capture, guard))
    return tuple(out)


def _scalar_names(scalars: tuple[PlannedScalar, ...], tensors: list[PlannedTensor]) -> set[str]:
    """The names the scalars' values and conditions, and the capture values, read."""
    exprs = [e for x in scalars for e in (x.value, x.guard) if e is not None]
    exprs += [pt.capture for pt in tensors if pt.capture is not None]
    return {n.id for e in exprs for n in E.names(e)}


def _planned_tensors(spec: Spec, flags: dict[str, str | bool]) -> list[PlannedTensor]:
    """The spec's tensors in `flags`' family: conditions folded (those that fold to false
    dropped), a mirror with its source's declaration, capacities proven or guarded."""
    prover = prove.prover(spec)
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
                capture=t.capture.expr if t.capture else None,
            )
        )
    return tensors


def _step_sizes(
    spec: Spec, tensors: list[PlannedTensor], scalars: tuple[PlannedScalar, ...] = ()
) -> tuple[StepSize, ...]:
    """The step sizes the family computes: all but the encoder sizes, and those only where a
    tensor's step shape, its rule or the rule's request check, or a scalar reads them."""
    read = {n.id for pt in tensors for e in pt.shape for n in E.names(e)}
    read |= {n.id for x in scalars for n in E.names(x.value)}
    read |= {n.id for pt in tensors if pt.capture is not None for n in E.names(pt.capture)}
    for pt in tensors:
        rule = spec.rule(pt.fill_target or "") if pt.fill_kind == "rule" else None
        if rule is not None:
            read.update(rule.sizes)
            check = spec.request_check(rule.check) if rule.check else None
            read.update(check.sizes if check else ())
    return tuple(z for z in spec.sizes if z.name not in ENCODER_SIZES or z.name in read)


def _used_names(
    spec: Spec,
    tensors: list[PlannedTensor],
    sizes: tuple[StepSize, ...],
    index_sets: tuple[PlannedIndexSet, ...],
) -> set[str]:
    """The construct-time names the family's tensors, step sizes, index sets and rules read
    directly (``_closure`` adds what the derived values among them read)."""
    used: set[str] = set()

    def use(e: E.Expr | None) -> None:
        if e is not None:
            used.update(n.id for n in E.names(e))

    for pt in tensors:
        use(pt.when)
        for e in (*pt.capacity, *pt.shape, pt.constant):
            use(e)
        for pb in pt.bindings:
            use(pb.when)
        if pt.dtype_is_param:
            used.add(pt.dtype)
    for z in sizes:
        use(z.bound.expr if z.bound else None)
    for x in index_sets:
        for e in (x.first, x.count, x.where):
            use(e)
        if x.names:
            used.add(x.names)
    used.discard("index")
    for pt in tensors:  # a rule's request check reads Config values too
        if pt.fill_kind == "rule":
            rule = spec.rule(pt.fill_target or "")
            assert rule is not None  # validated
            used.update(rule.all_reads)
            check = spec.request_check(rule.check) if rule.check else None
            if check is not None:
                used.update(check.reads)
    return used


def _family_check_reads(spec: Spec, flags: dict[str, str | bool]) -> set[str]:
    """The Config values the family's own request checks (requests.checks) read."""
    reads: set[str] = set()
    for name, cond in spec.requests.checks:
        check = spec.request_check(name)
        if check is not None and _holds(cond, flags):
            reads.update(check.reads)
            reads.update(check.admit.reads if check.admit else ())
    return reads


def _closure(names: set[str], derived_by_name: Mapping[str, Derived]) -> set[str]:
    """`names` and every name the derived values among them read, transitively."""
    todo = list(names)
    out = set(names)
    while todo:
        d = derived_by_name.get(todo.pop())
        if d:
            for n in d.names_read():
                if n not in out:
                    out.add(n)
                    todo.append(n)
    return out


def _refold(tensors: list[PlannedTensor], facts: Mapping[str, int]) -> list[PlannedTensor]:
    """`tensors` with their conditions and their bindings' folded with `facts` (those that
    fold to false dropped)."""
    return [
        dataclasses.replace(
            pt,
            when=_fold(pt.when, facts),
            bindings=tuple(
                dataclasses.replace(b, when=_fold(b.when, facts))
                for b in pt.bindings
                if _fold(b.when, facts) != E.FALSE
            ),
        )
        for pt in tensors
        if _fold(pt.when, facts) != E.FALSE
    ]


def check_facts(
    checks: list[Check], parameters: tuple[Parameter, ...], flags: dict[str, str | bool]
) -> dict[str, int]:
    """Parameter values a family's checks pin down: `NAME == N`, or `NAME < N` (`<= N`) where
    N - 1 (N) is the parameter's minimum, repeated until nothing more follows."""
    minimum = {p.name: p.minimum for p in parameters if p.kind == "int"}
    facts: dict[str, int] = {}
    known: dict[str, int | bool | str] = dict(flags)
    changed = True
    while changed:
        changed = False
        for c in checks:
            e = E.fold(c.require.expr, known)
            if not (isinstance(e, E.Compare) and isinstance(e.right, E.Int)):
                continue
            if not isinstance(e.left, E.Name) or e.left.id not in minimum:
                continue
            name, n, low = e.left.id, e.right.value, minimum[e.left.id]
            value = (
                n
                if e.op == "=="
                else low
                if (e.op == "<" and low == n - 1) or (e.op == "<=" and low == n)
                else None
            )
            if value is not None and name not in facts:
                facts[name] = value
                known[name] = value
                changed = True
    return facts


def _program(
    spec: Spec,
    flags: dict[str, str | bool],
    tensors: list[PlannedTensor],
    sizes: tuple[StepSize, ...],
    names: set[str],
    scalars: tuple[PlannedScalar, ...] = (),
) -> StepProgram:
    """The family's step: its request checks (each once, in the order the tensors first need
    them), one fill per rule tensor, and their advance forms."""
    fills: list[PlannedFill] = []
    guards: dict[str, list[E.Expr | None]] = {}
    for pt in tensors:
        if pt.fill_kind != "rule":
            continue
        rule = spec.rule(pt.fill_target or "")
        assert rule is not None  # validated
        check = spec.request_check(rule.check) if rule.check else None
        if check is not None:
            guards.setdefault(check.name, []).append(pt.when)
        advance: Impl | str | None = rule.advance
        fills.append(
            PlannedFill(
                tensor=pt.name,
                doc=pt.doc,
                rule=rule.name,
                impl=rule.impl,
                check=check.name if check is not None and check.result else None,
                reads=rule.reads,
                guard=pt.when,
                advance=advance,
                advance_reads=rule.advance_reads,
                advance_check=rule.advance_check.impl if rule.advance_check else None,
                advance_check_reads=rule.advance_check.reads if rule.advance_check else (),
                advance_check_state=check.name
                if check is not None and check.state is not None and rule.advance_check
                else None,
                advance_check_result=bool(rule.advance_check and rule.advance_check.result),
                device_advance=rule.device_advance,
                device_fill=rule.device_fill,
            )
        )
    for name, cond in spec.requests.checks:  # the family's own checks, beside its rules'
        if _holds(cond, flags):
            guards[name] = [None]
    checks = []
    for name, whens in guards.items():
        c = spec.request_check(name)
        assert c is not None
        guard = None if any(w is None for w in whens) else _disj(whens)
        checks.append(
            PlannedCheck(c.name, c.doc, c.impl, c.reads, c.state, c.result, guard, c.admit)
        )
    sampled = [
        pt.name
        for pt in tensors
        if pt.fill_kind == "rule"
        and getattr(spec.rule(pt.fill_target or ""), "sampled_tokens", False)
    ]
    requests = spec.requests
    return StepProgram(
        limits=tuple((n, n) for n in LIMIT_VALUES if n in names),
        encoder_only=_holds(requests.encoder_only, flags),
        encoder_sizes=any(z.name in ENCODER_SIZES for z in sizes),
        checks=tuple(checks),
        fills=tuple(fills),
        no_advance=tuple(dict.fromkeys(f.rule for f in fills if f.advance is None)),
        sampled_tokens=sampled[0] if sampled else None,
        scalars=scalars,
        captures=_captures(spec, tensors, scalars),
    )


def _holds(cond: Formula | None, flags: dict[str, str | bool]) -> bool:
    """A `requests` condition (over flags alone, validated) holds in this family."""
    return cond is not None and E.fold(cond.expr, flags) == E.TRUE


def _disj(conds: list[E.Expr | None]) -> E.Expr | None:
    kept = list(dict.fromkeys(c for c in conds if c is not None))
    return kept[0] if len(kept) == 1 else E.BoolOp("or", tuple(kept))


def dtype_values(spec: Spec, param: Parameter) -> tuple[str, ...]:
    """The dtypes dtype parameter `param` may take: its declared values; without them, the
    dtypes every fill rule of a tensor declared with it can write (all dtypes if none)."""
    if param.values:
        return tuple(param.values)
    allowed = tuple(vocab.DTYPES)
    for t in spec.tensors:
        if t.dtype == param.name and t.fill.kind == "rule":
            rule = spec.rule(t.fill.target or "")
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
            deps = set(d.names_read()) & names
            if deps <= placed:
                done.append(d)
                placed.add(d.name)
                pending.remove(d)
                break
        else:  # pragma: no cover - cycles are rejected by validate
            raise ValueError("cycle in derived values")
    return done
