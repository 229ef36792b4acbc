"""A downstream project's tooling: the pre-commit hooks (through `pre-commit try-repo`) and the
CI recipe's commands pass on a project whose generated modules are current, and fail, naming
the problem, when its spec is invalid or its modules are stale."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

MINI = REPO / "tests" / "cases" / "mini" / "buffers.yaml"
BIN = Path(sys.executable).parent


def sh(cwd: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})},
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A git repository with a buffers.yaml and its generated modules, committed."""
    root = tmp_path / "downstream"
    root.mkdir()
    shutil.copy(MINI, root / "buffers.yaml")
    assert (
        sh(root, "bufc", "generate", "--spec", "buffers.yaml", "--out", "generated").returncode == 0
    )
    for argv in (
        ("git", "init", "-q"),
        ("git", "add", "-A"),
        ("git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "x"),
    ):
        assert sh(root, *argv).returncode == 0
    return root


def hook(root: Path, hook_id: str, home: Path) -> subprocess.CompletedProcess:
    return sh(
        root,
        "pre-commit",
        "try-repo",
        str(REPO),
        hook_id,
        "--all-files",
        env={"PRE_COMMIT_HOME": str(home)},
    )


def ci_commands() -> list[list[str]]:
    """The `bufc ...` steps of the documented CI recipe."""
    workflow = yaml.safe_load((REPO / "docs" / "ci-github-actions.yml").read_text())
    steps = [s["run"] for job in workflow["jobs"].values() for s in job["steps"] if "run" in s]
    return [cmd.split() for cmd in steps if cmd.startswith("bufc ")]


@pytest.mark.skipif(shutil.which("pre-commit", path=str(BIN)) is None, reason="needs pre-commit")
def test_pre_commit_hooks_pass_and_fail(project: Path, tmp_path: Path):
    home = tmp_path / "pre-commit-home"
    for hook_id in ("bufc-validate", "bufc-check"):
        r = hook(project, hook_id, home)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "Passed" in r.stdout

    spec = project / "buffers.yaml"
    good = spec.read_text()
    spec.write_text(good.replace("max_batch_size", "max_batch_sise", 1))  # a typo
    r = hook(project, "bufc-validate", home)
    assert r.returncode == 1 and "Failed" in r.stdout
    assert "buffers.yaml:" in r.stdout and "error(s)" in r.stdout

    spec.write_text(good.replace("doc: The plain one.", "doc: Edited."))  # valid, stale output
    assert hook(project, "bufc-validate", home).returncode == 0
    r = hook(project, "bufc-check", home)
    assert r.returncode == 1 and "generated/ is out of date with buffers.yaml" in r.stdout


def test_ci_recipe_commands_pass_and_fail(project: Path):
    commands = ci_commands()
    assert [c[:2] for c in commands] == [["bufc", "validate"], ["bufc", "check"]]
    for argv in commands:
        r = sh(project, *argv)
        assert r.returncode == 0, r.stdout + r.stderr
    spec = project / "buffers.yaml"
    spec.write_text(spec.read_text().replace("doc: The plain one.", "doc: Edited."))
    r = sh(project, *commands[1])
    assert r.returncode == 1 and "generated/ is out of date with buffers.yaml" in r.stderr
