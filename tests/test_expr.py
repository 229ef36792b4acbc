"""The formula language: parse/print round trips, integer semantics, folding, and errors."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bufc.codegen import expr as E
from bufc.codegen.expr_parse import MAX_LENGTH, ExprError, parse
from bufc.codegen.expr_poly import equal, provably_at_least

NAMES = ("a", "b", "c")

ints = st.builds(E.Int, st.integers(0, 50))
leaves = ints | st.builds(E.Name, st.sampled_from(NAMES))
arith = st.recursive(
    leaves,
    lambda sub: (
        st.builds(E.BinOp, st.sampled_from(["+", "-", "*", "//"]), sub, sub)
        | st.builds(E.Neg, sub)
        | st.builds(lambda a, b: E.Call("cdiv", (a, b)), sub, sub)
        | st.builds(
            lambda fn, xs: E.Call(fn, tuple(xs)),
            st.sampled_from(["min", "max"]),
            st.lists(sub, min_size=2, max_size=3),
        )
    ),
    max_leaves=6,
)
conds = st.recursive(
    st.builds(E.Compare, st.sampled_from(["==", "!=", "<", "<=", ">", ">="]), arith, arith),
    lambda sub: (
        st.builds(E.Not, sub)
        | st.builds(
            lambda op, xs: E.BoolOp(op, tuple(xs)),
            st.sampled_from(["and", "or"]),
            st.lists(sub, min_size=2, max_size=3),
        )
    ),
    max_leaves=3,
)
envs = st.fixed_dictionaries({n: st.integers(1, 40) for n in NAMES})


def py_eval(e: E.Expr, env: dict[str, int]):
    """Independent semantics: run the printed Python (test-only; the tool never does this)."""
    src = E.to_source(e, call=lambda f: "cdiv" if f == "cdiv" else f)
    return eval(src, {"cdiv": lambda x, y: -(-x // y), "min": min, "max": max}, dict(env))  # noqa: S307


def safe(fn):
    try:
        return fn()
    except ZeroDivisionError:
        return ZeroDivisionError


@settings(max_examples=200, deadline=None)
@given(arith | conds)
def test_print_then_parse_is_identity(e):
    src = E.to_source(e)
    assume(len(src) <= MAX_LENGTH)
    assert parse(src) == e


@settings(max_examples=200, deadline=None)
@given(arith | conds, envs)
def test_interpreter_agrees_with_printed_python(e, env):
    assert safe(lambda: E.evaluate(e, env)) == safe(lambda: py_eval(e, env))


@settings(max_examples=200, deadline=None)
@given(arith, envs)
def test_polynomial_equality_is_sound(e, env):
    # a formula is provably equal to its own print/parse, and equal formulas agree everywhere
    src = E.to_source(e)
    assume(len(src) <= MAX_LENGTH)
    other = parse(src)
    assert equal(e, other)
    assert safe(lambda: E.evaluate(e, env)) == safe(lambda: E.evaluate(other, env))


@settings(max_examples=200, deadline=None)
@given(conds, envs)
def test_folding_some_names_keeps_the_value(e, env):
    assume(safe(lambda: E.evaluate(e, env)) is not ZeroDivisionError)  # validate rejects those
    folded = E.fold(e, {"a": env["a"]})
    assert safe(lambda: E.evaluate(folded, env)) == safe(lambda: E.evaluate(e, env))
    assert set(n.id for n in E.names(folded)) <= {"b", "c"}


def test_floor_division_and_cdiv_use_python_integer_semantics():
    env = {"a": -7, "b": 2}
    assert E.evaluate(parse("a // b"), env) == -4
    assert E.evaluate(parse("cdiv(a, b)"), env) == -3
    assert E.evaluate(parse("cdiv(7, 2) * 2"), {}) == 8


def test_fold_decides_flags_and_keeps_the_rest():
    e = parse("variant == 'gpt' and pp_rank == 0")
    assert E.fold(e, {"variant": "gpt"}) == parse("pp_rank == 0")
    assert E.fold(e, {"variant": "glm"}) == E.FALSE
    assert E.fold(parse("variant != 'glm' or pp_size > 1"), {"variant": "gpt"}) == E.TRUE


def test_printing_names_and_calls_for_generated_code():
    e = parse("cdiv(vocab_size, tp_size * pp_size) * (tp_size * pp_size)")
    out = E.to_source(e, name=lambda n: f"c.{n}", call=lambda f: f"rt.{f}")
    assert out == "rt.cdiv(c.vocab_size, c.tp_size * c.pp_size) * (c.tp_size * c.pp_size)"
    assert E.to_source(parse("a - (b - c)")) == "a - (b - c)"
    assert E.to_source(parse("(a - b) - c")) == "a - b - c"


def test_capacity_proofs():
    assert provably_at_least(parse("a * b + a"), parse("a"))
    assert provably_at_least(parse("max(x, y) * b"), parse("b * max(y, x)"))
    assert not provably_at_least(parse("a"), parse("a + 1"))
    assert not provably_at_least(parse("a // 2"), parse("a"))


@pytest.mark.parametrize(
    ("src", "col", "message"),
    [
        (
            "a / 2",
            2,
            "unexpected character '/' (use // for floor division or cdiv(a, b) for ceiling division)",
        ),
        ("a ** 2", 3, "expected a number, name or '(', found '*'"),
        ("a ^ 2", 2, "unexpected character '^'"),
        ("a.b", 1, "unexpected character '.'"),
        ("a[0]", 1, "unexpected character '['"),
        ("f(a)", 0, "unknown function 'f' (known: cdiv, len, max, max_of, min)"),
        ("cdiv(a)", 0, "cdiv() takes 2 arguments, got 1"),
        ("min(a)", 0, "min() takes 2 to 8 arguments, got 1"),
        ("a < b < c", 6, "chained comparisons are not supported; use 'and'"),
        ("(a + b", 6, "expected ')', found end of formula"),
        ("a b", 2, "unexpected 'b' after the end of the formula"),
        ("007", 0, "integer 007 has a leading zero"),
        ("1" * 19, 0, "integer literal is too large"),
        ("", 0, "formula is empty"),
        ("a + " * 70, 0, "formula is longer than 256 characters"),
        ("(" * 40 + "a" + ")" * 40, 32, "formula nests deeper than 32 levels"),
        (
            "__import__('os')",
            0,
            "unknown function '__import__' (known: cdiv, len, max, max_of, min)",
        ),
        ("x.__class__", 1, "unexpected character '.'"),
        ("a and", 5, "expected a number, name or '(', found end of formula"),
        ("lambda: 1", 6, "unexpected character ':'"),
    ],
)
def test_parse_errors_have_a_column_and_a_message(src, col, message):
    with pytest.raises(ExprError) as exc:
        parse(src)
    assert (exc.value.col, exc.value.message) == (col, message)
