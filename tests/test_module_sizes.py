"""The hand-written modules stay small enough to read: none over 700 lines, no function over
120, in the library and in its tests, examples and benchmarks alike (the generated modules are
the generator's output, and are not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("bufc", "codegen", "requests", "rules", "runtime", "tests", "examples", "bench")
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 120


def oversized(path: Path, text: str) -> list[str]:
    """What in one module's `text` is over the bounds, each as 'PATH: what, N lines'."""
    found = []
    lines = text.count("\n")
    if lines > MAX_MODULE_LINES:
        found.append(f"{path}: the module, {lines} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno}: {node.name}(), {n} lines")
    return found


def test_no_hand_written_module_or_function_is_over_its_bound():
    modules = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    assert len(modules) > 40  # the packages were found
    found = [x for p in modules for x in oversized(p.relative_to(REPO), p.read_text("utf-8"))]
    assert not found, "split these:\n" + "\n".join(found)


def test_the_bounds_are_checked():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    long_function = f"def f():\n{body}"
    assert oversized(Path("m.py"), long_function) == ["m.py:1: f(), 121 lines"]
    assert oversized(Path("m.py"), "x = 1\n" * (MAX_MODULE_LINES + 1)) == [
        "m.py: the module, 701 lines"
    ]
    assert oversized(Path("m.py"), "def f():\n    return 1\n") == []
