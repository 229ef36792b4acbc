"""The declarations of a spec checked one by one: each parameter and flag default, the
formulas of derived values, checks, size bounds and index sets in their binding-time contexts,
cycles of derived values, and each family's flag settings and additional outputs."""

from __future__ import annotations

from . import vocab
from .errors import did_you_mean
from .model import Derived, Parameter
from .plan import SLOTS_LIMIT, dtype_values
from .validate_names import (
    CAPACITY,
    CHECK,
    CHECK_WHEN,
    DERIVED,
    DEVICE_SCALAR,
    KIND_TEXT,
    REQUESTS,
    SCALAR,
    SET_BOUND,
    SET_WHERE,
    SIZE_BOUND,
    WHEN,
    Scope,
)
from .validate_rules import check_impl


def declarations(scope: Scope) -> None:
    """Every declaration but the tensors, in the order the spec lists its sections."""
    s = scope.spec
    for p in s.parameters:
        _parameter(scope, p)
    for f in s.flags:
        if f.default is None:
            continue
        if f.values is None and not isinstance(f.default, bool):
            scope.errors.error(f.loc, f"default of boolean flag '{f.name}' must be true or false")
        elif f.values is not None and f.default not in f.values:
            scope.errors.error(
                f.loc,
                f"default '{f.default}' of flag '{f.name}' is not one of its values"
                f"{did_you_mean(str(f.default), f.values)}",
            )
    for d in s.derived:
        if d.value is not None:
            scope.formula(d.value, DERIVED)
        else:
            _derive(scope, d)
    for c in s.checks:
        scope.formula(c.require, CHECK)
        scope.formula(c.when, CHECK_WHEN)
    for z in s.sizes:
        scope.formula(z.bound, SIZE_BOUND)
    for x in s.scalars:
        scope.formula(x.value, SCALAR)
        scope.formula(x.device, DEVICE_SCALAR)
        scope.formula(x.when, WHEN)
    scope.formula(s.requests.encoder_only, REQUESTS)
    for name, cond in s.requests.checks:
        scope.formula(cond, REQUESTS)
        if s.request_check(name) is None:
            known = [c.name for c in s.request_checks]
            scope.errors.error(
                cond.loc,
                f"requests.checks names '{name}', which is no request check"
                f"{did_you_mean(name, known)}; declare it under request_checks",
            )
    _index_sets(scope)
    _derived_cycles(scope)
    _families(scope)


def _parameter(scope: Scope, p: Parameter) -> None:
    if p.kind not in ("names", "dtype") and p.values:
        scope.errors.error(
            p.loc, f"only names and dtype parameters have 'values'; '{p.name}' is {p.kind}"
        )
    for v in p.values if p.kind == "dtype" else ():
        if v not in vocab.DTYPES:
            scope.errors.error(
                p.loc,
                f"'{v}' in the values of '{p.name}' is not a dtype{did_you_mean(v, vocab.DTYPES)}",
            )
    if p.kind not in ("int", "ints") and p.minimum is not None:
        scope.errors.error(p.loc, f"'{p.name}' is a {p.kind} parameter and cannot have 'min'")
    if p.kind == "dtype":
        if p.default is not None and p.values and p.default not in p.values:
            scope.errors.error(p.loc, f"default {p.default} of '{p.name}' is not one of its values")
        choices = dtype_values(scope.spec, p)
        if not p.values and not choices:
            scope.errors.error(
                p.loc,
                f"dtype parameter '{p.name}' is the dtype of tensors whose fill rules write "
                "no dtype in common",
            )
        elif not p.values and p.default in vocab.DTYPES and p.default not in choices:
            scope.errors.error(
                p.loc,
                f"default {p.default} of '{p.name}' cannot be written by the fill rules of "
                f"the tensors it is the dtype of (they write {', '.join(choices)})",
            )
        if p.default is not None and p.default not in vocab.DTYPES:
            scope.errors.error(
                p.loc,
                f"default of '{p.name}' is not a dtype{did_you_mean(str(p.default), vocab.DTYPES)}",
            )
    elif p.kind == "bool":
        if p.default is not None and not isinstance(p.default, bool):
            scope.errors.error(p.loc, f"default of '{p.name}' must be true or false")
    elif p.kind == "names":
        if not p.values:
            scope.errors.error(
                p.loc, f"names parameter '{p.name}' needs 'values', the names it may hold"
            )
        if p.default is not None:
            if not isinstance(p.default, tuple):
                scope.errors.error(p.loc, f"default of '{p.name}' must be a list of names")
            else:
                for v in map(str, p.default):
                    if v not in p.values:
                        scope.errors.error(
                            p.loc,
                            f"default of '{p.name}' holds '{v}', which is not one of its "
                            f"values{did_you_mean(v, p.values)}",
                        )
    elif p.kind == "ints":
        ints = [v for v in p.default if type(v) is int] if isinstance(p.default, tuple) else None
        if p.default is not None and (ints is None or len(ints) != len(p.default)):  # type: ignore[arg-type]
            scope.errors.error(p.loc, f"default of '{p.name}' must be a list of integers")
        elif ints and p.minimum is not None and min(ints) < p.minimum:
            scope.errors.error(
                p.loc, f"default of '{p.name}' holds a value below its min {p.minimum}"
            )
    elif p.default is not None and type(p.default) is not int:
        scope.errors.error(p.loc, f"default of '{p.name}' must be an integer")
    elif p.default is not None and p.minimum is not None and p.default < p.minimum:
        scope.errors.error(p.loc, f"default {p.default} of '{p.name}' is below its min {p.minimum}")


