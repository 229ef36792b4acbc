"""One home for the rule contract: every implementation takes exactly the Config values its
declaration in rules/builtin.yaml lists, and reads only the step sizes it declares."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

from bufc.codegen import contract
from bufc.codegen import expr as E
from bufc.codegen.model import Impl, RequestCheck, Rule
from bufc.codegen.pipeline import builtin_contracts


def _load(impl: Impl) -> Callable[..., Any]:
    fn: Callable[..., Any] = getattr(importlib.import_module(impl.module), impl.name)
    return fn


def contract_problems(rules: tuple[Rule, ...], checks: tuple[RequestCheck, ...]) -> list[str]:
    """Every difference between the declarations and the implementations' signatures: the
    check `bufc validate --import` and `bufc generate` run on a spec's own rules
    (bufc.codegen.contract), here on bufc's own, which the generator does not import."""
    return [d.message for d in contract.problems(contract.calls(rules, checks))]


def _sizes_read(fn: Callable[..., Any], seen: set[str] | None = None) -> set[str]:
    """Step sizes `fn` reads (`X.sizes.NAME`), following the calls to functions of its own
    module (helpers), transitively."""
    seen = set() if seen is None else seen
    if fn.__qualname__ in seen:
        return set()
    seen.add(fn.__qualname__)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    module = importlib.import_module(fn.__module__)
    out: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "sizes"
        ):
            out.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            helper = getattr(module, node.func.id, None)
            if inspect.isfunction(helper) and helper.__module__ == fn.__module__:
                out |= _sizes_read(helper, seen)
    return out


def sizes_problems(rules: tuple[Rule, ...], checks: tuple[RequestCheck, ...]) -> list[str]:
    by_name = {c.name: c for c in checks}
    out = []
    for r in rules:
        shape = {n.id for f in r.shape for n in E.names(f.expr)}
        read = _sizes_read(_load(r.impl)) - set(r.sizes) - shape
        if read:
            out.append(f"rule {r.name} reads step sizes {sorted(read)} it does not declare")
        check = by_name.get(r.check or "")
        if check is not None:
            read = _sizes_read(_load(check.impl)) - set(check.sizes)
            if read:
                out.append(
                    f"check {check.name} reads step sizes {sorted(read)} it does not declare"
                )
    return out


BUILTIN = builtin_contracts()


def test_every_implementation_takes_exactly_the_config_values_it_declares():
    assert contract_problems(BUILTIN.rules, BUILTIN.request_checks) == []


def test_every_implementation_reads_only_the_step_sizes_it_declares():
    assert sizes_problems(BUILTIN.rules, BUILTIN.request_checks) == []


def _with_reads(check: str, reads: tuple[str, ...]) -> tuple[RequestCheck, ...]:
    return tuple(
        dataclasses.replace(c, reads=reads) if c.name == check else c
        for c in BUILTIN.request_checks
    )


def test_the_drift_test_fails_on_an_undeclared_config_value():
    """The defect of issue 12: the prompt-tuning check read model_dtype and hidden_size
    without declaring them. Dropping one from the declaration is caught."""
    (prompt,) = [c for c in BUILTIN.request_checks if c.name == "prompt_tables"]
    fewer = tuple(n for n in prompt.reads if n != "model_dtype")
    problems = contract_problems(BUILTIN.rules, _with_reads("prompt_tables", fewer))
    assert problems == [
        "request check 'prompt_tables' names bufc.rules.features:check_prompt_tables(b, *, "
        "hidden_size, max_prompt_vocab_size, model_dtype, vocab_size), whose keyword parameter "
        "model_dtype its declaration's reads do not pass; add model_dtype to reads, or remove "
        "the parameter"
    ]


def test_the_drift_test_fails_on_an_undeclared_step_size():
    rules = tuple(
        dataclasses.replace(r, sizes=()) if r.name == "token_ids" else r for r in BUILTIN.rules
    )
    assert sizes_problems(rules, BUILTIN.request_checks) == [
        "rule token_ids reads step sizes ['num_generation_tokens'] it does not declare"
    ]


@pytest.mark.parametrize("rule", [r.name for r in BUILTIN.rules])
def test_each_built_in_rule_is_documented_in_spec_md(rule):
    from pathlib import Path

    spec_md = (Path(__file__).parent.parent / "docs" / "spec.md").read_text()
    assert f"| `{rule}` |" in spec_md


def test_the_runtime_names_no_tensor_and_no_rule():
    """bufc.runtime is the machinery every family shares: what a family has and what its step
    does are in its generated module and in bufc.rules."""
    import re
    from pathlib import Path

    from bufc.codegen import compile_file

    root = Path(__file__).parent.parent
    spec = compile_file(str(root / "buffers.yaml"), "buffers.yaml").spec
    names = {t.name for t in spec.tensors} | {r.name for r in spec.rules}
    names |= {c.name for c in spec.request_checks}
    found = [
        f"{path.name}: {name}"
        for path in sorted((root / "runtime").glob("*.py"))
        for name in sorted(names)
        if re.search(rf"\b{name}\b", path.read_text())
    ]
    assert found == []
