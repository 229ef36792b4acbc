"""`bufc report` runs no project code unless asked: a `derive:` function of the spec's own is
imported and called only with --import (bufc's own derivations, the KV pools, always run).
Without it, a value that needs one is an error naming its line, the function and the flag;
with it, a module that cannot be imported or a function that raises is a located error, not a
traceback. The canary module's top-level code proves what ran."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ["--set", "max_batch_size=8", "--set", "max_num_tokens=256", "--set", "vocab_size=100"]
SETTINGS += ["--set", "num_layers=4", "--set", "max_attention_window=512"]
CANARY = """
import pathlib
pathlib.Path("canary-ran").write_text("imported")

def widest_window(*, max_attention_window, attention_windows=()):
    return max(attention_windows, default=max_attention_window)

def boom(*, max_attention_window, attention_windows=()):
    raise RuntimeError("no")
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder: bufc's spec with one derivation moved to a canary module of its own."""
    text = (REPO / "buffers.yaml").read_text()
    old = "derive: bufc.rules.pools:widest_window"
    assert text.count(old) == 1
    (tmp_path / "buffers.yaml").write_text(text.replace(old, "derive: canarymod:widest_window"))
    (tmp_path / "canarymod.py").write_text(CANARY)
    return tmp_path


def _report(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "bufc.codegen", "report", "llama", *SETTINGS, *extra]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_report_imports_no_project_code_without_the_flag(project: Path) -> None:
    run = _report(project)
    assert run.returncode == 1, run.stderr
    line = next(
        n for n, s in enumerate((project / "buffers.yaml").read_text().splitlines(), 1)
        if "canarymod:widest_window" in s
    )  # fmt: skip
    assert run.stderr.startswith(
        f"bufc report: buffers.yaml:{line}:13: derived value 'widest_attention_window' comes "
        "from canarymod:widest_window, the project's code, which report runs only when asked: "
        "pass --import to evaluate it"
    ), run.stderr
    assert "Traceback" not in run.stderr
    assert not (project / "canary-ran").exists()


def test_report_runs_the_projects_derivation_with_import(project: Path) -> None:
    run = _report(project, "--import")
    assert run.returncode == 0, run.stderr
    assert (project / "canary-ran").read_text() == "imported"
    assert "host_kv_cache_block_offsets" in run.stdout


@pytest.mark.parametrize(
    ("impl", "said"),
    [
        ("nosuchmod:widest_window", "names nosuchmod:widest_window, but there is no module"),
        ("canarymod:boom", "canarymod:boom raised RuntimeError: no"),
        ("os:getpid", "os:getpid raised TypeError"),
    ],
)
def test_report_locates_a_derivation_that_fails(project: Path, impl: str, said: str) -> None:
    spec = project / "buffers.yaml"
    spec.write_text(spec.read_text().replace("canarymod:widest_window", impl))
    run = _report(project, "--import")
    assert run.returncode == 1
    assert said in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("bufc report: buffers.yaml:"), run.stderr
