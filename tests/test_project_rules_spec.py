"""A project declares its own fill rule in its buffers.yaml (implementation by import path) and
gets it validated, generated and run like a built-in one, without an edit to bufc: its located
diagnostics, `bufc validate --import`, and a generated module whose implementation is missing."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from project_spec import with_token_tensors

from bufc.codegen import SpecError, compile_text

SPEC = with_token_tensors(
    textwrap.dedent(
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
          cu_seqlens_q:
            doc: cumulative query lengths, FlashAttention's cu_seqlens_q
            impl: mypkg.rules:cu_seqlens_q
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
          - TOKEN_TENSORS
          - name: host_cu_seqlens_q
            doc: Where each sequence's queries start in the packed tokens.
            dtype: int32
            memory: pinned
            capacity: ["max_batch_size + 1"]
            shape: ["num_sequences + 1"]
            fill: {rule: cu_seqlens_q}
            pad: 0
            when: flash
          - name: cu_seqlens_q
            doc: Device copy of host_cu_seqlens_q.
            memory: device
            fill: {mirror: host_cu_seqlens_q}
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


    def cu_seqlens_q(out, b, lengths):
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
    assert "rules = rt.rule_module(\n    'mypkg.rules',\n" in source  # missing: names the line
    assert "    ('slot_ages', 'function', \"buffers.yaml:32:11: rule 'slot_ages'\"),\n" in source
    call = r"rules\.cu_seqlens_q\(\s*t\.host_cu_seqlens_q\.out,\s*b,\s*k\.short_queries[,)]"
    assert re.search(call, source)
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
        "advance() is not available for this family: its fill rule(s) cu_seqlens_q have no "
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
        "buffers.yaml:62:18: fill rule 'cu_seqlens_q' reads 'max_query_tokens' from the "
        "Config; declare it as a parameter or derived value"
    ]
    check = SPEC.replace("check: short_queries", "check: short_query")
    assert _errors(check) == [
        "buffers.yaml:29:5: rule 'cu_seqlens_q' names the request check 'short_query', "
        "which is not declared (did you mean 'short_queries'?); declare it under request_checks"
    ]
    clash = SPEC.replace(
        "  cu_seqlens_q:\n    doc: cumulative", "  token_ids:\n    doc: cumulative"
    )
    assert _errors(clash) == [
        "buffers.yaml:23:3: rule 'token_ids' is already declared (a built-in rule at "
        f"rules/builtin.yaml:{_builtin_line('token_ids')}); choose another name"
    ]
    keyword = SPEC.replace("impl: mypkg.rules:cu_seqlens_q", "impl: mypkg.class:cu_seqlens_q")
    assert _errors(keyword) == [
        "buffers.yaml:25:11: 'mypkg.class:cu_seqlens_q' cannot be imported: 'class' is a "
        "Python keyword; rename the module or function"
    ]
    orphan = SPEC.replace(
        "    check: short_queries\n",
        "    check: short_queries\n    advance_check:\n      impl: mypkg.rules:cu_seqlens_q\n",
    )
    assert _errors(orphan) == [
        "buffers.yaml:30:5: rule 'cu_seqlens_q' has no advance form; add 'advance' or drop this key"
    ]
    gone = SPEC.replace(
        "    check: short_queries\n",
        "    check: short_queries\n    continue: mypkg.rules:cu_seqlens_q\n",
    )
    assert _errors(gone) == [
        "buffers.yaml:30:5: 'continue' is no longer a rule key: every in-flight step runs the "
        "rule's fill (no continue forms since generated format 6); drop this key and its "
        "function"
    ]
    size = SPEC.replace("sizes: [num_sequences]", "sizes: [num_sequence]")
    assert _errors(size) == [
        "buffers.yaml:28:5: rule 'cu_seqlens_q' reads the step size 'num_sequence', which "
        "the runtime does not compute (did you mean 'num_sequences'?)"
    ]


def test_a_request_check_name_must_be_usable_in_generated_code():
    text = SPEC.replace("  short_queries:\n", "  class:\n").replace(
        "check: short_queries", "check: class"
    )
    assert _errors(text) == [
        "buffers.yaml:12:3: request check name 'class' is reserved; choose another name"
    ]


# ------------------------------------------- implementations resolved: bufc validate --import
@pytest.fixture
def in_project(project: Path, monkeypatch: pytest.MonkeyPatch):
    """The project as the current directory, its package imported afresh (and forgotten)."""
    monkeypatch.chdir(project)
    _forget("mypkg")
    yield project
    _forget("mypkg")


def _forget(package: str) -> None:
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]


def _validate(capsys, *argv: str) -> tuple[int, str, str]:
    from bufc.codegen.cli import main

    code = main(["validate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _imported_errors(capsys, project: Path, spec: str = SPEC, rules: str = RULES) -> list[str]:
    """`bufc validate --import buffers.yaml` on the project with this spec and rules module:
    exit 1, its diagnostics (one line each, then the count)."""
    (project / "buffers.yaml").write_text(spec)
    (project / "mypkg" / "rules.py").write_text(rules)
    _forget("mypkg")  # as a new process would
    code, out, err = _validate(capsys, "--import", "buffers.yaml")
    assert (code, out) == (1, ""), err
    *lines, count = err.splitlines()
    assert count == f"{len(lines)} error(s)"
    return lines


def test_validate_imports_nothing_without_import(in_project: Path, capsys):
    (in_project / "mypkg" / "rules.py").write_text("raise SystemExit('imported')\n")
    assert _validate(capsys, "buffers.yaml") == (0, "buffers.yaml: ok\n", "")
    assert "mypkg" not in sys.modules


def test_validate_import_passes_a_project_whose_implementations_take_their_calls(
    in_project: Path, capsys
):
    assert _validate(capsys, "--import", "buffers.yaml") == (0, "buffers.yaml: ok\n", "")
    assert "mypkg.rules" in sys.modules


def test_a_typo_in_an_impl_module_is_a_located_error(in_project: Path, capsys):
    spec = SPEC.replace("impl: mypkg.rules:cu_seqlens_q", "impl: mypkg.rulez:cu_seqlens_q")
    assert _imported_errors(capsys, in_project, spec) == [
        "buffers.yaml:25:11: rule 'cu_seqlens_q' names mypkg.rulez:cu_seqlens_q, but there "
        "is no module mypkg.rulez (did you mean 'mypkg.rules'?); fix the impl path or install "
        "mypkg"
    ]
    spec = SPEC.replace("impl: mypkg.rules:cu_seqlens_q", "impl: mypgk.rules:cu_seqlens_q")
    assert _imported_errors(capsys, in_project, spec) == [
        "buffers.yaml:25:11: rule 'cu_seqlens_q' names mypgk.rules:cu_seqlens_q, but there "
        "is no module mypgk; fix the impl path or install mypgk"
    ]


def test_a_typo_in_an_impl_function_is_a_located_error(in_project: Path, capsys):
    spec = SPEC.replace("impl: mypkg.rules:cu_seqlens_q", "impl: mypkg.rules:cu_seqlens_w")
    spec = spec.replace("state: mypkg.rules:Ages", "state: mypkg.rules:Age")
    assert _imported_errors(capsys, in_project, spec) == [
        "buffers.yaml:20:12: the state of request check 'ages' names mypkg.rules:Age, but "
        "mypkg.rules has no class Age (did you mean 'Ages'?); fix the impl path or define Age "
        "in mypkg.rules",
        "buffers.yaml:25:11: rule 'cu_seqlens_q' names mypkg.rules:cu_seqlens_w, but "
        "mypkg.rules has no function cu_seqlens_w (did you mean 'cu_seqlens_q'?); fix the "
        "impl path or define cu_seqlens_w in mypkg.rules",
    ]


def test_a_module_that_fails_to_import_is_a_located_error(in_project: Path, capsys):
    rules = "import mypkg_helpers  # not installed\n" + RULES
    assert _imported_errors(capsys, in_project, rules=rules)[0] == (
        "buffers.yaml:14:11: request check 'short_queries' names mypkg.rules:check_short_queries, "
        "but importing mypkg.rules raised ModuleNotFoundError: No module named 'mypkg_helpers'; "
        "install mypkg_helpers, which mypkg.rules imports"
    )
    rules = RULES + "\n1 / 0\n"
    assert _imported_errors(capsys, in_project, rules=rules)[0] == (
        "buffers.yaml:14:11: request check 'short_queries' names mypkg.rules:check_short_queries, "
        "but importing mypkg.rules raised ZeroDivisionError: division by zero; fix mypkg.rules"
    )
    rules = RULES + "\nimport sys\nsys.exit(0)\n"  # an import that exits: no silent stop
    assert _imported_errors(capsys, in_project, rules=rules)[0] == (
        "buffers.yaml:14:11: request check 'short_queries' names mypkg.rules:check_short_queries, "
        "but importing mypkg.rules raised SystemExit: 0; fix mypkg.rules"
    )
    rules = RULES + "\ndef __getattr__(name):\n    raise KeyError(name)\n"  # a lookup that raises
    spec = SPEC.replace("impl: mypkg.rules:cu_seqlens_q", "impl: mypkg.rules:cu_seqlens_w")
    assert _imported_errors(capsys, in_project, spec, rules) == [
        "buffers.yaml:25:11: rule 'cu_seqlens_q' names mypkg.rules:cu_seqlens_w, but looking up "
        "cu_seqlens_w in mypkg.rules raised KeyError: 'cu_seqlens_w'; fix mypkg.rules"
    ]


def test_a_project_signature_that_takes_its_call_another_way_passes(in_project: Path, capsys):
    """A project's function need only accept the call: a read that is not keyword-only, a
    parameter with a default, **kwargs (bufc's own keep the exact form)."""
    rules = RULES.replace(
        "def slot_ages(out, b, counted):", "def slot_ages(out, b, counted, scale=1, **extra):"
    )
    rules = rules.replace(
        "def check_short_queries(b, *, max_num_tokens):",
        "def check_short_queries(b, max_num_tokens):",
    )
    assert rules != RULES and rules.count("scale=1") == 1
    assert "def check_short_queries(b, max_num_tokens):" in rules
    (in_project / "mypkg" / "rules.py").write_text(rules)
    assert _validate(capsys, "--import", "buffers.yaml") == (0, "buffers.yaml: ok\n", "")


def test_a_signature_that_does_not_take_its_call_is_a_located_error(in_project: Path, capsys):
    # a Config value the declaration reads, which the function does not take
    spec = SPEC.replace("reads: [max_num_tokens]", "reads: [max_num_tokens, max_batch_size]")
    # the advance form without `prev`; a fill with a keyword parameter nothing declares
    rules = RULES.replace("def advance_slot_ages(out, prev, d):", "def advance_slot_ages(out, d):")
    rules = rules.replace(
        "def slot_ages(out, b, counted):", "def slot_ages(out, b, counted, *, n):"
    )
    rules = rules.replace("def __init__(self):", "def __init__(self, size):")
    assert _imported_errors(capsys, in_project, spec, rules) == [
        "buffers.yaml:14:11: request check 'short_queries' names "
        "mypkg.rules:check_short_queries(b, *, max_num_tokens), which takes no keyword parameter "
        "max_batch_size, but its declaration's reads pass it (max_batch_size=c.max_batch_size); "
        "add it after '*', or drop it from reads",
        "buffers.yaml:20:12: the state of request check 'ages' names mypkg.rules:Ages(size), "
        "which cannot be made without arguments, as the family's State makes it; give its "
        "parameters defaults",
        "buffers.yaml:32:11: rule 'slot_ages' names mypkg.rules:slot_ages(out, b, counted, *, n), "
        "whose keyword parameter n its declaration's reads do not pass; add n to reads, or "
        "remove the parameter",
        "buffers.yaml:37:14: the advance form of rule 'slot_ages' names "
        "mypkg.rules:advance_slot_ages(out, d), which takes 2 positional parameters, but the step "
        "passes 3 (out, the last step's values, the decode step); give it 3 before '*', or "
        "change the declaration",
    ]
    # a rule whose check hands on no result: its fill is passed one argument fewer
    spec = SPEC.replace("    result: true\n  ages:", "  ages:")
    assert _imported_errors(capsys, in_project, spec) == [
        "buffers.yaml:24:11: rule 'cu_seqlens_q' names mypkg.rules:cu_seqlens_q(out, b, "
        "lengths), which takes 3 positional parameters, but the step passes 2 (out, the batch); "
        "give it 2 before '*', or change the declaration"
    ]


def test_generate_imports_the_implementations_and_writes_nothing_when_one_is_missing(
    in_project: Path, capsys
):
    from bufc.codegen.cli import main

    spec = SPEC.replace("impl: mypkg.rules:cu_seqlens_q", "impl: mypkg.rules:cu_seqlens_w")
    (in_project / "buffers.yaml").write_text(spec)
    assert main(["generate", "--out", "generated"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(
        "buffers.yaml:25:11: rule 'cu_seqlens_q' names mypkg.rules:cu_seqlens_w, but "
        "mypkg.rules has no function cu_seqlens_w"
    )
    assert not (in_project / "generated").exists()


# ------------------------------------------ a generated module whose implementation is missing
def _import_generated(project: Path, name: str):
    """The family `fam` of SPEC rendered (no implementation imported) into `name`.py and
    imported, with the project on sys.path."""
    from bufc.codegen import emit

    (project / f"{name}.py").write_text(emit.render_all(compile_text(SPEC))["fam.py"])
    sys.path.insert(0, str(project))
    try:
        importlib.invalidate_caches()
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(project))
        sys.modules.pop(name, None)


def test_a_missing_implementation_module_is_an_import_error_naming_the_spec_line(
    in_project: Path,
):
    (in_project / "mypkg" / "rules.py").unlink()
    with pytest.raises(ImportError) as info:
        _import_generated(in_project, "fam_no_module")
    assert str(info.value) == (
        "buffers.yaml:14:11: request check 'short_queries' names mypkg.rules:check_short_queries, "
        "but there is no module mypkg.rules; fix the impl path or install mypkg"
    )
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_a_missing_implementation_function_is_an_import_error_naming_the_spec_line(
    in_project: Path,
):
    rules = RULES.replace("def slot_ages(", "def slot_age(")
    (in_project / "mypkg" / "rules.py").write_text(rules)
    with pytest.raises(ImportError) as info:
        _import_generated(in_project, "fam_no_function")
    assert str(info.value) == (
        "buffers.yaml:32:11: rule 'slot_ages' names mypkg.rules:slot_ages, but mypkg.rules has "
        "no function slot_ages (did you mean 'slot_age'?); fix the impl path or define "
        "slot_ages in mypkg.rules"
    )
    (in_project / "mypkg" / "rules.py").write_text(RULES)
    _forget("mypkg")
    fam = _import_generated(in_project, "fam_whole")
    assert [p.what for p in fam.RuntimeBuffers.project_impls] == [
        "request check 'short_queries'",
        "request check 'ages'",
        "rule 'cu_seqlens_q'",
        "rule 'slot_ages'",
        "the advance form of rule 'slot_ages'",
    ]
