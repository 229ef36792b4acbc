"""The semantic pass: rules JSON Schema cannot express, each with a located message.

Names share one namespace across flags, parameters, derived values and step sizes, and each
kind has a binding time: flags are fixed per family (generate time), parameters and derived
values per Config (construct time), sizes per step. Every formula is checked for unknown
names, for names bound too late for where it is used, and for type (integer vs condition).
"""

from __future__ import annotations

import dataclasses
import itertools
import keyword
import re
from collections.abc import Callable, Iterable, Sequence

from ..rules.sizes import STEP_SIZES
from . import expr as E
from . import prove, vocab
from .errors import Collector, Location, SpecError, did_you_mean
from .model import Binding, Check, Formula, Impl, Parameter, Spec, Tensor
from .plan import FamilyPlan, PlannedTensor, dtype_values, family_flags

RESERVED = {
    "true",
    "false",
    "cdiv",
    "min",
    "max",
    "len",
    "index",
    "self",
    "torch",
    "rt",
    "config",
    "sizes",
}

KIND_TEXT = {
    "flag": "generate-time flag",
    "parameter": "construct-time parameter",
    "dtype": "dtype parameter",
    "names": "list parameter",
    "derived": "derived value",
    "size": "step size",
    "index": "member label of an index set",
}


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a formula is used: which kinds of names it may read and what it must yield."""

    what: str
    kinds: frozenset[str]
    result: str  # "int" or "bool"


CONSTRUCT = frozenset({"parameter", "derived"})
DERIVED = Context("a derived value", CONSTRUCT, "int")
CHECK = Context("a check", CONSTRUCT, "bool")
SIZE_BOUND = Context("a size bound", CONSTRUCT, "int")
WHEN = Context("'when'", CONSTRUCT | {"flag"}, "bool")
CAPACITY = Context("a capacity (fixed at construction)", CONSTRUCT, "int")
SHAPE = Context("a step shape", CONSTRUCT | {"size"}, "int")
CONSTANT = Context("a constant fill (written at construction)", CONSTRUCT, "int")
CHECK_WHEN = Context("a check's 'when'", frozenset({"flag"}), "bool")
REQUESTS = Context("a condition under requests", frozenset({"flag"}), "bool")
SET_BOUND = Context("an index set's first or count", CONSTRUCT, "int")
SET_WHERE = Context("an index set's 'where'", CONSTRUCT | {"flag", "index"}, "bool")


class Checker:
    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.errors = Collector()
        self.kinds: dict[str, str] = {}
        self.flags = {f.name: f for f in spec.flags}
        self.params = {p.name: p for p in spec.parameters}
        self.prover = prove.prover(spec)

    # ------------------------------------------------------------------ names and symbols
    def check_name(self, name: str, loc: Location, what: str) -> None:
        if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in RESERVED:
            self.errors.error(loc, f"{what} name '{name}' is reserved; choose another name")
        elif name in vocab.MODULE_NAMES or name.startswith("SET_"):
            # a declared name binds only as a dataclass field of a generated module (elsewhere
            # it is an attribute or a keyword), where it would shadow a module-level name
            self.errors.error(
                loc,
                f"{what} name '{name}' is reserved: generated modules use it at module level; "
                "choose another name",
            )

    def symbols(self) -> None:
        s = self.spec
        entries: Iterable[tuple[str, str, Location]] = itertools.chain(
            ((f.name, "flag", f.loc) for f in s.flags),
            (
                (p.name, {"dtype": "dtype", "names": "names"}.get(p.kind, "parameter"), p.loc)
                for p in s.parameters
            ),
            ((d.name, "derived", d.loc) for d in s.derived),
            ((z.name, "size", z.loc) for z in s.sizes),
        )
        first: dict[str, Location] = {}
        for name, kind, loc in entries:
            self.check_name(name, loc, KIND_TEXT[kind])
            if name in first:
                self.errors.error(
                    loc,
                    f"name '{name}' is already declared at line {first[name].line}; "
                    "flags, parameters, derived values and sizes share one namespace",
                )
                continue
            first[name] = loc
            self.kinds[name] = kind
        self.kinds["index"] = "index"  # the member label inside an index set's 'where'
        for z in s.sizes:
            if z.name not in STEP_SIZES:
                self.errors.error(
                    z.loc,
                    f"unknown step size '{z.name}'{did_you_mean(z.name, STEP_SIZES)}; "
                    f"the runtime computes: {', '.join(STEP_SIZES)}",
                )

    # ----------------------------------------------------------------------- formulas
    def formula(self, f: Formula | None, ctx: Context) -> None:
        if f is None:
            return
        ok = True
        for n in E.names(f.expr):
            kind = self.kinds.get(n.id)
            if kind is None:
                self.errors.error(
                    f.at(n.col), f"unknown name '{n.id}'{did_you_mean(n.id, self.kinds)}"
                )
                ok = False
            elif kind == "dtype":
                self.errors.error(
                    f.at(n.col), f"'{n.id}' is a dtype parameter; it can only be a tensor's dtype"
                )
                ok = False
            elif kind == "names":
                if not any(
                    isinstance(c, E.Call) and c.fn == "len" and c.args[0] == n
                    for c in E.walk(f.expr)
                ):
                    self.errors.error(
                        f.at(n.col),
                        f"'{n.id}' is a list parameter; formulas can only take its len()",
                    )
                    ok = False
                elif "parameter" not in ctx.kinds:
                    self.errors.error(
                        f.at(n.col), f"'{n.id}' is a list parameter; {ctx.what} cannot use it"
                    )
                    ok = False
            elif kind not in ctx.kinds:
                kinds = sorted(KIND_TEXT[k] + "s" for k in ctx.kinds)
                allowed = (
                    kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]
                )
                self.errors.error(
                    f.at(n.col),
                    f"'{n.id}' is a {KIND_TEXT[kind]}; {ctx.what} may use only {allowed}",
                )
                ok = False
        if ok and _divides_by_zero(f.expr):
            self.errors.error(f.loc, f"'{f.shown}' divides by zero")
            ok = False
        if ok:
            got = self.infer(f, f.expr)
            if got is not None and got != ctx.result:
                want = (
                    "an integer"
                    if ctx.result == "int"
                    else "a condition (a comparison, a flag, and/or/not)"
                )
                self.errors.error(
                    f.loc, f"{ctx.what} must be {want}, got {self.describe(got)}: '{f.shown}'"
                )
            elif got is not None:
                self.divisors(f)

    def divisors(self, f: Formula) -> None:
        """Every divisor of `f` must be provably non-zero over the declared ranges (step sizes
        from 0 to their max): a zero divisor would fail at construction or in a step."""
        for node in E.walk(f.expr):
            divisor = _divisor(node)
            if divisor is None or not list(E.names(divisor)):
                continue  # constant divisors: _divides_by_zero
            status = self.prover.divisor(divisor)
            if status is None:
                continue
            text = E.to_source(divisor)
            col = next(iter(E.names(divisor))).col
            advice = "make it provably non-zero (e.g. max(..., 1)) or raise the parameters' min"
            if status:
                self.errors.error(
                    f.at(col), f"'{f.shown}' divides by zero {status}: '{text}' is 0; {advice}"
                )
            else:
                self.errors.error(
                    f.at(col),
                    f"'{f.shown}' may divide by zero: '{text}' is not provably non-zero for "
                    f"the parameters' declared ranges; {advice}",
                )

    def infer(self, f: Formula, e: E.Expr) -> str | None:
        """'int', 'bool', 'str' or 'enum:<flag>'; None after reporting an error."""
        col = next((n.col for n in E.names(e)), 0)
        if isinstance(e, E.Int):
            return "int"
        if isinstance(e, E.Bool):
            return "bool"
        if isinstance(e, E.Str):
            return "str"
        if isinstance(e, E.Name):
            if self.kinds[e.id] == "flag":
                return "bool" if self.flags[e.id].values is None else f"enum:{e.id}"
            if self.kinds[e.id] == "parameter" and self.params[e.id].kind == "bool":
                return "bool"
            return "int"
        if isinstance(e, E.Call) and e.fn == "len":
            arg = e.args[0]
            if not (isinstance(arg, E.Name) and self.kinds.get(arg.id) == "names"):
                self.errors.error(f.at(col), "len() takes the name of a list parameter")
                return None
            return "int"
        if isinstance(e, (E.Neg, E.BinOp, E.Call)):
            parts = (
                [e.operand]
                if isinstance(e, E.Neg)
                else ([e.left, e.right] if isinstance(e, E.BinOp) else list(e.args))
            )
            for part in parts:
                t = self.infer(f, part)
                if t is None:
                    return None
                if t != "int":
                    pcol = next((n.col for n in E.names(part)), col)
                    self.errors.error(
                        f.at(pcol), f"arithmetic needs integers, got {self.describe(t)}"
                    )
                    return None
            return "int"
        if isinstance(e, E.Compare):
            lt, rt = self.infer(f, e.left), self.infer(f, e.right)
            if lt is None or rt is None:
                return None
            if lt.startswith("enum:") or rt.startswith("enum:"):
                flag_t, other, other_t = (
                    (lt, e.right, rt) if lt.startswith("enum:") else (rt, e.left, lt)
                )
                flag = self.flags[flag_t[5:]]
                if e.op not in ("==", "!="):
                    self.errors.error(
                        f.at(col), f"flag '{flag.name}' can only be compared with == or !="
                    )
                    return None
                if other_t == "str" and isinstance(other, E.Str):
                    values = flag.values or ()
                    if other.value not in values:
                        self.errors.error(
                            f.at(col),
                            f"'{other.value}' is not a value of flag '{flag.name}'"
                            f"{did_you_mean(other.value, values)}; values: {', '.join(values)}",
                        )
                        return None
                    return "bool"
                if other_t != flag_t:
                    self.errors.error(
                        f.at(col), f"flag '{flag.name}' must be compared with a quoted value"
                    )
                    return None
                return "bool"
            if {lt, rt} == {"bool", "str"}:
                name = next(
                    (x.id for x in (e.left, e.right) if isinstance(x, E.Name)), "the condition"
                )
                self.errors.error(
                    f.at(col),
                    f"'{name}' is a boolean, not a string: write '{name}' or 'not {name}' "
                    "instead of comparing it with a quoted value",
                )
                return None
            if lt != "int" or rt != "int":
                self.errors.error(
                    f.at(col),
                    f"'{e.op}' compares integers, got {self.describe(lt if lt != 'int' else rt)}",
                )
                return None
            return "bool"
        if isinstance(e, (E.Not, E.BoolOp)):
            parts = [e.operand] if isinstance(e, E.Not) else list(e.operands)
            for part in parts:
                t = self.infer(f, part)
                if t is None:
                    return None
                if t != "bool":
                    pcol = next((n.col for n in E.names(part)), col)
                    op = "not" if isinstance(e, E.Not) else e.op
                    self.errors.error(
                        f.at(pcol), f"'{op}' needs conditions, got {self.describe(t)}"
                    )
                    return None
            return "bool"
        return None  # pragma: no cover

    @staticmethod
    def describe(t: str) -> str:
        if t.startswith("enum:"):
            return f"the enum flag '{t[5:]}' (compare it with a quoted value)"
        return {"int": "an integer", "bool": "a condition", "str": "a string"}[t]

    # --------------------------------------------------------------------- declarations
    def declarations(self) -> None:
        s = self.spec
        for p in s.parameters:
            self.parameter(p)
        for f in s.flags:
            if f.default is None:
                continue
            if f.values is None and not isinstance(f.default, bool):
                self.errors.error(
                    f.loc, f"default of boolean flag '{f.name}' must be true or false"
                )
            elif f.values is not None and f.default not in f.values:
                self.errors.error(
                    f.loc,
                    f"default '{f.default}' of flag '{f.name}' is not one of its values"
                    f"{did_you_mean(str(f.default), f.values)}",
                )
        for d in s.derived:
            self.formula(d.value, DERIVED)
        for c in s.checks:
            self.formula(c.require, CHECK)
            self.formula(c.when, CHECK_WHEN)
        for z in s.sizes:
            self.formula(z.bound, SIZE_BOUND)
        self.formula(s.requests.encoder_only, REQUESTS)
        self.formula(s.requests.fixed_drafts, REQUESTS)
        self.index_sets()
        self.derived_cycles()
        self.families()

    def parameter(self, p: Parameter) -> None:
        if p.kind not in ("names", "dtype") and p.values:
            self.errors.error(
                p.loc, f"only names and dtype parameters have 'values'; '{p.name}' is {p.kind}"
            )
        for v in p.values if p.kind == "dtype" else ():
            if v not in vocab.DTYPES:
                self.errors.error(
                    p.loc,
                    f"'{v}' in the values of '{p.name}' is not a dtype{did_you_mean(v, vocab.DTYPES)}",
                )
        if p.kind != "int" and p.minimum is not None:
            self.errors.error(p.loc, f"'{p.name}' is a {p.kind} parameter and cannot have 'min'")
        if p.kind == "dtype":
            if p.default is not None and p.values and p.default not in p.values:
                self.errors.error(
                    p.loc, f"default {p.default} of '{p.name}' is not one of its values"
                )
            choices = dtype_values(self.spec, p)
            if not p.values and not choices:
                self.errors.error(
                    p.loc,
                    f"dtype parameter '{p.name}' is the dtype of tensors whose fill rules write "
                    "no dtype in common",
                )
            elif not p.values and p.default in vocab.DTYPES and p.default not in choices:
                self.errors.error(
                    p.loc,
                    f"default {p.default} of '{p.name}' cannot be written by the fill rules of "
                    f"the tensors it is the dtype of (they write {', '.join(choices)})",
                )
            if p.default is not None and p.default not in vocab.DTYPES:
                self.errors.error(
                    p.loc,
                    f"default of '{p.name}' is not a dtype{did_you_mean(str(p.default), vocab.DTYPES)}",
                )
        elif p.kind == "bool":
            if p.default is not None and not isinstance(p.default, bool):
                self.errors.error(p.loc, f"default of '{p.name}' must be true or false")
        elif p.kind == "names":
            if not p.values:
                self.errors.error(
                    p.loc, f"names parameter '{p.name}' needs 'values', the names it may hold"
                )
            if p.default is not None:
                if not isinstance(p.default, tuple):
                    self.errors.error(p.loc, f"default of '{p.name}' must be a list of names")
                else:
                    for v in p.default:
                        if v not in p.values:
                            self.errors.error(
                                p.loc,
                                f"default of '{p.name}' holds '{v}', which is not one of its "
                                f"values{did_you_mean(v, p.values)}",
                            )
        elif p.default is not None and type(p.default) is not int:
            self.errors.error(p.loc, f"default of '{p.name}' must be an integer")
        elif p.default is not None and p.minimum is not None and p.default < p.minimum:
            self.errors.error(
                p.loc, f"default {p.default} of '{p.name}' is below its min {p.minimum}"
            )

    def index_sets(self) -> None:
        for x in self.spec.index_sets:
            self.check_name(x.name, x.loc, "index set")
            if x.names is not None:  # the schema allows names, or first and count, not both
                if x.where is not None:
                    self.errors.error(
                        x.loc, f"index set '{x.name}': 'where' filters numbered sets only"
                    )
                if self.kinds.get(x.names) != "names":
                    self.errors.error(
                        x.loc,
                        f"index set '{x.name}': '{x.names}' is not a names parameter"
                        f"{did_you_mean(x.names, [p.name for p in self.spec.parameters if p.kind == 'names'])}",
                    )
                continue
            self.formula(x.first, SET_BOUND)
            self.formula(x.count, SET_BOUND)
            self.formula(x.where, SET_WHERE)

    def derived_cycles(self) -> None:
        """One error per cycle of derived values (a strongly connected group), at its first
        member, naming one loop through it. Linear in the spec (a chain of values that each
        read the one before twice is not a reason to enumerate 2 ** n paths)."""
        deps = {
            d.name: sorted(
                {n.id for n in E.names(d.value.expr) if self.kinds.get(n.id) == "derived"},
                key=list(self.kinds).index,
            )
            for d in self.spec.derived
        }
        locs = {d.name: d.loc for d in self.spec.derived}
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
            self.errors.error(locs[start], f"derived values form a cycle: {path}")

    def families(self) -> None:
        for fam in self.spec.families:
            self.check_name(fam.name, fam.loc, "family")
            given = dict(fam.flags)
            flag_locs = dict(fam.flag_locs)
            for name, value in fam.flags:
                flag = self.flags.get(name)
                loc = flag_locs.get(name, fam.loc)
                if flag is None:
                    self.errors.error(
                        loc,
                        f"family '{fam.name}' sets unknown flag '{name}'{did_you_mean(name, self.flags)}",
                    )
                elif flag.values is None and not isinstance(value, bool):
                    self.errors.error(loc, f"flag '{name}' is a boolean; set it to true or false")
                elif flag.values is not None and value not in flag.values:
                    self.errors.error(
                        loc,
                        f"'{value}' is not a value of flag '{name}'{did_you_mean(str(value), flag.values)}; "
                        f"values: {', '.join(flag.values)}",
                    )
            tensor_names = {t.name for t in self.spec.tensors}
            for o in fam.additional_outputs:
                if o.name in tensor_names:
                    self.errors.error(
                        o.loc,
                        f"additional output '{o.name}' of family '{fam.name}' has the name of a "
                        "tensor; name it after the engine output, differently from every tensor",
                    )
                if o.dtype not in vocab.DTYPES and self.kinds.get(o.dtype) != "dtype":
                    self.errors.error(
                        o.loc,
                        f"additional output '{o.name}': unknown dtype '{o.dtype}'"
                        f"{did_you_mean(o.dtype, vocab.DTYPES)}",
                    )
                for f in o.dims:
                    self.formula(f, CAPACITY)
                self.formula(o.when, WHEN)
            for flag in self.spec.flags:
                if flag.name not in given and flag.default is None:
                    self.errors.error(
                        fam.loc,
                        f"family '{fam.name}' does not set flag '{flag.name}', which has no default",
                    )

    # ---------------------------------------------------------------------------- tensors
    def tensors(self) -> None:
        by_name: dict[str, Tensor] = {}
        for t in self.spec.tensors:
            self.check_name(t.name, t.loc, "tensor")
            if t.name in by_name:
                self.errors.error(
                    t.loc,
                    f"tensor '{t.name}' is already declared at line {by_name[t.name].loc.line}",
                )
                continue
            by_name[t.name] = t
        for t in self.spec.tensors:
            self.tensor(t, by_name)

    def tensor(self, t: Tensor, by_name: dict[str, Tensor]) -> None:
        self.formula(t.when, WHEN)
        for b in t.bind:
            self.formula(b.when, WHEN)
            self.binding(t, b, by_name)
        if t.fill.kind == "mirror":
            self.mirror(t, by_name)
            return
        if t.ring is not None:
            self.ring(t)
        for key in ("dtype", "capacity", "shape"):
            if getattr(t, key) is None:
                self.errors.error(t.loc, f"tensor '{t.name}' needs '{key}'")
        if (
            t.dtype is not None
            and t.dtype not in vocab.DTYPES
            and self.kinds.get(t.dtype) != "dtype"
        ):
            options = [*vocab.DTYPES, *(p.name for p in self.spec.parameters if p.kind == "dtype")]
            self.errors.error(
                t.field_loc("dtype"),
                f"unknown dtype '{t.dtype}'{did_you_mean(t.dtype, options)}; "
                f"use one of {', '.join(vocab.DTYPES)} or a dtype parameter",
            )
        for f in t.capacity or ():
            self.formula(f, CAPACITY)
        for f in t.shape or ():
            self.formula(f, SHAPE)
        if t.capacity is not None and t.shape is not None:
            if len(t.capacity) != len(t.shape):
                self.errors.error(
                    t.field_loc("shape"),
                    f"tensor '{t.name}': shape has {len(t.shape)} dimensions "
                    f"but capacity has {len(t.capacity)}",
                )
            elif not self.errors:
                self.capacity_fits(t)
        if t.pad is not None and t.dtype == "bool" and t.pad not in (0, 1):
            self.errors.error(t.field_loc("pad"), f"pad of bool tensor '{t.name}' must be 0 or 1")
        elif t.pad is not None:
            for dtype in self.dtype_choices(t.dtype):
                lo, hi = vocab.DTYPE_RANGES[dtype]
                if not lo <= t.pad <= hi:
                    via = (
                        f" (dtype parameter '{t.dtype}' may be {dtype})" if t.dtype != dtype else ""
                    )
                    self.errors.error(
                        t.field_loc("pad"),
                        f"pad {t.pad} of tensor '{t.name}' is outside the range of {dtype}, "
                        f"{lo} to {hi}{via}",
                    )
                    break
        if t.fill.kind == "rule":
            self.rule(t)
        elif t.fill.kind == "constant":
            self.formula(t.fill.value, CONSTANT)

    def binding(self, t: Tensor, b: Binding, by_name: dict[str, Tensor]) -> None:
        sets = {x.name for x in self.spec.index_sets}
        placeholders = re.findall(r"\{([a-z][a-z0-9_]*)\}", b.engine_name)
        for name in b.each:
            if name not in sets:
                self.errors.error(
                    b.loc,
                    f"unknown index set '{name}'{did_you_mean(name, sets)}; declare it under index_sets",
                )
        if sorted(placeholders) != sorted(b.each):
            self.errors.error(
                b.loc,
                f"engine name '{b.engine_name}' must hold each index set of 'each' exactly once as "
                f"{{SET}}; it holds {', '.join(placeholders) or 'none'}, 'each' lists "
                f"{', '.join(b.each) or 'none'}",
            )
        src = by_name.get(t.fill.target or "") if t.fill.kind == "mirror" else t
        dims = len(src.shape) if src is not None and src.shape is not None else None
        if dims is not None and len(b.each) >= dims:
            self.errors.error(
                b.loc,
                f"'{t.name}' has {dims} dimensions; 'each' can index at most {dims - 1} leading ones",
            )

    def ring(self, t: Tensor) -> None:
        assert t.ring is not None
        if t.capacity is None or t.shape is None:
            return
        first = t.capacity[0].expr
        if not (isinstance(first, E.Int) and first.value == t.ring):
            self.errors.error(
                t.field_loc("ring"),
                f"ring tensor '{t.name}': its first capacity dimension must be the ring size {t.ring}",
            )
        if len(t.capacity) == len(t.shape) and not all(
            E.equal(a.expr, b.expr) for a, b in zip(t.capacity, t.shape)
        ):
            self.errors.error(
                t.field_loc("ring"),
                f"ring tensor '{t.name}': its shape must equal its capacity (each step binds one slot)",
            )

    def mirror(self, t: Tensor, by_name: dict[str, Tensor]) -> None:
        for key in ("dtype", "capacity", "shape", "pad"):
            if getattr(t, key) is not None:
                self.errors.error(
                    t.field_loc(key),
                    f"mirror '{t.name}' inherits '{key}' from its source; remove it",
                )
        src = by_name.get(t.fill.target or "")
        if src is None:
            self.errors.error(
                t.fill.loc,
                f"mirror source '{t.fill.target}' is not a tensor"
                f"{did_you_mean(t.fill.target or '', by_name)}",
            )
            return
        if src.memory != "pinned":
            self.errors.error(
                t.fill.loc,
                f"mirror source '{src.name}' must be pinned host memory, not {src.memory} "
                "(it is staged in the pinned arena that is copied to the device each step)",
            )
        if t.memory != "device":
            self.errors.error(
                t.field_loc("memory"),
                f"mirror '{t.name}' is a host-to-device copy; its memory must be device",
            )

    # ------------------------------------------------------- rules and request checks
    def contracts(self) -> None:
        """The rules and request checks: unique names (a project's own may not reuse a
        built-in one), importable paths, checks that exist, step sizes the runtime computes."""
        s = self.spec
        seen: dict[str, Location] = {}
        for c in s.request_checks:
            self.check_name(c.name, c.loc, "request check")  # a field of the generated Checked
            self.contract_name(c.name, c.loc, "request check", seen)
            self.impl(c.impl)
            if c.state is not None:
                self.impl(c.state)
            self.step_sizes(c.sizes, c.loc, f"request check '{c.name}'")
        seen = {}
        checks = {c.name for c in s.request_checks}
        for r in s.rules:
            self.contract_name(r.name, r.loc, "rule", seen)
            for impl in (
                r.impl,
                r.advance,
                r.advance_check.impl if r.advance_check else None,
                r.device_advance,
            ):
                if isinstance(impl, Impl):
                    self.impl(impl)
            if r.check is not None and r.check not in checks:
                self.errors.error(
                    r.field_loc("check"),
                    f"rule '{r.name}' names the request check '{r.check}', which is not "
                    f"declared{did_you_mean(r.check, checks)}; declare it under request_checks",
                )
            self.step_sizes(r.sizes, r.field_loc("sizes"), f"rule '{r.name}'")
            if r.advance is None and (r.advance_reads or r.advance_check or r.device_advance):
                key = (
                    "advance_reads"
                    if r.advance_reads
                    else "advance_check"
                    if r.advance_check
                    else "device_advance"
                )
                self.errors.error(
                    r.field_loc(key),
                    f"rule '{r.name}' has no advance form; add 'advance' or drop this key",
                )

    def contract_name(self, name: str, loc: Location, what: str, seen: dict[str, Location]) -> None:
        """A spec's own names are keys of one mapping (the loader refuses a repeated key), so
        a name seen before is a built-in one."""
        if name in seen:
            first = seen[name]
            self.errors.error(
                loc,
                f"{what} '{name}' is already declared (a built-in {what} at "
                f"{first.file}:{first.line}); choose another name",
            )
            return
        seen[name] = loc

    def impl(self, impl: Impl) -> None:
        """An import path whose parts are identifiers Python can import (the schema checked
        their characters; keywords are refused here)."""
        parts = [*impl.module.split("."), impl.name]
        bad = [p for p in parts if keyword.iskeyword(p) or keyword.issoftkeyword(p)]
        if bad:
            self.errors.error(
                impl.loc,
                f"'{impl.text}' cannot be imported: '{bad[0]}' is a Python keyword; rename the "
                "module or function",
            )

    def step_sizes(self, names: Sequence[str], loc: Location, what: str) -> None:
        for z in names:
            if z not in STEP_SIZES:
                self.errors.error(
                    loc,
                    f"{what} reads the step size '{z}', which the runtime does not compute"
                    f"{did_you_mean(z, STEP_SIZES)}",
                )

    def rule(self, t: Tensor) -> None:
        name = t.fill.target or ""
        rule = self.spec.rule(name)
        if rule is None:
            names = [r.name for r in self.spec.rules]
            self.errors.error(
                t.fill.loc,
                f"unknown fill rule '{name}'{did_you_mean(name, names)}; docs/spec.md lists "
                "the built-in rules, and a project declares its own under rules",
            )
            return
        if t.memory == "device" and not rule.device:
            self.errors.error(
                t.field_loc("memory"),
                f"fill rule '{name}' runs on the host: make '{t.name}' pinned and add a "
                "device tensor with fill: {mirror: " + t.name + "}",
            )
        if t.memory != "device" and rule.device:
            self.errors.error(
                t.field_loc("memory"),
                f"fill rule '{name}' copies request tensors on the device; '{t.name}' must be "
                "device memory",
            )
        check = self.spec.request_check(rule.check) if rule.check else None
        for need in (*rule.all_reads, *(check.reads if check else ())):
            if self.kinds.get(need) not in ("parameter", "derived", "names", "dtype"):
                self.errors.error(
                    t.fill.loc,
                    f"fill rule '{name}' reads '{need}' from the Config; declare it as a "
                    "parameter or derived value",
                )
        if t.dtype in vocab.DTYPES and t.dtype not in rule.dtypes:
            self.errors.error(
                t.field_loc("dtype"),
                f"fill rule '{name}' writes {' or '.join(rule.dtypes)}, not {t.dtype}",
            )
        param = self.params.get(t.dtype or "")
        if param is not None and param.kind == "dtype":
            cannot = [v for v in param.values if v not in rule.dtypes]
            if cannot:
                self.errors.error(
                    t.field_loc("dtype"),
                    f"fill rule '{name}' writes {' or '.join(rule.dtypes)}, but dtype parameter "
                    f"'{param.name}' of '{t.name}' may be {', '.join(cannot)}; limit its 'values'",
                )
        if t.shape is not None:
            want = tuple(f.expr for f in rule.shape)
            got = tuple(f.expr for f in t.shape)
            if len(want) != len(got) or not all(E.equal(a, b) for a, b in zip(want, got)):
                self.errors.error(
                    t.field_loc("shape"),
                    f"fill rule '{name}' writes shape [{', '.join(f.shown for f in rule.shape)}], "
                    f"but '{t.name}' declares [{', '.join(f.shown for f in t.shape)}]",
                )

    def capacity_fits(self, t: Tensor) -> None:
        """Error when a step shape can never fit its capacity (proofs that it always fits are
        recorded by ``plan``; anything in between is checked at run time)."""
        assert t.capacity is not None and t.shape is not None
        for i, (cap, step) in enumerate(zip(t.capacity, t.shape)):
            if self.prover.at_least(step.expr, cap.expr, prove.ZERO, prove.VAR, plus=1):
                self.errors.error(
                    step.loc,
                    f"tensor '{t.name}': step shape dimension {i} '{step.shown}' is always "
                    f"larger than its capacity '{cap.shown}'",
                )

    def engine_names(self, plans: list[FamilyPlan]) -> None:
        for plan in plans:
            fam = plan.family
            seen: dict[tuple[str, str], list[tuple[str, E.Expr | None]]] = {}
            for pt in plan.tensors:
                for b in pt.bindings:
                    key = (b.direction, b.engine_name)
                    cond = _conj(pt.when, b.when)
                    clash = next(
                        (n for n, c in seen.get(key, []) if not self.exclusive(c, cond)), None
                    )
                    seen.setdefault(key, []).append((pt.name, cond))
                    if clash is not None:
                        other = self.spec.tensor(clash)
                        self.errors.error(
                            b.loc,
                            f"engine {b.direction} '{b.engine_name}' is bound by both "
                            f"'{other.name}' (line {other.loc.line}) and '{pt.name}' in family "
                            f"'{fam.name}'; make their 'when' conditions exclusive",
                        )

    def exclusive(self, a: E.Expr | None, b: E.Expr | None) -> bool:
        """True when conditions `a` and `b` (None = always) never hold together: for every
        value of the boolean parameters they read, their conjunction folds to false or
        compares the parameters in ways no value satisfies (``prove.can_hold``)."""
        if a is None or b is None:
            return False
        return not self.prover.can_hold(E.BoolOp("and", (a, b)))

    # ------------------------------------------------------- values over the declared ranges
    def ranges(self, plans: list[FamilyPlan]) -> None:
        """Capacities that are negative, and constant fills outside their dtype, at a point of
        the declared ranges where the family's checks and the tensor's condition hold."""
        where: dict[str, list[tuple[FamilyPlan, PlannedTensor]]] = {}
        for plan in plans:
            for pt in plan.tensors:
                where.setdefault(pt.name, []).append((plan, pt))
        dims: dict[str, tuple[Formula, ...]] = {}
        for t in self.spec.tensors:
            if t.fill.kind != "mirror" and t.capacity is not None:
                dims[t.name] = t.capacity
        for fam in self.spec.families:
            for o in fam.additional_outputs:
                dims.setdefault(o.name, (Formula("", E.Int(1), o.loc), *o.dims))
        reported: set[Location] = set()
        for name, present in where.items():
            if name not in dims:
                continue
            for i, f in enumerate(dims[name]):
                if f.loc in reported or self.prover.range_of(f.expr)[0] >= 0:
                    continue
                found = self._witness(f.expr, lambda v: v < 0, present)
                if found is not None:
                    reported.add(f.loc)
                    point, value = found
                    self.errors.error(
                        f.loc,
                        f"tensor '{name}': capacity dimension {i} '{f.shown}' is negative "
                        f"({value}) {self.prover.where(f.expr, point)}",
                    )
        for t in self.spec.tensors:
            if t.fill.kind == "constant" and t.fill.value is not None and t.name in where:
                self.constant_range(t, t.fill.value, where[t.name])
        for z in self.spec.sizes:
            used = [(plan, None) for plan in plans if z in plan.sizes]
            if z.bound is None or not used or self.prover.range_of(z.bound.expr)[0] >= 0:
                continue
            found = self._witness(z.bound.expr, lambda v: v < 0, used)
            if found is not None:
                point, value = found
                self.errors.error(
                    z.bound.loc,
                    f"the max of step size '{z.name}', '{z.bound.shown}', is negative ({value}) "
                    f"{self.prover.where(z.bound.expr, point)}: no step could be prepared",
                )

    def _witness(
        self,
        e: E.Expr,
        bad: Callable[[int], bool],
        present: Sequence[tuple[FamilyPlan, PlannedTensor | None]],
    ) -> tuple[prove.Point, int] | None:
        """A point where `bad(e)`, in a family where its checks (and the tensor's condition,
        when there is a tensor) hold."""

        def valid(env: prove.Env) -> bool:
            return any(
                all(self.prover.holds(c.require.expr, env) for c in plan.checks)
                and (pt is None or pt.when is None or self.prover.holds(pt.when, env))
                for plan, pt in present
            )

        return self.prover.find(e, bad, valid)

    def constant_range(
        self, t: Tensor, f: Formula, present: Sequence[tuple[FamilyPlan, PlannedTensor]]
    ) -> None:
        lo, hi = self.prover.range_of(f.expr)
        for dtype in self.dtype_choices(t.dtype):
            dlo, dhi = vocab.DTYPE_RANGES[dtype]
            span = f"{dtype} holds {dlo} to {dhi}" if dtype != "bool" else "bool holds 0 or 1"
            if hi < dlo or lo > dhi:
                self.errors.error(
                    f.loc,
                    f"tensor '{t.name}': constant fill '{f.shown}' is always outside its dtype "
                    f"({span})",
                )
                return
            if dlo <= lo and hi <= dhi:
                continue
            found = self._witness(f.expr, _outside(dlo, dhi), present)
            if found is not None:
                point, value = found
                self.errors.error(
                    f.loc,
                    f"tensor '{t.name}': constant fill '{f.shown}' is {value} "
                    f"{self.prover.where(f.expr, point)}, outside its dtype ({span})",
                )
                return

    def dtype_choices(self, dtype: str | None) -> tuple[str, ...]:
        """The dtypes a tensor declared with `dtype` can have (a dtype parameter: its values)."""
        if dtype in vocab.DTYPES:
            return (dtype,)
        p = self.params.get(dtype or "")
        return dtype_values(self.spec, p) if p is not None and p.kind == "dtype" else ()

    # ------------------------------------------------------ conditions that can never hold
    def conditions(self, plans: list[FamilyPlan]) -> None:
        """Tensors and bindings whose 'when' holds in no family (a contradiction, or flags no
        family sets), checks that can never hold (alone or with the checks before them), and
        check conditions ('when') true in no family."""
        present: dict[str, list[PlannedTensor]] = {}
        for plan in plans:
            for pt in plan.tensors:
                if self.prover.can_hold(pt.when):
                    present.setdefault(pt.name, []).append(pt)
        by_name = {t.name: t for t in self.spec.tensors}
        for t in self.spec.tensors:
            src = by_name.get(t.fill.target or "") if t.fill.kind == "mirror" else None
            if t.name not in present:
                if t.when is not None and (src is None or src.name in present):
                    self.errors.error(
                        t.when.loc,
                        f"tensor '{t.name}' exists in no family: its 'when' '{t.when.shown}' "
                        "never holds (a contradiction, or flag values no family sets)",
                    )
                continue
            for b in t.bind:
                if b.when is None:
                    continue
                if not any(
                    self.prover.can_hold(_conj(pt.when, pb.when))
                    for pt in present[t.name]
                    for pb in pt.bindings
                    if pb.loc == b.loc
                ):
                    self.errors.error(
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
                if c.loc not in reported and not self.prover.can_hold(c.require.expr):
                    reported.add(c.loc)
                    self.errors.error(
                        c.require.loc,
                        f"check '{c.require.shown}' can never hold for the parameters' declared "
                        "ranges: every Config would fail it",
                    )
                elif c.loc not in reported and not self.prover.can_hold(_all([*before, c])):
                    # the earlier checks it cannot hold with: those without which it could
                    needed = [
                        b
                        for b in before
                        if self.prover.can_hold(_all([x for x in before if x is not b] + [c]))
                    ]
                    lines = ", ".join(str(b.loc.line) for b in needed or before)
                    reported.add(c.loc)
                    self.errors.error(
                        c.require.loc,
                        f"check '{c.require.shown}' contradicts the check(s) at line(s) {lines} "
                        f"in family '{plan.family.name}': every Config would fail one of them",
                    )
                before.append(c)
        for c in self.spec.checks:
            if c.when is not None and c.loc not in applied:
                flags = [family_flags(self.spec, f) for f in self.spec.families]
                if all(E.fold(c.when.expr, fl) == E.FALSE for fl in flags):
                    self.errors.error(
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


def _divisor(node: E.Expr) -> E.Expr | None:
    if isinstance(node, E.BinOp) and node.op in ("//", "%"):
        return node.right
    if isinstance(node, E.Call) and node.fn == "cdiv":
        return node.args[1]
    return None


def _divides_by_zero(e: E.Expr) -> bool:
    """True when a divisor is a constant zero (after folding what is constant)."""
    for node in E.walk(e):
        divisor = _divisor(node)
        if divisor is not None and not list(E.names(divisor)):
            try:
                if E.evaluate(divisor, {}) == 0:
                    return True
            except ZeroDivisionError:
                return True
    return False


def check_spec(spec: Spec) -> None:
    """Raise SpecError with every semantic problem of `spec` itself (before lowering)."""
    c = Checker(spec)
    c.symbols()
    c.contracts()
    c.errors.raise_if_any()
    c.declarations()
    c.tensors()
    c.errors.raise_if_any()


def check_plans(spec: Spec, plans: Sequence[FamilyPlan]) -> None:
    """Raise SpecError with every problem only the lowered families show (engine-name owners,
    value ranges, conditions that never hold)."""
    c = Checker(spec)
    c.engine_names(list(plans))
    c.ranges(list(plans))
    c.conditions(list(plans))
    c.errors.raise_if_any()


__all__ = ["Checker", "SpecError", "check_plans", "check_spec"]
