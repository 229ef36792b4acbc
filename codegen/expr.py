"""The formula and condition language: a tiny closed grammar parsed into our own IR.

Grammar (nothing else is accepted; there is no eval anywhere)::

    cond   := or
    or     := and ("or" and)*
    and    := not ("and" not)*
    not    := "not" not | cmp
    cmp    := arith (("==" | "!=" | "<" | "<=" | ">" | ">=") arith)?
    arith  := term (("+" | "-") term)*
    term   := unary (("*" | "//" | "%") unary)*
    unary  := "-" unary | atom
    atom   := INT | NAME | STRING | NAME "(" cond ("," cond)* ")" | "(" cond ")"

Functions: ``cdiv(a, b)`` (ceiling division), ``min(a, b, ...)``, ``max(a, b, ...)``,
``len(p)`` (the number of names in a list parameter ``p``).
Strings ('...' or "...") only compare with enum flags. Integer semantics are Python's, with
floor division; generated code is printed from the IR with explicit parentheses.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping

MAX_LENGTH = 256
MAX_DEPTH = 32
FUNCTIONS = {"cdiv": (2, 2), "min": (2, 8), "max": (2, 8), "len": (1, 1)}
KEYWORDS = {"and", "or", "not"}


class ExprError(Exception):
    """A problem inside a formula; `col` is the 0-based offset within the formula text."""

    def __init__(self, col: int, message: str) -> None:
        super().__init__(message)
        self.col = col
        self.message = message


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


Expr = Int | Str | Bool | Name | Neg | BinOp | Call | Compare | Not | BoolOp
TRUE = Bool(True)
FALSE = Bool(False)


# ----------------------------------------------------------------------------------- parsing
_TOKEN = re.compile(
    r"""(?P<ws>[ \t]+)
      |(?P<int>[0-9]+)
      |(?P<name>[A-Za-z_][A-Za-z0-9_]*)
      |(?P<str>'[A-Za-z0-9_.\-]*'|"[A-Za-z0-9_.\-]*")
      |(?P<op>//|==|!=|<=|>=|[-+*%<>(),])""",
    re.VERBOSE,
)


@dataclasses.dataclass(frozen=True)
class _Tok:
    kind: str
    text: str
    col: int


