"""Proofs over a spec's declared ranges: capacities, divisors, value ranges and conditions.

Every integer parameter ``p`` lies in ``[min_p, INT_LIMIT)`` (``min`` defaults to 0), so it is
written ``min_p + p'`` with ``p' >= 0``; derived values are inlined as normal forms computed
once each (a chain of derived values costs its length, not 2 ** its length); step sizes are
variables in ``[0, max]``, or taken at 0 (``ZERO``) or at their ``max`` (``UPPER``).

Three kinds of answers:

* proofs (``at_least``, ``nonzero``): True only when the claim holds for every value in the
  declared ranges; False means "not proven" (the caller guards it at run time, or reports it);
* witnesses (``find``): a point of the declared ranges where a formula misbehaves, tried over
  the parameters' minima and a few values above them; a witness is a certain error;
* conditions (``can_hold``): False only when a condition is false for every value.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from . import expr as E
from . import expr_poly as P
from . import vocab
from .model import Spec

VAR, ZERO, UPPER = "var", "zero", "upper"  # how a step size is read
_EVAL_LIMIT = 1 << 200  # witness evaluation gives up on larger values
_OFFSETS = (1, 2, 3, 4, 7, 8, 15, 16, 63, 64, 1000)
_MAX_BOOLS = 8  # boolean parameters enumerated in a condition
_MAX_CONJUNCTIONS = 64  # disjunctive normal form of a condition, at most
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}
_NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}

Point = dict[str, int]
_T = TypeVar("_T")
Env = dict[str, int | bool | str]


class Prover(P.PolyBuilder):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.params = {p.name: p for p in spec.parameters}
        self.derived = {d.name: d.value.expr for d in spec.derived if d.value is not None}
        # integers a function derives: free variables, as parameters are (at least 0)
        self.opaque = {d.name for d in spec.derived if d.value is None and d.kind == "int"}
        self.sizes = {z.name: (z.bound.expr if z.bound else None) for z in spec.sizes}
        self.mode = VAR
        self._dpoly: dict[tuple[str, str], P.Poly | Exception] = {}
        self._dint: dict[tuple[str, str], P.Interval | Exception] = {}
        self._busy: set[str] = set()
        self._reads: dict[str, frozenset[str]] = {}
        self._envs: dict[tuple[tuple[str, int], ...], Env] = {}

    # ------------------------------------------------------------ names, specialised
    def _int_param(self, name: str) -> int | None:
        if name in self.opaque:
            return 0
        p = self.params.get(name)
        if p is None or p.kind != "int":
            return None
        return p.minimum if isinstance(p.minimum, int) else 0

    def name_poly(self, name: str) -> P.Poly:
        low = self._int_param(name)
        if low is not None:
            self.var_intervals[name] = (0, max(0, vocab.INT_LIMIT - 1 - low))
            return {(): low, ((name, 1),): 1} if low else {((name, 1),): 1}
        if name in self.derived:
            key = (name, self.mode)
            if key not in self._dpoly:
                self._dpoly[key] = self._guarded(name, lambda: self.poly(self.derived[name]))
            got = self._dpoly[key]
            if isinstance(got, Exception):
                raise got
            return got
        if name in self.sizes:
            bound = self.sizes[name]
            if self.mode == ZERO:
                return {}
            if self.mode == UPPER:
                if bound is None:
                    raise P.Unknown(f"step size '{name}' has no max")
                return self.poly(bound)
            self.var_intervals[name] = (0, self._size_hi(name))
            return {((name, 1),): 1}
        raise P.Unknown(f"'{name}' is not an integer")

    def name_interval(self, name: str) -> P.Interval:
        low = self._int_param(name)
        if low is not None:
            return (low, vocab.INT_LIMIT - 1)
        if name in self.derived:
            key = (name, self.mode)
            if key not in self._dint:
                self._dint[key] = self._guarded(name, lambda: self.bounds(self.derived[name]))
            got = self._dint[key]
            if isinstance(got, Exception):
                raise got
            return got
        if name in self.sizes:
            if self.mode == ZERO:
                return (0, 0)
            if self.mode == UPPER:
                bound = self.sizes[name]
                if bound is None:
                    raise P.Unknown(f"step size '{name}' has no max")
                return self.bounds(bound)
            return (0, self._size_hi(name))
        return P.ANY

    def len_interval(self, name: str) -> P.Interval:
        p = self.params.get(name)
        return (0, len(p.values)) if p is not None and p.kind == "names" else (0, P.INF)

    def _size_hi(self, name: str) -> int | float:
        bound = self.sizes[name]
        if bound is None:
            return P.INF
        mode, self.mode = self.mode, VAR
        try:
            return self.bounds(bound)[1]
        except (P.Unknown, P.TooBig):
            return P.INF
        finally:
            self.mode = mode

    def _guarded(self, name: str, fn: Callable[[], _T]) -> _T | Exception:
        """`fn()` for derived value `name`, or the exception it raised (cached by the caller);
        a derived value that reads itself (a cycle, reported elsewhere) is Unknown."""
        if name in self._busy:
            return P.Unknown(f"derived value '{name}' reads itself")
        self._busy.add(name)
        try:
            return fn()
        except (P.TooBig, P.Unknown) as exc:
            return exc
        finally:
            self._busy.discard(name)

    # ---------------------------------------------------------------------- proofs
    def poly_in(self, e: E.Expr, mode: str) -> P.Poly:
        old, self.mode = self.mode, mode
        try:
            return self.poly(e)
        finally:
            self.mode = old

    def range_of(self, e: E.Expr, mode: str = VAR) -> P.Interval:
        """Every value `e` can take over the declared ranges (ANY when unknown)."""
        old, self.mode = self.mode, mode
        try:
            return self.bounds(e)
        except (P.Unknown, P.TooBig):
            return P.ANY
        finally:
            self.mode = old

    def at_least(
        self, big: E.Expr, small: E.Expr, big_mode: str = VAR, small_mode: str = VAR, plus: int = 0
    ) -> bool:
        """True when ``big >= small + plus`` for every value in the declared ranges (each side
        reading step sizes as its mode says)."""
        try:
            diff = P.poly_add(self.poly_in(big, big_mode), self.poly_in(small, small_mode), -1)
            return self.poly_bounds(diff)[0] >= plus
        except (P.Unknown, P.TooBig):
            return False

    def nonzero(self, e: E.Expr, mode: str = VAR) -> bool:
        lo, hi = self.range_of(e, mode)
        return lo > 0 or hi < 0

    def divisor(self, d: E.Expr) -> str | None:
        """None when divisor `d` is provably non-zero (or reads something unknown); else where
        it is zero ("when p = 1"), or "" when no tried point makes it zero."""
        old, self.mode = self.mode, VAR
        try:
            lo, hi = self.bounds(d)
        except P.Unknown:
            return None
        finally:
            self.mode = old
        if lo > 0 or hi < 0:
            return None
        sizes = dict.fromkeys(self.sizes, 0)
        found = self.find(d, lambda v: v == 0, sizes=sizes)
        return self.where(d, found[0], sizes) if found else ""

    # ------------------------------------------------------------------- witnesses
    def reads(self, e: E.Expr) -> list[str]:
        """The integer parameters `e` reads, directly or through derived values (in the order
        they are declared)."""
        found: set[str] = set()
        for n in E.names(e):
            found |= self._reads_name(n.id)
        return [p for p in self.params if p in found]

    def _reads_name(self, name: str) -> frozenset[str]:
        if name in self._reads:
            return self._reads[name]
        self._reads[name] = frozenset()  # a cycle reads nothing more
        if self._int_param(name) is not None:
            out = frozenset({name})
        elif name in self.derived:
            out = frozenset().union(*(self._reads_name(n.id) for n in E.names(self.derived[name])))
        else:
            out = frozenset()
        self._reads[name] = out
        return out

    def points(self, names: list[str]) -> Iterator[Point]:
        """Points of the declared ranges to try: every parameter at its minimum, then each of
        `names` alone, then all of them together, a little and a lot above it."""
        base = {
            n: low
            for n in (*self.params, *sorted(self.opaque))
            if (low := self._int_param(n)) is not None
        }
        yield base
        for k in _OFFSETS:
            for n in names:
                yield {**base, n: base[n] + k}
            if len(names) > 1:
                yield {**base, **{n: base[n] + k for n in names}}

    def env(self, point: Point) -> Env:
        """Parameters at `point` (booleans false, names parameters at their defaults) and every
        derived value that can be computed there."""
        key = tuple(sorted(point.items()))
        got = self._envs.get(key)
        if got is not None:
            return got
        env: Env = dict(point)
        for p in self.spec.parameters:
            if p.kind == "bool":
                env[p.name] = bool(p.default)
            elif p.kind in ("names", "ints"):
                env[p.name] = tuple(p.default) if isinstance(p.default, tuple) else ()  # type: ignore[assignment]
        pending = [d for d in self.spec.derived if d.value is not None]
        while pending:  # in dependency order; values that cannot be computed stay out
            progress = False
            for d in list(pending):
                assert d.value is not None
                deps = {n.id for n in E.names(d.value.expr)}
                if deps & {x.name for x in pending}:
                    continue
                pending.remove(d)
                progress = True
                with contextlib.suppress(ArithmeticError, KeyError, TypeError):
                    env[d.name] = E.evaluate(d.value.expr, env, limit=_EVAL_LIMIT)  # type: ignore[union-attr]
            if not progress:
                break
        self._envs[key] = env
        return env

    def find(
        self,
        e: E.Expr,
        bad: Callable[[int], bool],
        valid: Callable[[Env], bool] | None = None,
        sizes: Mapping[str, int] | None = None,
    ) -> tuple[Point, int] | None:
        """A point where `bad(value of e)` and `valid` hold; None when no tried point is one."""
        for point in self.points(self.reads(e)):
            env = self.env(point)
            if valid is not None and not _safe(lambda env=env: valid(env)):  # type: ignore[misc]
                continue
            try:
                value = E.evaluate(e, {**env, **(sizes or {})}, limit=_EVAL_LIMIT)
            except (ArithmeticError, KeyError, TypeError):
                continue
            if isinstance(value, int) and not isinstance(value, bool) and bad(value):
                return point, value
        return None

    def holds(self, cond: E.Expr, env: Env) -> bool:
        """`cond` at `env`; False when it cannot be evaluated there."""
        return _safe(lambda: bool(E.evaluate(cond, env, limit=_EVAL_LIMIT)))

    def where(self, e: E.Expr, point: Point, sizes: Mapping[str, int] | None = None) -> str:
        """`point` in words, for the parameters (and step sizes) `e` reads."""
        read = {n.id for n in E.names(e)}
        parts = [f"{n} = {point[n]}" for n in self.reads(e)]
        parts += [f"{n} = {v}" for n, v in (sizes or {}).items() if n in read]
        return "when " + ", ".join(parts) if parts else "for every value of the parameters"

    # ------------------------------------------------------------------ conditions
    def can_hold(self, cond: E.Expr | None) -> bool:
        """False when `cond` (flags folded away) is false for every value of the parameters
        in their declared ranges; True when it may hold (or the question is too large)."""
        if cond is None:
            return True
        bools = sorted(
            {
                n.id
                for n in E.names(cond)
                if n.id in self.params and self.params[n.id].kind == "bool"
            }
        )
        if len(bools) > _MAX_BOOLS:
            bools = []  # no enumeration: the normal form below still sees p and not p
        for values in itertools.product((False, True), repeat=len(bools)):
            folded = E.fold(cond, dict(zip(bools, values)))
            if folded == E.TRUE:
                return True
            if folded == E.FALSE:
                continue
            terms = _dnf(folded, False)
            if terms is None:
                return True
            if any(self._consistent(t) for t in terms):
                return True
        return False

    def _consistent(self, literals: list[tuple[E.Expr, bool]]) -> bool:
        """False when the conjunction of `literals` (expression, negated) provably fails."""
        polarity: dict[E.Expr, bool] = {}
        ranges: dict[object, P.Interval] = {}
        excluded: dict[object, set[int]] = {}
        for lit, negated in literals:
            if not isinstance(lit, E.Compare):
                if polarity.setdefault(lit, negated) != negated:
                    return False
                continue
            op = _NEGATE[lit.op] if negated else lit.op
            try:
                diff = P.poly_add(self.poly_in(lit.left, VAR), self.poly_in(lit.right, VAR), -1)
            except (P.Unknown, P.TooBig):
                continue  # strings, enum flags, formulas too large: no conclusion
            const = diff.pop((), 0)
            if not diff:
                if not _compare(const, op, 0):
                    return False
                continue
            first = min(diff)
            if diff[first] < 0:
                diff = {m: -c for m, c in diff.items()}
                const, op = -const, _FLIP[op]
            key = P.frozen_poly(diff)
            if key not in ranges:
                ranges[key] = self.poly_bounds(diff)
            lo, hi = ranges[key]
            k = -const  # diff op k
            if op == "<":
                hi = min(hi, k - 1)
            elif op == "<=":
                hi = min(hi, k)
            elif op == ">":
                lo = max(lo, k + 1)
            elif op == ">=":
                lo = max(lo, k)
            elif op == "==":
                lo, hi = max(lo, k), min(hi, k)
            else:
                excluded.setdefault(key, set()).add(k)
            ranges[key] = (lo, hi)
            if lo > hi or (lo == hi and lo in excluded.get(key, ())):
                return False
        return True


def _compare(a: int, op: str, b: int) -> bool:
    return {
        "<": a < b,
        "<=": a <= b,
        ">": a > b,
        ">=": a >= b,
        "==": a == b,
        "!=": a != b,
    }[op]


def _dnf(e: E.Expr, negated: bool) -> list[list[tuple[E.Expr, bool]]] | None:
    """`e` (negated if asked) as a disjunction of conjunctions of literals; None when that
    would exceed _MAX_CONJUNCTIONS."""
    if isinstance(e, E.Bool):
        return [[]] if e.value != negated else []
    if isinstance(e, E.Not):
        return _dnf(e.operand, not negated)
    if isinstance(e, E.BoolOp):
        parts = [_dnf(a, negated) for a in e.operands]
        if any(p is None for p in parts):
            return None
        if (e.op == "or") != negated:  # a disjunction: the union
            out = [t for p in parts for t in p]  # type: ignore[union-attr]
            return out if len(out) <= _MAX_CONJUNCTIONS else None
        acc: list[list[tuple[E.Expr, bool]]] = [[]]
        for p in parts:
            acc = [a + b for a in acc for b in p]  # type: ignore[union-attr]
            if len(acc) > _MAX_CONJUNCTIONS:
                return None
        return acc
    return [[(e, negated)]]


def _safe(fn: Callable[[], bool]) -> bool:
    try:
        return bool(fn())
    except (ArithmeticError, KeyError, TypeError):
        return False


def prover(spec: Spec) -> Prover:
    """The spec's prover, shared by every family's plan and the validator (its caches make
    the whole spec cost one pass over each derived value). It is kept on the spec object
    itself (not a field: equality, hashing and printing do not see it)."""
    got = spec.__dict__.get("_prover")
    if not isinstance(got, Prover):
        got = Prover(spec)
        object.__setattr__(spec, "_prover", got)
    return got
