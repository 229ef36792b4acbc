"""Polynomial normal forms and intervals of formulas, the arithmetic behind every proof.

A formula over +, -, * and integer constants is a polynomial; everything else (//, %, cdiv,
min, max, len) is an opaque atom, interned by its operator and the normal forms of its
operands. Two formulas with equal normal forms are equal for all values. Each variable and
atom has an interval; a polynomial whose monomials all have non-negative variables gets a
lower bound from its constant and the signs of its coefficients (the capacity proofs).

Normal forms are bounded (terms, degree, coefficient bits): a formula such as d * d over a
chain of derived values would otherwise grow exponentially. Past the bounds, TooBig is
raised and the caller gives up on the proof (a run-time guard, never a hang).
"""

from __future__ import annotations

from .expr import BinOp, Call, Expr, Int, Name, Neg, name_of, to_source

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
            key = ("len", name_of(e.args[0]))
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
            return self.len_interval(name_of(e.args[0]))
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