def _tokens(src: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if not m:
            ch = src[pos]
            hint = ""
            if ch == "/":
                hint = " (use // for floor division or cdiv(a, b) for ceiling division)"
            elif src.startswith("**", pos):
                hint = " (powers are not supported)"
            raise ExprError(pos, f"unexpected character {ch!r}{hint}")
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append(_Tok(kind, m.group(), pos))
        pos = m.end()
    out.append(_Tok("end", "", len(src)))
    return out


class _Parser:
    def __init__(self, src: str) -> None:
        self.toks = _tokens(src)
        self.i = 0
        self.depth = 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def accept(self, text: str) -> bool:
        tok = self.peek()
        if tok.text == text and tok.kind in ("op", "name"):
            self.i += 1
            return True
        return False

    def expect(self, text: str) -> None:
        tok = self.peek()
        if not self.accept(text):
            found = "end of formula" if tok.kind == "end" else repr(tok.text)
            raise ExprError(tok.col, f"expected {text!r}, found {found}")

    def nested(self, fn: Callable[[], Expr]) -> Expr:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ExprError(self.peek().col, f"formula nests deeper than {MAX_DEPTH} levels")
        try:
            return fn()
        finally:
            self.depth -= 1

    def cond(self) -> Expr:
        return self.nested(self.or_)

    def or_(self) -> Expr:
        items = [self.and_()]
        while self.accept("or"):
            items.append(self.and_())
        return items[0] if len(items) == 1 else BoolOp("or", tuple(items))

    def and_(self) -> Expr:
        items = [self.not_()]
        while self.accept("and"):
            items.append(self.not_())
        return items[0] if len(items) == 1 else BoolOp("and", tuple(items))

    def not_(self) -> Expr:
        if self.accept("not"):
            return Not(self.nested(self.not_))
        return self.cmp()

    def cmp(self) -> Expr:
        left = self.arith()
        tok = self.peek()
        if tok.kind == "op" and tok.text in ("==", "!=", "<", "<=", ">", ">="):
            self.take()
            right = self.arith()
            nxt = self.peek()
            if nxt.kind == "op" and nxt.text in ("==", "!=", "<", "<=", ">", ">="):
                raise ExprError(nxt.col, "chained comparisons are not supported; use 'and'")
            return Compare(tok.text, left, right)
        return left

    def arith(self) -> Expr:
        left = self.term()
        while self.peek().text in ("+", "-") and self.peek().kind == "op":
            op = self.take().text
            left = BinOp(op, left, self.term())
        return left

    def term(self) -> Expr:
        left = self.unary()
        while self.peek().text in ("*", "//", "%") and self.peek().kind == "op":
            op = self.take().text
            left = BinOp(op, left, self.unary())
        return left

    def unary(self) -> Expr:
        if self.peek().kind == "op" and self.peek().text == "-":
            self.take()
            return Neg(self.nested(self.unary))
        return self.atom()

    def atom(self) -> Expr:
        tok = self.take()
        if tok.kind == "int":
            if len(tok.text) > 1 and tok.text.startswith("0"):
                raise ExprError(tok.col, f"integer {tok.text} has a leading zero")
            if len(tok.text) > 18:
                raise ExprError(tok.col, "integer literal is too large")
            return Int(int(tok.text))
        if tok.kind == "str":
            return Str(tok.text[1:-1])
        if tok.kind == "name":
            if tok.text in KEYWORDS:
                raise ExprError(tok.col, f"unexpected {tok.text!r}")
            if tok.text in ("true", "false", "True", "False"):
                return Bool(tok.text.lower() == "true")
            if self.accept("("):
                if tok.text not in FUNCTIONS:
                    known = ", ".join(sorted(FUNCTIONS))
                    raise ExprError(tok.col, f"unknown function {tok.text!r} (known: {known})")
                args = [self.cond()]
                while self.accept(","):
                    args.append(self.cond())
                self.expect(")")
                lo, hi = FUNCTIONS[tok.text]
                if not lo <= len(args) <= hi:
                    want = str(lo) if lo == hi else f"{lo} to {hi}"
                    raise ExprError(
                        tok.col, f"{tok.text}() takes {want} arguments, got {len(args)}"
                    )
                return Call(tok.text, tuple(args))
            return Name(tok.text, tok.col)
        if tok.kind == "op" and tok.text == "(":
            inner = self.cond()
            self.expect(")")
            return inner
        found = "end of formula" if tok.kind == "end" else repr(tok.text)
        raise ExprError(tok.col, f"expected a number, name or '(', found {found}")


def parse(src: str) -> Expr:
    """Parse one formula or condition; raise ExprError with a column on any problem."""
    if len(src) > MAX_LENGTH:
        raise ExprError(0, f"formula is longer than {MAX_LENGTH} characters")
    if not src.strip():
        raise ExprError(0, "formula is empty")
    p = _Parser(src)
    expr = p.cond()
    tok = p.peek()
    if tok.kind != "end":
        raise ExprError(tok.col, f"unexpected {tok.text!r} after the end of the formula")
    return expr


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


def evaluate(expr: Expr, env: Mapping[str, int | bool | str]) -> int | bool | str:
    """Interpret `expr` over `env` (used by the generator to fold flags and to test formulas)."""
    if isinstance(expr, (Int, Str, Bool)):
        return expr.value
    if isinstance(expr, Name):
        return env[expr.id]
    if isinstance(expr, Call) and expr.fn == "len":
        return len(env[_name_of(expr.args[0])])  # type: ignore[arg-type]
    if isinstance(expr, Neg):
        return -_int(evaluate(expr.operand, env))
    if isinstance(expr, BinOp):
        a, b = _int(evaluate(expr.left, env)), _int(evaluate(expr.right, env))
        if expr.op == "+":
            return a + b
        if expr.op == "-":
            return a - b
        if expr.op == "*":
            return a * b
        if b == 0:
            raise ZeroDivisionError("division by zero in a formula")
        return a // b if expr.op == "//" else a % b
    if isinstance(expr, Call):
        args = [_int(evaluate(a, env)) for a in expr.args]
        if expr.fn == "cdiv":
            if args[1] == 0:
                raise ZeroDivisionError("division by zero in a formula")
            return cdiv(args[0], args[1])
        return min(args) if expr.fn == "min" else max(args)
    if isinstance(expr, Compare):
        x, y = evaluate(expr.left, env), evaluate(expr.right, env)
        return {
            "==": x == y,
            "!=": x != y,
            "<": x < y,  # type: ignore[operator]
            "<=": x <= y,  # type: ignore[operator]
            ">": x > y,  # type: ignore[operator]
            ">=": x >= y,  # type: ignore[operator]
        }[expr.op]
    if isinstance(expr, Not):
        return not evaluate(expr.operand, env)
    if isinstance(expr, BoolOp):
        vals = (bool(evaluate(a, env)) for a in expr.operands)
        return all(vals) if expr.op == "and" else any(vals)
    raise TypeError(f"not an expression: {expr!r}")


def _name_of(e: Expr) -> str:
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
    if isinstance(expr, (Int, Bool, Str)):
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
    expr: Expr, name: Callable[[str], str] = str, call: Callable[[str], str] = str
) -> str:
    """Print `expr` as Python source (or, with the defaults, as spec syntax).

    `name` maps a spec name to the text to print (e.g. ``c.max_batch_size``), `call` maps a
    function name (``cdiv`` -> ``rt.cdiv``). Only validated identifiers, integer literals and
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


# ------------------------------------------------------------------- polynomial normal form
# A formula over +, -, * and integer constants is a polynomial; everything else (//, cdiv,
# min, max) is kept as an opaque atom. Two formulas with equal normal forms are equal for all
# values, and `c - s` with only non-negative coefficients is >= 0 whenever every name is >= 0.
Monomial = tuple[str, ...]  # sorted atom keys; () is the constant term
Poly = dict[Monomial, int]


def polynomial(expr: Expr) -> Poly:
    if isinstance(expr, Int):
        return {(): expr.value} if expr.value else {}
    if isinstance(expr, Name):
        return {(expr.id,): 1}
    if isinstance(expr, Neg):
        return {m: -c for m, c in polynomial(expr.operand).items()}
    if isinstance(expr, BinOp) and expr.op in ("+", "-"):
        out = dict(polynomial(expr.left))
        sign = 1 if expr.op == "+" else -1
        for m, c in polynomial(expr.right).items():
            out[m] = out.get(m, 0) + sign * c
        return {m: c for m, c in out.items() if c}
    if isinstance(expr, BinOp) and expr.op == "*":
        out = {}
        for m1, c1 in polynomial(expr.left).items():
            for m2, c2 in polynomial(expr.right).items():
                m = tuple(sorted(m1 + m2))
                out[m] = out.get(m, 0) + c1 * c2
        return {m: c for m, c in out.items() if c}
    # opaque atom, keyed by its canonical text with normalised operands
    return {(_atom_key(expr),): 1}


def _atom_key(expr: Expr) -> str:
    if isinstance(expr, BinOp):
        return f"({_poly_key(expr.left)}){expr.op}({_poly_key(expr.right)})"
    if isinstance(expr, Call):
        args = [_poly_key(a) for a in expr.args]
        if expr.fn in ("min", "max"):
            args.sort()
        return f"{expr.fn}({','.join(args)})"
    return to_source(expr)


def _poly_key(expr: Expr) -> str:
    return repr(sorted(polynomial(expr).items()))


def equal(a: Expr, b: Expr) -> bool:
    """True when `a` and `b` are provably the same formula."""
    return polynomial(a) == polynomial(b)


def provably_at_least(big: Expr, small: Expr) -> bool:
    """True when ``big >= small`` holds for all non-negative values of the names."""
    diff = polynomial(BinOp("-", big, small))
    return all(c >= 0 for c in diff.values())
