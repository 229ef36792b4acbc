"""The formula and condition grammar: a tokenizer and a recursive-descent parser into the IR
of ``expr`` (nothing else is accepted; there is no eval anywhere).

Grammar::

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
``len(p)`` (the number of names in a list parameter ``p``), ``max_of(t)`` (the largest element
a step wrote into host rule tensor ``t``: step scalars only).
Strings ('...' or "...") only compare with enum flags.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from .expr import BinOp, Bool, BoolOp, Call, Compare, Expr, Int, Name, Neg, Not, Str, TensorMax

MAX_LENGTH = 256
MAX_DEPTH = 32
FUNCTIONS = {"cdiv": (2, 2), "min": (2, 8), "max": (2, 8), "len": (1, 1), "max_of": (1, 1)}
KEYWORDS = frozenset({"and", "or", "not"})


class ExprError(Exception):
    """A problem inside a formula; `col` is the 0-based offset within the formula text."""

    def __init__(self, col: int, message: str) -> None:
        super().__init__(message)
        self.col = col
        self.message = message


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
                if tok.text == "max_of":
                    if not isinstance(args[0], Name):
                        raise ExprError(tok.col, "max_of() takes the name of a tensor")
                    return TensorMax(args[0].id, args[0].col)
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
