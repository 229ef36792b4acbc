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
from collections.abc import Iterable

from . import expr as E
from . import vocab
from .errors import Collector, Location, SpecError, did_you_mean
from .model import Binding, Formula, Parameter, Spec, Tensor

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
SET_BOUND = Context("an index set's first or count", CONSTRUCT, "int")
SET_WHERE = Context("an index set's 'where'", CONSTRUCT | {"flag", "index"}, "bool")


class Checker:
    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.errors = Collector()
        self.kinds: dict[str, str] = {}
        self.flags = {f.name: f for f in spec.flags}
        self.params = {p.name: p for p in spec.parameters}

    # ------------------------------------------------------------------ names and symbols
    def check_name(self, name: str, loc: Location, what: str) -> None:
        if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in RESERVED:
            self.errors.error(loc, f"{what} name '{name}' is reserved; choose another name")

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
            if z.name not in vocab.STEP_SIZES:
                self.errors.error(
                    z.loc,
                    f"unknown step size '{z.name}'{did_you_mean(z.name, vocab.STEP_SIZES)}; "
                    f"the runtime computes: {', '.join(vocab.STEP_SIZES)}",
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
            self.errors.error(f.loc, f"'{f.text}' divides by zero")
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
                    f.loc, f"{ctx.what} must be {want}, got {self.describe(got)}: '{f.text}'"
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
        deps = {
            d.name: [n.id for n in E.names(d.value.expr) if self.kinds.get(n.id) == "derived"]
            for d in self.spec.derived
        }
        locs = {d.name: d.loc for d in self.spec.derived}
        reported: set[frozenset[str]] = set()
        for start in deps:
            stack = [(start, [start])]
            while stack:
                node, trail = stack.pop()
                for nxt in deps.get(node, []):
                    if nxt == start:
                        cycle = frozenset(trail)
                        if cycle not in reported:
                            reported.add(cycle)
                            path = " -> ".join([*trail, start])
                            self.errors.error(locs[start], f"derived values form a cycle: {path}")
                    elif nxt not in trail:
                        stack.append((nxt, [*trail, nxt]))

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

    def rule(self, t: Tensor) -> None:
        name = t.fill.target or ""
        rule = vocab.FILL_RULES.get(name)
        if rule is None:
            self.errors.error(
                t.fill.loc,
                f"unknown fill rule '{name}'{did_you_mean(name, vocab.FILL_RULES)}; "
                "docs/spec.md lists the rules",
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
        for need in rule.needs:
            if self.kinds.get(need) not in ("parameter", "derived", "names"):
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
        if t.shape is not None:
            want = tuple(E.parse(s) for s in rule.shape)
            got = tuple(f.expr for f in t.shape)
            if len(want) != len(got) or not all(E.equal(a, b) for a, b in zip(want, got)):
                self.errors.error(
                    t.field_loc("shape"),
                    f"fill rule '{name}' writes shape [{', '.join(rule.shape)}], "
                    f"but '{t.name}' declares [{', '.join(f.text for f in t.shape)}]",
                )

    def capacity_fits(self, t: Tensor) -> None:
        """Error when a step shape can never fit its capacity (proofs that it always fits are
        recorded by ``plan``; anything in between is checked at run time)."""
        assert t.capacity is not None and t.shape is not None
        for i, (cap, step) in enumerate(zip(t.capacity, t.shape)):
            if E.provably_at_least(
                self.lower(step.expr), E.BinOp("+", self.shifted(cap.expr), E.Int(1))
            ):
                self.errors.error(
                    step.loc,
                    f"tensor '{t.name}': step shape dimension {i} '{step.text}' is always "
                    f"larger than its capacity '{cap.text}'",
                )

    def shifted(self, e: E.Expr) -> E.Expr:
        """Rewrite parameters p as (min_p + p'), p' >= 0, and inline derived values."""
        derived = {d.name: d.value.expr for d in self.spec.derived}
        for _ in range(len(derived) + 1):
            e2 = E.substitute(e, derived)
            if e2 == e:
                break
            e = e2
        return E.substitute(
            e,
            {
                p.name: E.BinOp("+", E.Int(p.minimum), E.Name(p.name))
                for p in self.spec.parameters
                if p.minimum
            },
        )

    def lower(self, e: E.Expr) -> E.Expr:
        """`e` with step sizes at zero: the smallest value a step shape can take."""
        return self.shifted(E.substitute(e, {z.name: E.Int(0) for z in self.spec.sizes}))

    def upper(self, e: E.Expr) -> E.Expr | None:
        """`e` with step sizes at their declared bounds (None when a size has no bound)."""
        bounds: dict[str, E.Expr] = {}
        for z in self.spec.sizes:
            if z.bound is not None:
                bounds[z.name] = z.bound.expr
        if any(self.kinds.get(n.id) == "size" and n.id not in bounds for n in E.names(e)):
            return None
        return self.shifted(E.substitute(e, bounds))

    def engine_names(self) -> None:
        from .plan import lower_family  # local import: plan depends on a checked spec

        for fam in self.spec.families:
            plan = lower_family(self.spec, fam)
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
        """True when conditions `a` and `b` (None = always) never hold together: their
        conjunction folds to false for every value of the boolean parameters they read, or
        they compare one parameter with different constants."""
        if a is None or b is None:
            return False
        both = E.BoolOp("and", (a, b))
        bools = sorted(
            {
                n.id
                for n in E.names(both)
                if self.kinds.get(n.id) == "parameter" and self.params[n.id].kind == "bool"
            }
        )
        if len(bools) > 8:
            return False
        for values in itertools.product((False, True), repeat=len(bools)):
            if E.fold(both, dict(zip(bools, values))) != E.FALSE:
                return False
        return True


def _conj(a: E.Expr | None, b: E.Expr | None) -> E.Expr | None:
    if a is None or b is None:
        return a if b is None else b
    return E.BoolOp("and", (a, b))


def _divides_by_zero(e: E.Expr) -> bool:
    """True when a divisor is a constant zero (after folding what is constant)."""
    for node in E.walk(e):
        divisor = (
            node.right
            if isinstance(node, E.BinOp) and node.op in ("//", "%")
            else (node.args[1] if isinstance(node, E.Call) and node.fn == "cdiv" else None)
        )
        if divisor is not None and not list(E.names(divisor)):
            try:
                if E.evaluate(divisor, {}) == 0:
                    return True
            except ZeroDivisionError:
                return True
    return False


def check_spec(spec: Spec) -> None:
    """Raise SpecError with every semantic problem in `spec`."""
    c = Checker(spec)
    c.symbols()
    c.errors.raise_if_any()
    c.declarations()
    c.tensors()
    c.errors.raise_if_any()
    c.engine_names()
    c.errors.raise_if_any()


__all__ = ["Checker", "SpecError", "check_spec"]
