"""A project's spec that extends bufc's built-in one (`extends: bufc`): a built-in family plus a
tensor and a rule of the project's in 28 lines (tests/cases/extended), generated alone and
driven; diagnostics located in the file they come from; `--family` for generate and check;
a family that extends an earlier one of the same file; the schema knows both keys."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from bufc.codegen import extend
from bufc.codegen.errors import SpecError
from bufc.codegen.pipeline import compile_file, compile_text
from bufc.runtime import Request

CASE = REPO / "tests" / "cases" / "extended"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The extended case copied into a folder of its own (its rules module beside it)."""
    shutil.copytree(CASE, tmp_path / "project")
    return tmp_path / "project"


def _bufc(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bufc.codegen", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _diagnostics(text: str) -> list[str]:
    with pytest.raises(SpecError) as exc:
        compile_text(text, "buffers.yaml")
    return [str(d) for d in exc.value.diagnostics]


def test_only_the_projects_family_is_compiled_with_the_builtin_ones_to_extend() -> None:
    compiled = compile_file(str(CASE / "buffers.yaml"))
    assert compiled.family_names == ("my_flash",)
    plan = compiled.plan("my_flash")
    flags = dict(plan.flags)
    assert (flags["engine"], flags["paged_kv_cache"], flags["request_index"]) == (
        "flash",
        True,
        True,
    )
    names = {t.name for t in plan.tensors}
    assert {"host_request_index", "request_index", "query_start_loc", "block_table"} <= names
    builtin = compile_file(str(REPO / "buffers.yaml"), families=["llama_flash"]).plan("llama_flash")
    assert names - {t.name for t in builtin.tensors} == {"host_request_index", "request_index"}


def test_the_extended_family_generates_alone_and_runs_a_step(project: Path) -> None:
    run = _bufc(project, "generate", "--spec", "buffers.yaml", "--out", "myproj/buffers")
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (project / "myproj" / "buffers").glob("*.py")) == [
        "__init__.py",
        "my_flash.py",
    ]
    assert (
        _bufc(project, "check", "--spec", "buffers.yaml", "--out", "myproj/buffers").returncode == 0
    )
    script = """
import numpy as np
from bufc.runtime import Request
from myproj.buffers import my_flash
c = my_flash.Config(max_batch_size=4, max_num_tokens=64, vocab_size=100, num_layers=2,
                    max_attention_window=32, tokens_per_block=4)
b = my_flash.RuntimeBuffers(c)
b.add(Request(2, [1, 2, 3, 4, 5], kv_block_ids=[[1, 2]]))
b.add(Request(0, [6, 7], kv_block_ids=[[3]]))
s = b.step()
print(s.inputs["request_index"].tolist(), s.inputs["query_start_loc"].tolist())
t = np.zeros(4, np.int64); t[[2, 0]] = [9, 8]
print(b.step(t).inputs["request_index"].tolist())
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=project, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[0, 0, 0, 0, 0, 1, 1] [0, 5, 7]", "[0, 1]"]


def test_family_picks_what_generate_writes_and_check_compares(project: Path) -> None:
    gen = ("--spec", "buffers.yaml", "--out", "out", "--family", "llama_flash")
    assert _bufc(project, "generate", *gen).returncode == 0
    assert sorted(p.name for p in (project / "out").glob("*.py")) == [
        "__init__.py",
        "llama_flash.py",
    ]
    assert _bufc(project, "check", *gen).returncode == 0
    stale = _bufc(project, "check", "--spec", "buffers.yaml", "--out", "out")  # my_flash's folder
    assert stale.returncode == 1
    assert "run 'bufc generate --spec buffers.yaml --out out'" in stale.stderr
    bad = _bufc(project, "generate", "--spec", "buffers.yaml", "--out", "out", "--family", "lama")
    assert bad.returncode == 2
    assert bad.stderr.startswith(
        "bufc generate: unknown family 'lama' (did you mean 'llama'?); buffers.yaml defines "
        "my_flash, and bufc's built-in spec gpt, chatglm"
    ), bad.stderr


TEXT = (CASE / "buffers.yaml").read_text()


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        (
            "extends: llama_flash",
            "extends: lama_flash",
            "buffers.yaml:16:14: family 'my_flash' extends 'lama_flash', which is not a family of "
            "bufc/buffers.yaml or an earlier one of this file (did you mean 'llama_flash'?); name "
            "one of them",
        ),
        (
            "  request_index: {doc: Bind",
            "  engine: {doc: Bind",
            "buffers.yaml:5:3: name 'engine' is already declared at bufc/buffers.yaml:",
        ),
        (
            "  my_flash:\n",
            "  llama_flash:\n",
            "buffers.yaml:14:3: family 'llama_flash' is already declared at bufc/buffers.yaml:",
        ),
        (
            "bind: [{input: request_index}]",
            "bind: [{input: positions}]",
            "buffers.yaml:28:123: engine input 'positions' is bound by both 'positions' "
            "(bufc/buffers.yaml:",
        ),
        ("extends: bufc", "extends: vllm", "buffers.yaml:3:10: 'vllm' is not one of bufc"),
    ],
    ids=["unknown_base", "taken_name", "taken_family", "taken_binding", "unknown_spec"],
)
def test_a_mistake_is_located_in_the_file_it_is_in(old: str, new: str, said: str) -> None:
    assert old in TEXT
    found = _diagnostics(TEXT.replace(old, new, 1))
    assert any(d.startswith(said) for d in found), found


def test_a_family_of_a_spec_of_its_own_extends_an_earlier_one() -> None:
    text = (REPO / "tests" / "cases" / "mini" / "buffers.yaml").read_text()
    assert "families:\n  small:" in text
    before = "  again: {doc: The same one., extends: small}\n"
    text = text.replace("families:\n", "families:\n" + before, 1)
    text = text.replace("\ntensors:", "\n  twice: {doc: Once more., extends: small}\ntensors:", 1)
    found = _diagnostics(text)
    assert (
        found
        and "extends 'small', which is not a family of buffers.yaml or an earlier" in (found[0])
    )
    compiled = compile_text(text.replace(before, "", 1), "buffers.yaml")
    assert dict(compiled.plan("twice").flags) == dict(compiled.plan("small").flags)


def test_the_unknown_family_message_lists_both_specs_once_each() -> None:
    assert extend.unknown_family("x", "s.yaml", ("a",), ("b", "c")) == (
        "unknown family 'x'; s.yaml defines a, and bufc's built-in spec b, c"
    )
    assert extend.unknown_family("x", "s.yaml", ("b", "c"), ("b", "c")) == (
        "unknown family 'x'; s.yaml defines b, c"
    )


def test_the_builtin_spec_is_the_repositorys() -> None:
    from bufc.codegen.pipeline import builtin_text

    assert builtin_text() == (REPO / "buffers.yaml").read_text()
    b = Request(0, [1])  # the runtime is importable beside the compiler
    assert b.seq_slot == 0 and np.int64(1) == 1