def _derive(scope: Scope, d: Derived) -> None:
    """A derived value computed by a function: an importable path, and reads that are
    parameters or derived values (the cycle check orders them)."""
    assert d.derive is not None
    check_impl(scope, d.derive)
    for need in d.reads:
        kind = scope.kinds.get(need)
        if kind not in ("parameter", "derived", "names", "list", "dtype"):
            got = f", a {KIND_TEXT[kind]}" if kind in KIND_TEXT else ""
            scope.errors.error(
                d.loc,
                f"derived value '{d.name}' reads '{need}'{got}; its function reads parameters "
                f"and derived values{did_you_mean(need, scope.construct_names())}",
            )


def _index_sets(scope: Scope) -> None:
    for x in scope.spec.index_sets:
        scope.check_name(x.name, x.loc, "index set")
        if x.names is not None:  # the schema allows names, or first and count, not both
            if x.where is not None:
                scope.errors.error(
                    x.loc, f"index set '{x.name}': 'where' filters numbered sets only"
                )
            named = scope.params.get(x.names)
            if named is None or named.kind != "names":
                scope.errors.error(
                    x.loc,
                    f"index set '{x.name}': '{x.names}' is not a names parameter"
                    f"{did_you_mean(x.names, [p.name for p in scope.spec.parameters if p.kind == 'names'])}",
                )
            continue
        scope.formula(x.first, SET_BOUND)
        scope.formula(x.count, SET_BOUND)
        scope.formula(x.where, SET_WHERE)


def _derived_cycles(scope: Scope) -> None:
    """One error per cycle of derived values (a strongly connected group), at its first
    member, naming one loop through it. Linear in the spec (a chain of values that each
    read the one before twice is not a reason to enumerate 2 ** n paths)."""
    deps = {
        d.name: sorted(
            {n for n in d.names_read() if scope.kinds.get(n) in ("derived", "list")},
            key=list(scope.kinds).index,
        )
        for d in scope.spec.derived
    }
    locs = {d.name: d.loc for d in scope.spec.derived}
    for group in _components(deps):
        members = [n for n in deps if n in group]  # declaration order
        start = members[0]
        if len(members) == 1 and start not in deps[start]:
            continue
        # the shortest loop from `start` back to itself, inside the group
        parent: dict[str, str] = {}
        queue, seen, end = [start], {start}, None
        while queue and end is None:
            node = queue.pop(0)
            for nxt in deps[node]:
                if nxt == start:
                    end = node
                    break
                if nxt in group and nxt not in seen:
                    seen.add(nxt)
                    parent[nxt] = node
                    queue.append(nxt)
        trail = [end or start]
        while trail[-1] != start:
            trail.append(parent[trail[-1]])
        path = " -> ".join([*reversed(trail), start])
        scope.errors.error(locs[start], f"derived values form a cycle: {path}")


def _families(scope: Scope) -> None:
    slots = next((p for p in scope.spec.parameters if p.name == SLOTS_LIMIT), None)
    if scope.spec.families and (slots is None or slots.kind != "int"):
        fam = scope.spec.families[0]
        scope.errors.error(
            fam.loc if slots is None else slots.loc,
            f"family '{fam.name}' needs an integer parameter max_batch_size: its requests' seq "
            "slots are 0 .. max_batch_size - 1 (bufc.requests.batch.limits); declare it under "
            "parameters",
        )
    for fam in scope.spec.families:
        scope.check_name(fam.name, fam.loc, "family")
        given = dict(fam.flags)
        flag_locs = dict(fam.flag_locs)
        for name, value in fam.flags:
            flag = scope.flags.get(name)
            loc = flag_locs.get(name, fam.loc)
            if flag is None:
                scope.errors.error(
                    loc,
                    f"family '{fam.name}' sets unknown flag '{name}'{did_you_mean(name, scope.flags)}",
                )
            elif flag.values is None and not isinstance(value, bool):
                scope.errors.error(loc, f"flag '{name}' is a boolean; set it to true or false")
            elif flag.values is not None and value not in flag.values:
                scope.errors.error(
                    loc,
                    f"'{value}' is not a value of flag '{name}'{did_you_mean(str(value), flag.values)}; "
                    f"values: {', '.join(flag.values)}",
                )
        tensor_names = {t.name for t in scope.spec.tensors}
        for o in fam.additional_outputs:
            if o.name in tensor_names:
                scope.errors.error(
                    o.loc,
                    f"additional output '{o.name}' of family '{fam.name}' has the name of a "
                    "tensor; name it after the engine output, differently from every tensor",
                )
            if o.dtype not in vocab.DTYPES and scope.kinds.get(o.dtype) != "dtype":
                scope.errors.error(
                    o.loc,
                    f"additional output '{o.name}': unknown dtype '{o.dtype}'"
                    f"{did_you_mean(o.dtype, vocab.DTYPES)}",
                )
            for f in o.dims:
                scope.formula(f, CAPACITY)
            scope.formula(o.when, WHEN)
        for flag in scope.spec.flags:
            if flag.name not in given and flag.default is None:
                scope.errors.error(
                    fam.loc,
                    f"family '{fam.name}' does not set flag '{flag.name}', which has no default",
                )


def _components(graph: dict[str, list[str]]) -> list[set[str]]:
    """Strongly connected components of `graph` (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                out.append(group)
    return out
