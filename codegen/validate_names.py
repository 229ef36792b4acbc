"""The namespace and binding-time pass every other check of the semantic pass builds on.

Names share one namespace across flags, parameters, derived values and step sizes, and each
kind has a binding time: flags are fixed per family (generate time), parameters and derived
values per Config (construct time), sizes per step. Every formula is checked for unknown
names, for names bound too late for where it is used (its ``Context``), for type (integer vs
condition) and for divisors that can be zero.
"""

from __future__ import annotations

import dataclasses
import itertools
import keyword
from collections.abc import Iterable

from ..requests.sizes import STEP_SIZES
from . import expr as E
from . import prove, vocab
from .errors import Collector, Location, did_you_mean
from .model import Formula, Spec
from .plan import dtype_values

RESERVED = frozenset(
    {
        "true",
        "false",
        "cdiv",
        "min",
        "max",
        "len",
        "max_of",
        "max_sequence_length",  # prepare_for_cuda_graph's argument, read by capture values
        "index",
        "self",
        "torch",
        "rt",
        "config",
        "sizes",
        "rows",  # kept free for the step's rows record in the generated checks
    }
)

KIND_TEXT = {
    "flag": "generate-time flag",
    "parameter": "construct-time parameter",
    "dtype": "dtype parameter",
    "names": "list parameter",
    "list": "derived list",
    "derived": "derived value",
    "size": "step size",
    "index": "member label of an index set",
    "scalar": "step scalar",
    "argument": "prepare_for_cuda_graph argument",
}


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a formula is used: which kinds of names it may read and what it must yield."""

    what: str
    kinds: frozenset[str]
    result: str  # "int" or "bool"
    tensors: bool = False  # max_of(tensor) is allowed


CONSTRUCT = frozenset({"parameter", "derived"})
# the namespace kind of each parameter type (a list of names or of ints: formulas take its len())
PARAMETER_KINDS = {"dtype": "dtype", "names": "names", "ints": "names"}
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
SCALAR = Context("a step scalar", CONSTRUCT | {"size"}, "int", tensors=True)
# the device build writes no host tensor: its value reads the Config and the step sizes alone
DEVICE_SCALAR = Context("a step scalar's device value", CONSTRUCT | {"size"}, "int")
CAPTURE = Context("a capture value", CONSTRUCT | {"size", "scalar", "argument"}, "int")


class Scope:
    """What the semantic pass shares: the spec, the errors found so far, the kind of every
    declared name (filled by ``symbols``) and the prover over the declared ranges."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.errors = Collector()
        self.kinds: dict[str, str] = {}
        self.flags = {f.name: f for f in spec.flags}
        self.params = {p.name: p for p in spec.parameters}
        self.prover = prove.prover(spec)

    def construct_names(self) -> list[str]:
        """The parameters and derived values, for a did-you-mean."""
        return [n for n, k in self.kinds.items() if k in ("parameter", "derived", "names", "list")]

    # ------------------------------------------------------------------ names and symbols
    def check_name(self, name: str, loc: Location, what: str) -> None:
        if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in RESERVED:
            self.errors.error(loc, f"{what} name '{name}' is reserved; choose another name")
        elif name in vocab.DTYPES:
            self.errors.error(
                loc,
                f"{what} name '{name}' is a dtype: a tensor's 'dtype: {name}' would mean the "
                "dtype, not this name; choose another name",
            )
        elif what == KIND_TEXT["scalar"] and name in vocab.STEP_FIELDS:
            self.errors.error(
                loc,
                f"{what} name '{name}' is a field of the step record: step.{name} would not "
                "read it; choose another name",
            )
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
            ((p.name, PARAMETER_KINDS.get(p.kind, "parameter"), p.loc) for p in s.parameters),
            ((d.name, "list" if d.kind == "ints" else "derived", d.loc) for d in s.derived),
            ((z.name, "size", z.loc) for z in s.sizes),
            ((x.name, "scalar", x.loc) for x in s.scalars),
        )
        first: dict[str, Location] = {}
        for name, kind, loc in entries:
            self.check_name(name, loc, KIND_TEXT[kind])
            if name in first:
                self.errors.error(
                    loc,
                    f"name '{name}' is already declared at {first[name].line_from(loc)}; "
                    "flags, parameters, derived values, sizes and scalars share one namespace",
                )
                continue
            first[name] = loc
            self.kinds[name] = kind
        self.kinds["index"] = "index"  # the member label inside an index set's 'where'
        self.kinds["max_sequence_length"] = "argument"  # prepare_for_cuda_graph's
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
        ok = self.tensor_maxima(f, ctx)
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
            elif kind in ("names", "list"):
                what = KIND_TEXT[kind]
                if not any(
                    isinstance(c, E.Call) and c.fn == "len" and c.args[0] == n
                    for c in E.walk(f.expr)
                ):
                    self.errors.error(
                        f.at(n.col),
                        f"'{n.id}' is a {what}; formulas can only take its len()",
                    )
                    ok = False
                elif ("parameter" if kind == "names" else "derived") not in ctx.kinds:
                    self.errors.error(
                        f.at(n.col), f"'{n.id}' is a {what}; {ctx.what} cannot use it"
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

    def tensor_maxima(self, f: Formula, ctx: Context) -> bool:
        """Each max_of(tensor) of `f` is allowed here and reads a host rule tensor."""
        ok = True
        for node in E.walk(f.expr):
            if not isinstance(node, E.TensorMax):
                continue
            ok = False
            t = next((t for t in self.spec.tensors if t.name == node.tensor), None)
            if not ctx.tensors:
                message = (
                    f"max_of() reads what a step wrote, so only a step scalar's value may use "
                    f"it, not {ctx.what}"
                )
            elif t is None:
                names = [t.name for t in self.spec.tensors]
                message = f"unknown tensor '{node.tensor}'{did_you_mean(node.tensor, names)}"
            elif t.fill.kind != "rule" or t.memory == "device":
                message = (
                    f"max_of() reads a host or pinned tensor a rule fills; '{t.name}' is "
                    f"{t.memory} memory filled by {t.fill.kind}"
                )
            else:
                ok = True
                continue
            self.errors.error(f.at(node.col), message)
        return ok

    def divisors(self, f: Formula) -> None:
        """Every divisor of `f` must be provably non-zero over the declared ranges (step sizes
        from 0 to their max): a zero divisor would fail at construction or in a step."""
        for node in E.walk(f.expr):
            divisor = _divisor(node)
            if divisor is None:
                continue
            per_step = [
                n
                for n in E.walk(divisor)
                if isinstance(n, E.TensorMax)
                or isinstance(n, E.Name)
                and self.kinds.get(n.id) in ("scalar", "argument")
            ]
            if per_step:  # known only when a step runs: nothing bounds it here
                self.errors.error(
                    f.at(per_step[0].col),  # type: ignore[union-attr]
                    f"'{f.shown}' may divide by zero: '{E.to_source(divisor)}' is known only "
                    "when a step runs; divide by a constant, a parameter or a derived value",
                )
                continue
            if not list(E.names(divisor)):
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
        if isinstance(e, E.TensorMax):
            return "int"
        if isinstance(e, E.Call) and e.fn == "len":
            arg = e.args[0]
            if not (isinstance(arg, E.Name) and self.kinds.get(arg.id) in ("names", "list")):
                self.errors.error(
                    f.at(col), "len() takes the name of a list parameter or derived list"
                )
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

    def dtype_choices(self, dtype: str | None) -> tuple[str, ...]:
        """The dtypes a tensor declared with `dtype` can have (a dtype parameter: its values)."""
        if dtype in vocab.DTYPES:
            return (dtype,)
        p = self.params.get(dtype or "")
        return dtype_values(self.spec, p) if p is not None and p.kind == "dtype" else ()


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
        if divisor is not None and not any(
            isinstance(n, (E.Name, E.TensorMax)) for n in E.walk(divisor)
        ):
            try:
                if E.evaluate(divisor, {}) == 0:
                    return True
            except ZeroDivisionError:
                return True
    return False
