"""The formula and condition language's IR and what works on it: traversal, the interpreter,
substitution, partial evaluation (``fold``) and the printer.

Formulas are parsed into this IR by ``expr_parse`` and reasoned about as polynomials by
``expr_poly``. Integer semantics are Python's, with floor division; generated code is printed
from the IR with explicit parentheses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping


# ---------------------------------------------------------------------------------------- IR
@dataclasses.dataclass(frozen=True)
class Int:
    value: int


@dataclasses.dataclass(frozen=True)
class Str:
    value: str


@dataclasses.dataclass(frozen=True)
class Bool:
    value: bool


@dataclasses.dataclass(frozen=True)
class Name:
    id: str
    col: int = dataclasses.field(default=0, compare=False)


@dataclasses.dataclass(frozen=True)
class TensorMax:
    """``max_of(tensor)``: the largest element a step wrote into a host rule tensor (0 when it
    wrote none). Known only per step: step scalars read it, nothing folds or proves it."""

    tensor: str
    col: int = dataclasses.field(default=0, compare=False)


@dataclasses.dataclass(frozen=True)
class Neg:
    operand: Expr


@dataclasses.dataclass(frozen=True)
class BinOp:
    op: str  # + - * // %
    left: Expr
    right: Expr


@dataclasses.dataclass(frozen=True)
class Call:
    fn: str  # cdiv min max len
    args: tuple[Expr, ...]


@dataclasses.dataclass(frozen=True)
class Compare:
    op: str  # == != < <= > >=
    left: Expr
    right: Expr


@dataclasses.dataclass(frozen=True)
class Not:
    operand: Expr


@dataclasses.dataclass(frozen=True)
class BoolOp:
    op: str  # and or
    operands: tuple[Expr, ...]


Expr = Int | Str | Bool | Name | TensorMax | Neg | BinOp | Call | Compare | Not | BoolOp
TRUE = Bool(True)
FALSE = Bool(False)


# ------------------------------------------------------------------------------- traversal
def walk(expr: Expr) -> Iterator[Expr]:
    """Every node of `expr`, parents before children, left to right."""
    yield expr
    if isinstance(expr, (Neg, Not)):
        yield from walk(expr.operand)
    elif isinstance(expr, (BinOp, Compare)):
        yield from walk(expr.left)
        yield from walk(expr.right)
    elif isinstance(expr, Call):
        for a in expr.args:
            yield from walk(a)
    elif isinstance(expr, BoolOp):
        for a in expr.operands:
            yield from walk(a)


def names(expr: Expr) -> Iterator[Name]:
    """Every Name node, left to right."""
    return (n for n in walk(expr) if isinstance(n, Name))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def evaluate(
    expr: Expr, env: Mapping[str, int | bool | str], limit: int | None = None
) -> int | bool | str:
    """Interpret `expr` over `env` (used by the generator to fold flags and to test formulas).

    With `limit`, an intermediate integer whose magnitude exceeds it raises OverflowError (so
    a formula such as d * d over a chain of derived values cannot run away).
    """

    def go(e: Expr) -> int | bool | str:
        if isinstance(e, (Int, Str, Bool)):
            return e.value
        if isinstance(e, Name):
            return env[e.id]
        if isinstance(e, Call) and e.fn == "len":
            return len(env[name_of(e.args[0])])  # type: ignore[arg-type]
        if isinstance(e, Neg):
            return -_int(go(e.operand))
        if isinstance(e, BinOp):
            a, b = _int(go(e.left)), _int(go(e.right))
            if e.op == "+":
                return big(a + b)
            if e.op == "-":
                return big(a - b)
            if e.op == "*":
                if (
                    limit is not None
                    and a
                    and b
                    and a.bit_length() + b.bit_length() > limit.bit_length() + 1
                ):
                    raise OverflowError("a formula's value is too large")
                return big(a * b)
            if b == 0:
                raise ZeroDivisionError("division by zero in a formula")
            return a // b if e.op == "//" else a % b
        if isinstance(e, Call):
            args = [_int(go(a)) for a in e.args]
            if e.fn == "cdiv":
                if args[1] == 0:
                    raise ZeroDivisionError("division by zero in a formula")
                return cdiv(args[0], args[1])
            return min(args) if e.fn == "min" else max(args)
        if isinstance(e, Compare):
            x, y = go(e.left), go(e.right)
            return {
                "==": x == y,
                "!=": x != y,
                "<": x < y,  # type: ignore[operator]
                "<=": x <= y,  # type: ignore[operator]
                ">": x > y,  # type: ignore[operator]
                ">=": x >= y,  # type: ignore[operator]
            }[e.op]
        if isinstance(e, Not):
            return not go(e.operand)
        if isinstance(e, BoolOp):
            vals = (bool(go(a)) for a in e.operands)
            return all(vals) if e.op == "and" else any(vals)
        raise TypeError(f"not an expression: {e!r}")

    def big(v: int) -> int:
        if limit is not None and abs(v) > limit:
            raise OverflowError("a formula's value is too large")
        return v

    return go(expr)


def name_of(e: Expr) -> str:
    if not isinstance(e, Name):
        raise TypeError(f"len() takes a list parameter, got {e!r}")
    return e.id


def _int(v: object) -> int:
    if type(v) is not int:
        raise TypeError(f"expected an integer, got {v!r}")
    return v


def substitute(expr: Expr, values: Mapping[str, Expr]) -> Expr:
    """Replace names by expressions (no simplification)."""
    if isinstance(expr, Name):
        return values.get(expr.id, expr)
    if isinstance(expr, Neg):
        return Neg(substitute(expr.operand, values))
    if isinstance(expr, Not):
        return Not(substitute(expr.operand, values))
    if isinstance(expr, BinOp):
        return BinOp(expr.op, substitute(expr.left, values), substitute(expr.right, values))
    if isinstance(expr, Compare):
        return Compare(expr.op, substitute(expr.left, values), substitute(expr.right, values))
    if isinstance(expr, Call):
        return Call(expr.fn, tuple(substitute(a, values) for a in expr.args))
    if isinstance(expr, BoolOp):
        return BoolOp(expr.op, tuple(substitute(a, values) for a in expr.operands))
    return expr


def fold(expr: Expr, known: Mapping[str, int | bool | str]) -> Expr:
    """Partially evaluate `expr` with the names in `known` fixed (generate-time flags).

    The result is a constant when everything it needs is known, otherwise a residual
    expression over the remaining (construct-time) names.
    """

    def const(v: int | bool | str) -> Expr:
        if isinstance(v, bool):
            return Bool(v)
        if isinstance(v, int):
            return Int(v)
        return Str(v)

    def is_const(e: Expr) -> bool:
        return isinstance(e, (Int, Bool, Str))

    if isinstance(expr, Name):
        return const(known[expr.id]) if expr.id in known else expr
    if isinstance(expr, (Int, Bool, Str, TensorMax)):
        return expr
    if isinstance(expr, BoolOp):
        kept: list[Expr] = []
        for operand in expr.operands:
            f = fold(operand, known)
            if isinstance(f, Bool):
                if f.value == (expr.op == "or"):
                    return f  # True in an 'or', False in an 'and' decides it
                continue
            kept.append(f)
        if not kept:
            return Bool(expr.op == "and")
        return kept[0] if len(kept) == 1 else BoolOp(expr.op, tuple(kept))
    if isinstance(expr, Not):
        inner = fold(expr.operand, known)
        return Bool(not inner.value) if isinstance(inner, Bool) else Not(inner)
    if isinstance(expr, Neg):
        inner = fold(expr.operand, known)
        return Int(-inner.value) if isinstance(inner, Int) else Neg(inner)
    if isinstance(expr, (BinOp, Compare)):
        left, right = fold(expr.left, known), fold(expr.right, known)
        folded = type(expr)(expr.op, left, right)
        return _const_or(folded, const) if is_const(left) and is_const(right) else folded
    if isinstance(expr, Call):
        args = tuple(fold(a, known) for a in expr.args)
        folded_call = Call(expr.fn, args)
        return _const_or(folded_call, const) if all(map(is_const, args)) else folded_call
    raise TypeError(f"not an expression: {expr!r}")


def _const_or(expr: Expr, const: Callable[[int | bool | str], Expr]) -> Expr:
    """The value of a constant expression, or the expression itself if it divides by zero
    (left for the evaluation that raises to report)."""
    try:
        return const(evaluate(expr, {}))
    except ZeroDivisionError:
        return expr


# -------------------------------------------------------------------------------- printing
_PREC = {"or": 1, "and": 2, "not": 3, "cmp": 4, "+": 5, "-": 5, "*": 6, "//": 6, "%": 6, "neg": 7}


def to_source(
    expr: Expr,
    name: Callable[[str], str] = str,
    call: Callable[[str], str] = str,
    tensor_max: Callable[[str], str] = lambda t: f"max_of({t})",
) -> str:
    """Print `expr` as Python source (or, with the defaults, as spec syntax).

    `name` maps a spec name to the text to print (e.g. ``c.max_batch_size``), `call` maps a
    function name (``cdiv`` -> ``rt.cdiv``), `tensor_max` prints ``max_of(tensor)``. Only validated identifiers, integer literals and
    repr'd strings are ever printed: nothing of the original text is pasted.
    """

    def go(e: Expr, parent: int) -> str:
        if isinstance(e, Int):
            text = str(int(e.value))
            return f"({text})" if e.value < 0 and parent > 0 else text
        if isinstance(e, Bool):
            return "True" if e.value else "False"
        if isinstance(e, Str):
            return repr(str(e.value))
        if isinstance(e, Name):
            return name(e.id)
        if isinstance(e, TensorMax):
            return tensor_max(e.tensor)
        if isinstance(e, Neg):
            text, prec = "-" + go(e.operand, _PREC["neg"]), _PREC["neg"]
        elif isinstance(e, BinOp):
            prec = _PREC[e.op]
            # left-associative: the right operand needs parentheses at equal precedence
            text = f"{go(e.left, prec)} {e.op} {go(e.right, prec + 1)}"
        elif isinstance(e, Call):
            return f"{call(e.fn)}({', '.join(go(a, 0) for a in e.args)})"
        elif isinstance(e, Compare):
            prec = _PREC["cmp"]
            text = f"{go(e.left, prec + 1)} {e.op} {go(e.right, prec + 1)}"
        elif isinstance(e, Not):
            prec = _PREC["not"]
            text = f"not {go(e.operand, prec)}"
        elif isinstance(e, BoolOp):
            prec = _PREC[e.op]
            text = f" {e.op} ".join(go(a, prec + 1) for a in e.operands)
        else:
            raise TypeError(f"not an expression: {e!r}")
        return f"({text})" if prec < parent else text

    return go(expr, 0)
