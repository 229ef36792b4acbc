"""A project declares its own fill rule in its buffers.yaml (implementation by import path) and
gets it validated, generated and run like a built-in one, without an edit to bufc."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from bufc.codegen import SpecError, compile_text
from bufc.runtime import BatchError, Request

SPEC = textwrap.dedent(
    """\
    version: 1
    flags:
      flash: {doc: The engine reads cumulative query lengths., type: bool, default: true}
    parameters:
      max_batch_size: {doc: Requests., min: 1}
      max_num_tokens: {doc: Tokens., min: 1}
    sizes:
      num_tokens: {doc: Tokens., max: "max_num_tokens"}
      num_sequences: {doc: Sequences., max: "max_batch_size"}
      num_requests: {doc: Requests., max: "max_batch_size"}
    request_checks:
      short_queries:
        doc: No sequence feeds more than max_query_tokens tokens.
        impl: mypkg.rules:check_short_queries
        reads: [max_num_tokens]
        result: true
      ages:
        doc: Counts the steps each slot's request has been scheduled.
        impl: mypkg.rules:count_ages
        state: mypkg.rules:Ages
        result: true
    rules:
      query_start_loc:
        doc: cumulative query lengths, FlashAttention's cu_seqlens_q
        impl: mypkg.rules:query_start_loc
        dtypes: [int32]
        shape: ["num_sequences + 1"]
        sizes: [num_sequences]
        check: short_queries
      slot_ages:
        doc: steps each request has been scheduled, kept per slot between steps
        impl: mypkg.rules:slot_ages
        dtypes: [int32]
        shape: ["num_requests"]
        sizes: [num_requests]
        check: ages
        advance: mypkg.rules:advance_slot_ages
    families:
      fam: {doc: A decoder with a FlashAttention-style input.}
      steady: {doc: The same without it (so it can advance)., flags: {flash: false}}
    tensors:
      - name: host_input_ids
        doc: Token ids.
        dtype: int32
        memory: pinned
        capacity: ["max_num_tokens"]
        shape: ["num_tokens"]
        fill: {rule: token_ids}
        pad: 0
      - name: input_ids
        doc: Token ids on the device.
        memory: device
        fill: {mirror: host_input_ids}
        bind: [{input: input_ids}]
      - name: host_query_start_loc
        doc: Where each sequence's queries start in the packed tokens.
        dtype: int32
        memory: pinned
        capacity: ["max_batch_size + 1"]
        shape: ["num_sequences + 1"]
        fill: {rule: query_start_loc}
        pad: 0
        when: flash
      - name: query_start_loc
        doc: Device copy of host_query_start_loc.
        memory: device
        fill: {mirror: host_query_start_loc}
        bind: [{input: cu_seqlens_q}]
      - name: host_slot_ages
        doc: Steps each request has been scheduled.
        dtype: int32
        memory: host
        capacity: ["max_batch_size"]
        shape: ["num_requests"]
        fill: {rule: slot_ages}
        pad: 0
        bind: [{input: host_slot_ages}]
    """
)

RULES = textwrap.dedent(
    """\
    import numpy as np

    from bufc.runtime import BatchError


    def check_short_queries(b, *, max_num_tokens):
        lengths = np.concatenate((b.ctx_input_len, b.per_sequence(1 + b.gen_drafts)))
        if len(lengths) and lengths.max() > max_num_tokens:
            raise BatchError("a query is too long")
        return lengths


    def query_start_loc(out, b, lengths):
        n = b.sizes.num_sequences
        out[0] = 0
        np.cumsum(lengths, out=out[1 : n + 1])
        return n + 1


    class Ages:
        def __init__(self):
            self.by_slot = {}


    def count_ages(b, ages):
        slots = b.seq_slot.tolist()
        return [ages.by_slot.get(s, 0) + 1 for s in slots], ages


    def slot_ages(out, b, counted):
        values, ages = counted
        ages.by_slot = dict(zip(slots := b.seq_slot.tolist(), values))  # every check passed
        out[: len(slots)] = values
        return len(slots)


    def advance_slot_ages(out, prev, d):
        n = len(d.tokens)
        np.add(prev[:n], 1, out=out[:n])
        return n
    """
)

DRIVER = textwrap.dedent(
    """\
    import json
    from bufc.runtime import BatchError, Request
    from generated import fam, steady as fam_steady

    buffers = fam.RuntimeBuffers(fam.Config(max_batch_size=4, max_num_tokens=64))
    a = Request(seq_slot=0, prompt=[1, 2, 3, 4, 5])
    b = Request(seq_slot=1, prompt=[6, 7], context_chunk_size=1)
    step = buffers.prepare_step([a, b], [])
    first = step.inputs["cu_seqlens_q"].tolist()
    a.generated = [[9]]
    step = buffers.prepare_step([], [a])
    second = step.inputs["cu_seqlens_q"].tolist()
    try:
        buffers.advance([3])
        message = None
    except BatchError as exc:
        message = str(exc)
    steady = fam_steady.RuntimeBuffers(fam_steady.Config(max_batch_size=4, max_num_tokens=64))
    c = Request(seq_slot=2, prompt=[1, 2])
    steady.prepare_step([c], [])
    c.generated = [[4]]
    ages = [steady.prepare_step([], [c]).inputs["host_slot_ages"].tolist()]
    ages.append(steady.advance([5]).inputs["host_slot_ages"].tolist())
    ages.append(steady.advance([6]).inputs["host_slot_ages"].tolist())
    print(json.dumps({"first": first, "second": second, "advance": message, "ages": ages}))
    """
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "rules.py").write_text(RULES)
    (tmp_path / "buffers.yaml").write_text(SPEC)
    return tmp_path


def test_a_project_rule_is_generated_and_run_like_a_built_in_one(project: Path):
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "bufc.codegen",
            "generate",
            "--spec",
            "buffers.yaml",
            "--out",
            "generated",
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert gen.returncode == 0, gen.stderr
    source = (project / "generated" / "fam.py").read_text()
    assert "from mypkg import rules" in source
    assert (
        "rules.query_start_loc(\n                t.host_query_start_loc.out,\n                b,\n                k.short_queries,\n"
        in source
    )
    assert "short_queries=rules.check_short_queries(b, max_num_tokens=c.max_num_tokens)" in source
    run = subprocess.run(
        [sys.executable, "-c", DRIVER],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["first"] == [0, 5, 6]  # the whole prompt, then a one-token chunk
    assert out["second"] == [0, 1]
    # a rule without an advance form: advance() names it
    assert out["advance"] == (
        "advance() is not available for this family: its fill rule(s) query_start_loc have no "
        "advance form; use prepare_step"
    )
    # a family without it advances, its stateful check's state kept between steps
    assert out["ages"] == [[2], [3], [4]]


def _builtin_line(rule: str) -> int:
    from bufc.codegen.pipeline import builtin_contracts

    found = builtin_contracts().rule(rule)
    assert found is not None
    return found.loc.line


def _errors(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        compile_text(text, "buffers.yaml")
    return [str(d) for d in info.value.diagnostics]


def test_a_project_rule_gets_located_diagnostics():
    reads = SPEC.replace(
        "    sizes: [num_sequences]\n",
        "    sizes: [num_sequences]\n    reads: [max_query_tokens]\n",
    )
    assert _errors(reads) == [
        "buffers.yaml:62:18: fill rule 'query_start_loc' reads 'max_query_tokens' from the "
        "Config; declare it as a parameter or derived value"
    ]
    check = SPEC.replace("check: short_queries", "check: short_query")
    assert _errors(check) == [
        "buffers.yaml:29:5: rule 'query_start_loc' names the request check 'short_query', "
        "which is not declared (did you mean 'short_queries'?); declare it under request_checks"
    ]
    clash = SPEC.replace(
        "  query_start_loc:\n    doc: cumulative", "  token_ids:\n    doc: cumulative"
    )
    assert _errors(clash) == [
        "buffers.yaml:23:3: rule 'token_ids' is already declared (a built-in rule at "
        f"rules/builtin.yaml:{_builtin_line('token_ids')}); choose another name"
    ]
    keyword = SPEC.replace("impl: mypkg.rules:query_start_loc", "impl: mypkg.class:query_start_loc")
    assert _errors(keyword) == [
        "buffers.yaml:25:11: 'mypkg.class:query_start_loc' cannot be imported: 'class' is a "
        "Python keyword; rename the module or function"
    ]
    size = SPEC.replace("sizes: [num_sequences]", "sizes: [num_sequence]")
    assert _errors(size) == [
        "buffers.yaml:28:5: rule 'query_start_loc' reads the step size 'num_sequence', which "
        "the runtime does not compute (did you mean 'num_sequences'?)"
    ]


def test_a_request_check_name_must_be_usable_in_generated_code():
    text = SPEC.replace("  short_queries:\n", "  class:\n").replace(
        "check: short_queries", "check: class"
    )
    assert _errors(text) == [
        "buffers.yaml:12:3: request check name 'class' is reserved; choose another name"
    ]


# ------------------------------------------------------------- a fill's returned count
COUNT_SPEC = textwrap.dedent(
    """\
    version: 1
    parameters:
      max_batch_size: {doc: Requests., min: 1}
      max_num_tokens: {doc: Tokens., min: 1}
    sizes:
      num_tokens: {doc: Tokens., max: "max_num_tokens"}
      num_sequences: {doc: Sequences., max: "max_batch_size"}
    rules:
      marks:
        doc: one mark per input token
        impl: countpkg.rules:marks
        dtypes: [int32]
        shape: ["num_tokens"]
        sizes: [num_tokens]
        advance: countpkg.rules:advance_marks
    families:
      fam: {doc: A decoder with a project tensor.}
    tensors:
      - name: host_input_ids
        doc: Token ids.
        dtype: int32
        memory: pinned
        capacity: ["max_num_tokens"]
        shape: ["num_tokens"]
        fill: {rule: token_ids}
        pad: 0
      - name: input_ids
        doc: Token ids on the device.
        memory: device
        fill: {mirror: host_input_ids}
        bind: [{input: input_ids}]
      - name: host_marks
        doc: A mark per token.
        dtype: int32
        memory: pinned
        capacity: ["max_num_tokens"]
        shape: ["num_tokens"]
        fill: {rule: marks}
        pad: -1
      - name: marks
        doc: Device copy of host_marks.
        memory: device
        fill: {mirror: host_marks}
        bind: [{input: marks}]
    """
)

COUNT_RULES = textwrap.dedent(
    """\
    import numpy as np

    COUNT = None  # the test's bad count: COUNT(n, len(out)) instead of n


    def marks(out, b):
        n = b.sizes.num_tokens
        out[:n] = np.arange(7, 7 + n)
        return n if COUNT is None else COUNT(n, len(out))


    def advance_marks(out, prev, d):
        n = len(d.tokens)
        np.add(prev[:n], 1, out=out[:n])
        return n if COUNT is None else COUNT(n, len(out))
    """
)

BAD_COUNTS = {
    "-1": lambda n, size: -1,
    "3.0": lambda n, size: 3.0,
    "1000000000000000000": lambda n, size: 10**18,
    "True": lambda n, size: True,
    "21": lambda n, size: size + 5,  # len(out) + 5
    "None": lambda n, size: None,
    "np.float64(3.0)": lambda n, size: np.float64(3),
    "np.int64(-2)": lambda n, size: np.int64(-2),
}


@pytest.fixture
def counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The generated module of COUNT_SPEC and its rules module (countpkg.rules)."""
    from bufc.codegen import emit

    (tmp_path / "countpkg").mkdir()
    (tmp_path / "countpkg" / "__init__.py").write_text("")
    (tmp_path / "countpkg" / "rules.py").write_text(COUNT_RULES)
    (tmp_path / "count_fam.py").write_text(emit.render_all(compile_text(COUNT_SPEC))["fam.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("countpkg", "countpkg.rules", "count_fam"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    fam = importlib.import_module("count_fam")
    rules = importlib.import_module("countpkg.rules")
    yield fam, rules
    for name in ("countpkg", "countpkg.rules", "count_fam"):
        sys.modules.pop(name, None)


def _same_tensors(a, b) -> None:
    ta, tb = a.tensors, b.tensors
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


@pytest.mark.parametrize("shown", BAD_COUNTS)
def test_a_project_fill_that_returns_a_bad_count_is_named_and_its_step_abandoned(counted, shown):
    fam, rules = counted
    config = fam.Config(max_batch_size=4, max_num_tokens=16)
    buffers, twin = fam.RuntimeBuffers(config), fam.RuntimeBuffers(config)
    for b in (buffers, twin):  # a long step: its rows past the next ones must be re-padded
        b.prepare_step([Request(seq_slot=0, prompt=list(range(1, 9)))], [])
    rules.COUNT = BAD_COUNTS[shown]
    with pytest.raises(BatchError) as info:
        buffers.prepare_step([Request(seq_slot=1, prompt=[4, 5, 6])], [])
    assert str(info.value) == (
        f"fill of tensor 'host_marks' (rule countpkg.rules:marks) returned {shown}; a fill "
        "returns the number of elements it wrote, an int in 0..16. The step was abandoned "
        "and the last step stays current"
    )
    _same_tensors(buffers, twin)  # the last step stays current
    rules.COUNT = None
    generation = Request(seq_slot=2, prompt=[3, 4], generated=[[5]])
    for b in (buffers, twin):  # a shorter step
        b.prepare_step([], [generation])
    _same_tensors(buffers, twin)

    # the same from the rule's advance form
    rules.COUNT = BAD_COUNTS[shown]
    with pytest.raises(BatchError) as info:
        buffers.advance([6])
    assert str(info.value) == (
        "advance(): the advance form of rule countpkg.rules:marks (tensor 'host_marks') "
        f"returned {shown}; an advance form returns the number of elements it wrote, an int "
        "in 0..16. The step was abandoned and the last step stays current"
    )
    _same_tensors(buffers, twin)
    rules.COUNT = None
    for b in (buffers, twin):
        b.advance([6])
    _same_tensors(buffers, twin)


def test_a_project_fill_may_count_in_a_numpy_integer(counted):
    fam, rules = counted
    buffers = fam.RuntimeBuffers(fam.Config(max_batch_size=4, max_num_tokens=16))
    rules.COUNT = lambda n, size: np.int32(n)
    step = buffers.prepare_step([Request(seq_slot=0, prompt=[1, 2, 3])], [])
    assert step.inputs["marks"].tolist() == [7, 8, 9]
