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
            return len(env[_name_of(e.args[0])])  # type: ignore[arg-type]
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
# A formula over +, -, * and integer constants is a polynomial; everything else (//, %, cdiv,
# min, max, len) is an opaque atom, interned by its operator and the normal forms of its
# operands. Two formulas with equal normal forms are equal for all values. Each variable and
# atom has an interval; a polynomial whose monomials all have non-negative variables gets a
# lower bound from its constant and the signs of its coefficients (the capacity proofs).
#
# Normal forms are bounded (terms, degree, coefficient bits): a formula such as d * d over a
# chain of derived values would otherwise grow exponentially. Past the bounds, TooBig is
# raised and the caller gives up on the proof (a run-time guard, never a hang).
Monomial = tuple[tuple[str, int], ...]  # sorted (variable, exponent) pairs; () is the constant
Poly = dict[Monomial, int]
Interval = tuple[int | float, int | float]  # (lo, hi); floats only for -inf / +inf
INF = float("inf")
ANY: Interval = (-INF, INF)
MAX_TERMS = 256
MAX_DEGREE = 64
MAX_BITS = 256


class TooBig(Exception):
    """A normal form past the bounds (too many terms, too high a degree, too large a number)."""


class Unknown(Exception):
    """A name the builder cannot give a normal form (a size without a bound, a cycle)."""


_CAP = 1 << MAX_BITS


def _norm(lo: int | float, hi: int | float) -> Interval:
    """An interval with its ends kept small: a low end above _CAP becomes _CAP (still a lower
    bound), a high end above it +inf (still an upper bound), and the mirror images below."""
    if lo > _CAP:
        lo = _CAP
    elif lo < -_CAP:
        lo = -INF
    if hi < -_CAP:
        hi = -_CAP
    elif hi > _CAP:
        hi = INF
    return (lo, hi)


def _imul(x: int | float, y: int | float) -> int | float:
    return 0 if x == 0 or y == 0 else x * y


