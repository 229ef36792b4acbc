"""A project rule's implementation module named like a name the generated module binds (its
imports, classes, methods, their parameters and locals, the builtins it calls): the emitter
imports it under an alias nothing else takes, and the family builds and steps."""

from __future__ import annotations

import ast
import builtins
import importlib.util
import sys
import textwrap

import pytest
from project_spec import with_token_tensors

from bufc.codegen import compile_text, emit, vocab
from bufc.runtime import Request

# ------------------------------------- implementation modules named like a generated name
ALIAS_SPEC = with_token_tensors(
    textwrap.dedent(
        """\
        version: 1
        parameters:
          max_batch_size: {doc: Requests., min: 1}
          max_num_tokens: {doc: Tokens., min: 1}
        sizes:
          num_tokens: {doc: Tokens., max: "max_num_tokens"}
          num_requests: {doc: Requests., max: "max_batch_size"}
        request_checks:
          ages:
            doc: Counts the steps each slot's request has been scheduled.
            impl: MODULE:count_ages
            state: MODULE:Ages
            result: true
        rules:
          slot_ages:
            doc: steps each request has been scheduled, kept per slot between steps
            impl: MODULE:slot_ages
            dtypes: [int32]
            shape: ["num_requests"]
            sizes: [num_requests]
            check: ages
            advance: MODULE:advance_slot_ages
            advance_check: {impl: MODULE:check_next_ages, result: true}
            device_advance: MODULE:device_advance_slot_ages
        families:
          fam: {doc: One project rule with every form.}
        tensors:
          - TOKEN_TENSORS
          - name: host_slot_ages
            doc: Steps each request has been scheduled.
            dtype: int32
            memory: pinned
            capacity: ["max_batch_size"]
            shape: ["num_requests"]
            fill: {rule: slot_ages}
            pad: 0
          - name: slot_ages
            doc: Device copy of host_slot_ages.
            memory: device
            fill: {mirror: host_slot_ages}
            bind: [{input: slot_ages}]
        """
    )
)

ALIAS_RULES = textwrap.dedent(
    """\
    import numpy as np


    class Ages:
        def __init__(self):
            self.by_slot = {}


    def count_ages(b, ages):
        return [ages.by_slot.get(s, 0) + 1 for s in b.seq_slot.tolist()], ages


    def slot_ages(out, b, counted):
        values, ages = counted
        slots = b.seq_slot.tolist()
        ages.by_slot = dict(zip(slots, values))  # every check passed
        out[: len(slots)] = values
        return len(slots)


    def check_next_ages(d, ages):
        return 1


    def advance_slot_ages(out, prev, d, by):
        n = len(d.tokens)
        np.add(prev[:n], by, out=out[:n])
        return n


    def device_advance_slot_ages(out, d):
        out[: len(d.tokens)] += 1
    """
)


def _names() -> list[str]:
    """Every name on the list, and the spec's own names the module binds: the check `ages` (a
    field of State and Checked), the tensor `host_slot_ages` (of Advancing), an index set's."""
    return [*sorted(vocab.GENERATED_NAMES), "ages", "host_slot_ages", "SET_AGES"]


@pytest.fixture(scope="module")
def alias_package(tmp_path_factory):
    """A package `aliaspkg` with one rules module per generated name, on sys.path."""
    root = tmp_path_factory.mktemp("aliases")
    (root / "aliaspkg").mkdir()
    (root / "aliaspkg" / "__init__.py").write_text("")
    for name in _names():
        (root / "aliaspkg" / f"{name}.py").write_text(ALIAS_RULES)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m == "aliaspkg" or m.startswith("aliaspkg.")]:
        del sys.modules[name]


def _bound_names(tree) -> list[str]:
    """Every name the module binds, each time it binds it (imports, classes, functions,
    parameters, assignments, loop and comprehension variables)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out += [(a.asname or a.name).split(".")[0] for a in node.names]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(node.name)
        elif isinstance(node, ast.arg):
            out.append(node.arg)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            out.append(node.id)
    return out


@pytest.mark.parametrize("name", _names())
def test_a_rule_module_named_like_a_generated_name_is_imported_under_a_free_alias(
    alias_package, tmp_path, name
):
    """`impl: aliaspkg.state:fn` (or .s, .c, .Config, .TENSORS, .len, ...): the module is
    imported under an alias that nothing else in the generated module binds, and the family
    builds and steps."""
    module = f"aliaspkg.{name}"
    compiled = compile_text(ALIAS_SPEC.replace("MODULE", module), "buffers.yaml")
    source = emit.render_family(compiled.plans[0], "buffers.yaml")
    tree = ast.parse(source)
    (alias,) = [  # ALIAS = rt.rule_module('aliaspkg.NAME', ...)
        node.targets[0].id
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func) == "rt.rule_module"
        and ast.literal_eval(node.value.args[0]) == module
        and isinstance(node.targets[0], ast.Name)
    ]
    assert alias != name
    assert _bound_names(tree).count(alias) == 1  # its import, and nothing else
    assert f"import {module}" not in source and "from aliaspkg" not in source
    assert not hasattr(builtins, alias)
    for fn in ("count_ages", "Ages", "slot_ages", "check_next_ages", "advance_slot_ages"):
        assert f"{alias}.{fn}" in source
    assert f"{alias}.device_advance_slot_ages(v.slot_ages, d)" in source

    path = tmp_path / "fam.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"aliased_fam_{name}", path)
    assert spec is not None and spec.loader is not None
    fam = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = fam  # dataclasses look their module up
    try:
        spec.loader.exec_module(fam)
        buffers = fam.RuntimeBuffers(fam.Config(max_batch_size=4, max_num_tokens=64))
        c = Request(seq_slot=2, prompt=[1, 2])
        buffers.prepare_step([c], [])
        c.generated = [[4]]
        ages = [buffers.prepare_step([], [c]).inputs["slot_ages"].tolist()]
        ages.append(buffers.advance([5]).inputs["slot_ages"].tolist())
    finally:
        del sys.modules[spec.name]
    assert ages == [[2], [3]]


def test_the_step_fields_a_scalar_may_not_take_are_the_step_records():
    """codegen's STEP_FIELDS (it needs no torch) lists runtime.step.Step's fields and
    properties."""
    import dataclasses

    from bufc.codegen import vocab
    from bufc.runtime.step import Step

    properties = {n for n, v in vars(Step).items() if isinstance(v, property)}
    assert {f.name for f in dataclasses.fields(Step)} | properties == vocab.STEP_FIELDS
