"""The step's layers as docs/architecture.md draws them: the request layer (``bufc.requests``)
owns the step's records and imports nothing from the rules or the runtime; the rules import the
request layer; the runtime imports both. No module of the three packages imports one that
imports it back (directly or around a circle), and none is longer than a reader can hold."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("requests", "rules", "runtime")
MOST_LINES = 500


def _modules() -> dict[str, Path]:
    return {f"{p}.{f.stem}": f for p in PACKAGES for f in sorted((ROOT / p).glob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of the three packages `name` imports when it runs (not for type checking
    alone)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    out: set[str] = set()
    package = name.split(".")[0]
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not node.level or id(node) in typing_only:
            continue
        module = node.module or ""
        if node.level == 1:
            base = package
        else:  # from ..pkg.mod import x
            base, _, module = module.partition(".")
        if module:
            out.add(f"{base}.{module.split('.')[0]}")
        else:
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, f, set(mods)) for m, f in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("lower, upper", [("requests", "rules"), ("requests", "runtime")])
def test_the_request_layer_imports_nothing_above_it(lower: str, upper: str) -> None:
    wrong = {
        m: sorted(n for n in deps if n.startswith(f"{upper}."))
        for m, deps in _graph().items()
        if m.startswith(f"{lower}.")
    }
    assert not {m: v for m, v in wrong.items() if v}


def test_no_hand_written_step_module_is_longer_than_most_lines() -> None:
    long = {
        m: n for m, f in _modules().items() if (n := len(f.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"split these modules (over {MOST_LINES} lines): {long}"