def _ifloordiv(x: int | float, y: int | float) -> tuple[int | float, ...]:
    """floor(x / y) at one corner of the intervals (y != 0); infinite corners give the values
    the quotient approaches."""
    if isinstance(x, int) and isinstance(y, int):
        return (x // y,)
    if y in (INF, -INF):
        if x in (INF, -INF):
            return (-INF, -1, 0, INF)
        return (0, -1)
    return (INF if (x > 0) == (y > 0) else -INF,)


def interval_op(op: str, a: Interval, b: Interval) -> Interval:
    """The interval of `a op b` for + - * // % (a divisor interval holding 0 gives ANY).

    Low ends are never +inf and high ends never -inf (``_norm``), so no inf - inf arises."""
    if op == "+":
        return _norm(a[0] + b[0], a[1] + b[1])
    if op == "-":
        return _norm(a[0] - b[1], a[1] - b[0])
    if op == "*":
        corners = [_imul(x, y) for x in a for y in b]
        return _norm(min(corners), max(corners))
    if b[0] <= 0 <= b[1]:
        return ANY
    if op == "//":
        values = [v for x in a for y in b for v in _ifloordiv(x, y)]
        return _norm(min(values), max(values))
    # a % b takes the sign of b, and |a % b| < |b|
    if b[0] > 0:
        hi = b[1] - 1
        if a[0] >= 0 and a[1] < b[0]:
            return a
        return _norm(0, hi if a[0] < 0 else min(hi, a[1]))
    return _norm(b[0] + 1, 0)


def _intersect(a: Interval, b: Interval) -> Interval:
    return (max(a[0], b[0]), min(a[1], b[1]))


class PolyBuilder:
    """Normal forms and intervals of formulas. The base class treats every name as a variable
    >= 0; ``prove.Prover`` resolves parameters, derived values and step sizes of a spec."""

    def __init__(self) -> None:
        self._atoms: dict[object, str] = {}
        self.var_intervals: dict[str, Interval] = {}

    # -------------------------------------------------------------- to be specialised
    def name_poly(self, name: str) -> Poly:
        self.var_intervals.setdefault(name, (0, INF))
        return {((name, 1),): 1}

    def name_interval(self, name: str) -> Interval:
        return (0, INF)

    def len_interval(self, name: str) -> Interval:
        return (0, INF)

    # ------------------------------------------------------------------ normal forms
    def poly(self, e: Expr) -> Poly:
        if isinstance(e, Int):
            return {(): e.value} if e.value else {}
        if isinstance(e, Name):
            return self.name_poly(e.id)
        if isinstance(e, Neg):
            return {m: -c for m, c in self.poly(e.operand).items()}
        if isinstance(e, BinOp) and e.op in ("+", "-"):
            return poly_add(self.poly(e.left), self.poly(e.right), 1 if e.op == "+" else -1)
        if isinstance(e, BinOp) and e.op == "*":
            return poly_mul(self.poly(e.left), self.poly(e.right))
        return {((self.atom(e), 1),): 1}

    def atom(self, e: Expr) -> str:
        """The variable standing for an opaque formula, the same for equal operands."""
        if isinstance(e, BinOp):
            key: object = (e.op, frozen_poly(self.poly(e.left)), frozen_poly(self.poly(e.right)))
        elif isinstance(e, Call) and e.fn == "len":
            key = ("len", _name_of(e.args[0]))
        elif isinstance(e, Call):
            args = [frozen_poly(self.poly(a)) for a in e.args]
            if e.fn in ("min", "max"):
                args = sorted(set(args), key=repr)
            key = (e.fn, tuple(args))
        else:
            raise Unknown(f"not an integer formula: {to_source(e)}")
        var = self._atoms.get(key)
        if var is None:
            var = f"#{len(self._atoms)}"
            self._atoms[key] = var
            self.var_intervals[var] = self.interval(e)
        return var

    # --------------------------------------------------------------------- intervals
    def interval(self, e: Expr) -> Interval:
        """Every value `e` can take (a sound over-approximation)."""
        if isinstance(e, Int):
            return (e.value, e.value)
        if isinstance(e, Name):
            return self.name_interval(e.id)
        if isinstance(e, Neg):
            lo, hi = self.bounds(e.operand)
            return _norm(-hi, -lo)
        if isinstance(e, BinOp):
            return interval_op(e.op, self.bounds(e.left), self.bounds(e.right))
        if isinstance(e, Call) and e.fn == "len":
            return self.len_interval(_name_of(e.args[0]))
        if isinstance(e, Call) and e.fn == "cdiv":
            a, b = self.bounds(e.args[0]), self.bounds(e.args[1])
            lo, hi = interval_op("//", _norm(-a[1], -a[0]), b)
            return _norm(-hi, -lo)
        if isinstance(e, Call):
            parts = [self.bounds(a) for a in e.args]
            pick = min if e.fn == "min" else max
            return (pick(p[0] for p in parts), pick(p[1] for p in parts))
        raise Unknown(f"not an integer formula: {to_source(e)}")

    def bounds(self, e: Expr) -> Interval:
        """The interval of `e`, narrowed by its normal form (``a - a`` is 0)."""
        box = self.interval(e)
        try:
            p = self.poly(e)
        except TooBig:
            return box
        return _intersect(box, self.poly_bounds(p))

    def poly_bounds(self, p: Poly) -> Interval:
        lo: int | float = p.get((), 0)
        hi: int | float = lo
        for m, c in p.items():
            if not m:
                continue
            mlo, mhi = self.monomial_interval(m)
            lo, hi = _norm(
                lo + min(_imul(c, mlo), _imul(c, mhi)), hi + max(_imul(c, mlo), _imul(c, mhi))
            )
        return (lo, hi)

    def monomial_interval(self, m: Monomial) -> Interval:
        out: Interval = (1, 1)
        for var, exp in m:
            lo, hi = self.var_intervals.get(var, ANY)
            if exp % 2 == 0 and lo < 0 < hi:
                lo, hi = 0, max(_pow(lo, exp), _pow(hi, exp))
            else:
                lo, hi = _pow(lo, exp), _pow(hi, exp)
            corners = [_imul(x, y) for x in out for y in (lo, hi)]
            out = _norm(min(corners), max(corners))
        return out


def _pow(x: int | float, exp: int) -> int | float:
    if isinstance(x, float):
        return x if exp % 2 or x > 0 else -x
    if abs(x) > 1 and abs(x).bit_length() * exp > MAX_BITS + 1:
        return (_CAP + 1) * (1 if x > 0 or exp % 2 == 0 else -1)  # _norm takes it from here
    return x**exp


def frozen_poly(p: Poly) -> tuple[tuple[Monomial, int], ...]:
    return tuple(sorted(p.items()))


def poly_add(a: Poly, b: Poly, sign: int = 1) -> Poly:
    out = dict(a)
    for m, c in b.items():
        out[m] = out.get(m, 0) + sign * c
    out = {m: c for m, c in out.items() if c}
    _check(out)
    return out


def poly_mul(a: Poly, b: Poly) -> Poly:
    if len(a) * len(b) > MAX_TERMS * 4:
        raise TooBig("too many terms")
    out: Poly = {}
    for m1, c1 in a.items():
        for m2, c2 in b.items():
            powers = dict(m1)
            for var, exp in m2:
                powers[var] = powers.get(var, 0) + exp
            if sum(powers.values()) > MAX_DEGREE:
                raise TooBig("degree too high")
            m = tuple(sorted(powers.items()))
            out[m] = out.get(m, 0) + c1 * c2
    out = {m: c for m, c in out.items() if c}
    _check(out)
    return out


def _check(p: Poly) -> None:
    if len(p) > MAX_TERMS:
        raise TooBig("too many terms")
    if any(c.bit_length() > MAX_BITS for c in p.values()):
        raise TooBig("coefficient too large")


def polynomial(expr: Expr) -> Poly:
    """The normal form of `expr` with its names as variables (atoms named #0, #1, ...)."""
    return PolyBuilder().poly(expr)


def equal(a: Expr, b: Expr) -> bool:
    """True when `a` and `b` are provably the same formula."""
    try:
        return not PolyBuilder().poly(BinOp("-", a, b))
    except (TooBig, Unknown):
        return False


def provably_at_least(big: Expr, small: Expr) -> bool:
    """True when ``big >= small`` holds for all non-negative values of the names."""
    builder = PolyBuilder()
    try:
        return builder.poly_bounds(builder.poly(BinOp("-", big, small)))[0] >= 0
    except (TooBig, Unknown):
        return False
