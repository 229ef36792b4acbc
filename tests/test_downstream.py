"""A downstream project's tooling as its users meet it. Every `run:` command of the CI recipe,
the install line included (pinned to a clone of this tree), runs in a fresh virtual
environment; both pre-commit hooks run from the documented config, pinned to that clone's
commit, and on a commit that adds the recipe as .github/workflows/buffers.yml. Each passes on a
project whose generated modules are current and fails, naming the problem, when its spec is
invalid or its modules are stale."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from bufc import __version__

MINI = REPO / "tests" / "cases" / "mini" / "buffers.yaml"
RECIPE = REPO / "docs" / "ci-github-actions.yml"
DOC = REPO / "docs" / "downstream.md"
HOOKS = REPO / ".pre-commit-hooks.yaml"
BIN = Path(sys.executable).parent
URL, COMMIT = "https://github.com/OWNER/bufc", "COMMIT"  # the docs' placeholders
PIN = f"{URL}@{COMMIT}"
GIT = {
    "GIT_AUTHOR_NAME": "ci",
    "GIT_AUTHOR_EMAIL": "ci@example.com",
    "GIT_COMMITTER_NAME": "ci",
    "GIT_COMMITTER_EMAIL": "ci@example.com",
    # fixed dates: the same tree gives the same commit, whose wheel pip then has in its cache
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    "GIT_CONFIG_GLOBAL": os.devnull,  # no signing or hooks of the user's own
}
needs_pre_commit = pytest.mark.skipif(
    shutil.which("pre-commit", path=str(BIN)) is None, reason="needs pre-commit"
)


def sh(cwd: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            **GIT,
            **(env or {}),
        },
    )


def recipe() -> tuple[dict[str, str], list[str]]:
    """The CI recipe's workflow-level env and its `run:` commands, in order."""
    workflow = yaml.safe_load(RECIPE.read_text())
    jobs = list(workflow["jobs"].values())
    steps = [s for job in jobs for s in job["steps"]]
    assert not any("env" in x for x in jobs + steps), "the recipe sets its env in one place"
    return {k: str(v) for k, v in workflow["env"].items()}, [s["run"] for s in steps if "run" in s]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> tuple[Path, str]:
    """A git repository holding this working tree as it is (what git tracks or does not ignore,
    committed or not), committed: what a downstream user pins. Its path and its commit."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    root = tmp_path_factory.mktemp("clone") / "bufc"
    for name in filter(None, listing.split("\0")):
        if (REPO / name).is_file():  # not a tracked file deleted in the tree
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    for argv in (("git", "init", "-q"), ("git", "add", "-A"), ("git", "commit", "-qm", "tree")):
        r = sh(root, *argv)
        assert r.returncode == 0, r.stderr
    return root, sh(root, "git", "rev-parse", "HEAD").stdout.strip()


@dataclass
class CI:
    bin: Path  # the virtual environment's scripts: bufc, as the recipe installed it
    run: Callable[[Path], list[tuple[str, subprocess.CompletedProcess]]]


@pytest.fixture(scope="module")
def ci(clone: tuple[Path, str], tmp_path_factory) -> CI:
    """A fresh virtual environment (what setup-python gives) in which the recipe's install
    steps ran, verbatim but for the pin: the clone's file URL and commit. `run` runs the
    recipe's other steps in a project, in order, as Actions does, up to the first that fails."""
    root, head = clone
    env, runs = recipe()
    assert sum(r.count(PIN) for r in runs) == 1, runs
    # pip 23's requirement parser wants a host in a git+file URL
    commands = [r.replace(PIN, f"file://localhost{root}@{head}") for r in runs]
    installs = [c for c in commands if "pip install" in c]
    assert installs and commands[: len(installs)] == installs, commands
    assert not any("runtime" in c or "torch" in c for c in installs)  # never torch here

    work = tmp_path_factory.mktemp("ci")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    path = [str(venv / "bin")] + [  # no other bufc on the PATH (the one running these tests)
        d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "bufc").exists()
    ]
    step_env = {
        **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")},
        **env,
        "PATH": os.pathsep.join(path),
        "VIRTUAL_ENV": str(venv),
        "PIP_QUIET": "1",  # pip --quiet; its cache (under HOME) is kept
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }

    def step(command: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run(  # the shell of a `run:` step on ubuntu-latest
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", command],
            cwd=cwd,
            env=step_env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    for command in installs:
        r = step(command, work)
        assert r.returncode == 0, f"{command}\n{r.stdout}{r.stderr}"
    assert (venv / "bin" / "bufc").is_file()

    def run(project: Path) -> list[tuple[str, subprocess.CompletedProcess]]:
        done = []
        for command in commands[len(installs) :]:
            done.append((command, step(command, project)))
            if done[-1][1].returncode != 0:
                break
        return done

    return CI(venv / "bin", run)


@pytest.fixture
def project(tmp_path: Path, ci: CI) -> Path:
    """A downstream git repository laid out as the recipe's env says: the spec and its modules
    (in a subpackage), generated by the bufc installed from the clone (this tree may change
    under a long run), committed."""
    env, _ = recipe()
    root = tmp_path / "downstream"
    spec, out = root / env["BUFC_SPEC"], root / env["BUFC_OUT"]
    out.parent.mkdir(parents=True)
    (out.parent / "__init__.py").write_text("")
    shutil.copy(MINI, spec)
    bufc = str(ci.bin / "bufc")
    r = sh(root, bufc, "generate", "--spec", env["BUFC_SPEC"], "--out", env["BUFC_OUT"])
    assert r.returncode == 0, r.stderr
    for argv in (("git", "init", "-q"), ("git", "add", "-A"), ("git", "commit", "-qm", "x")):
        assert sh(root, *argv).returncode == 0
    return root


def test_the_recipe_names_its_paths_once_and_installs_bufc_as_documented():
    env, runs = recipe()
    assert env == {"BUFC_SPEC": "buffers.yaml", "BUFC_OUT": "mypkg/buffers"}
    text = RECIPE.read_text()
    header, body = text.split("\nname:", 1)
    assert "buffers.yaml" not in body.replace("BUFC_SPEC: buffers.yaml", "")
    assert "mypkg/buffers" not in body.replace("BUFC_OUT: mypkg/buffers", "")
    assert "Copy it into your repository as\n# .github/workflows/buffers.yml" in header
    assert f'python -m pip install "bufc @ git+{PIN}"' in runs
    doc = DOC.read_text()
    for line in (
        f'pip install "bufc @ git+{PIN}"',
        f'pip install "bufc[runtime] @ git+{PIN}"',
        "pip install ./bufc\n",
        'pip install "./bufc[runtime]"',
        f"bufc generate --spec {env['BUFC_SPEC']} --out {env['BUFC_OUT']}",
        f"args: [--spec, {env['BUFC_SPEC']}, --out, {env['BUFC_OUT']}]",
    ):
        assert line in doc, line
    assert "pip install bufc" not in doc and "pip install 'bufc" not in doc  # not on the index


@pytest.mark.parametrize("damage", [None, "typo", "stale"])
def test_every_ci_recipe_command_runs_in_a_fresh_environment(ci: CI, project: Path, damage):
    spec = project / "buffers.yaml"
    if damage == "typo":
        spec.write_text(spec.read_text().replace("max_batch_size", "max_batch_sise", 1))
    elif damage == "stale":  # valid, but the modules were generated from the old text
        spec.write_text(spec.read_text().replace("doc: The plain one.", "doc: Edited."))
    done = ci.run(project)
    log = "".join(f"$ {c}\n{r.stdout}{r.stderr}" for c, r in done)
    failed = [c for c, r in done if r.returncode != 0]
    if damage is None:
        assert not failed and len(done) == 3, log
        assert done[0][1].stdout == f"bufc {__version__}\n"  # the clone's version, installed
        assert "buffers.yaml is valid and mypkg/buffers/ is up to date" in done[-1][1].stdout
    elif damage == "typo":
        assert failed == ['bufc validate "$BUFC_SPEC"'], log
        assert done[-1][1].returncode == 1
        assert "buffers.yaml:" in done[-1][1].stderr and "error(s)" in done[-1][1].stderr
    else:
        assert failed == ['bufc check --spec "$BUFC_SPEC" --out "$BUFC_OUT"'], log
        assert done[-1][1].returncode == 1
        assert (
            "mypkg/buffers/ is out of date with buffers.yaml; run "
            "'bufc generate --spec buffers.yaml --out mypkg/buffers'" in done[-1][1].stderr
        )


def test_a_project_extends_a_builtin_family_from_its_own_spec_alone(ci: CI, tmp_path: Path):
    """A project folder holding its own 28-line spec (llama_flash plus a tensor and its rule)
    and its rules module, nothing of bufc's: the bufc installed as the recipe installs it
    validates it, generates that one family from the spec bufc carries, and checks it; the
    module then runs a step (with this environment's torch: the recipe installs none)."""
    project = tmp_path / "extended"
    shutil.copytree(REPO / "tests" / "cases" / "extended", project)
    assert [p.name for p in project.rglob("*.yaml")] == ["buffers.yaml"]
    bufc = str(ci.bin / "bufc")
    r = sh(project, bufc, "validate", "--import", "buffers.yaml")
    assert r.returncode == 0 and r.stdout == "buffers.yaml: ok\n", r.stderr
    r = sh(project, bufc, "generate", "--spec", "buffers.yaml", "--out", "myproj/buffers")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "myproj/buffers: 2 file(s) updated (__init__.py, my_flash.py)\n"
    r = sh(project, bufc, "check", "--spec", "buffers.yaml", "--out", "myproj/buffers")
    assert r.returncode == 0, r.stderr
    step = (
        "from bufc.runtime import Request\n"
        "from myproj.buffers import my_flash\n"
        "b = my_flash.RuntimeBuffers(my_flash.Config(max_batch_size=2, max_num_tokens=16,\n"
        "    vocab_size=10, num_layers=1, max_attention_window=16, tokens_per_block=4))\n"
        "b.add(Request(1, [1, 2, 3], kv_block_ids=[[1]]))\n"
        "b.add(Request(0, [4, 5], kv_block_ids=[[2]]))\n"
        "print(b.step().inputs['request_index'].tolist())\n"
    )
    r = sh(project, sys.executable, "-c", step)
    assert r.returncode == 0 and r.stdout == "[0, 0, 0, 1, 1]\n", r.stderr


@pytest.mark.parametrize(
    "path, spec",
    [
        ("buffers.yaml", True),
        ("buffers.yml", True),
        ("mypkg/buffers.yaml", True),
        ("llama.buffers.yaml", True),
        ("specs/v2.buffers.yml", True),
        (".github/workflows/buffers.yml", False),
        (".github/buffers.yaml", False),
        ("sub/.github/workflows/x.buffers.yaml", False),
        ("mybuffers.yaml", False),
        ("buffers.yaml.orig", False),
        ("buffers.json", False),
    ],
)
def test_bufc_validate_takes_spec_files_only(path, spec):
    """pre-commit searches `files` and `exclude` (default '^$') in each path."""
    hook = next(h for h in yaml.safe_load(HOOKS.read_text()) if h["id"] == "bufc-validate")
    taken = re.search(hook["files"], path) and not re.search(hook.get("exclude", "^$"), path)
    assert bool(taken) == spec


@pytest.fixture(scope="module")
def pre_commit_home(tmp_path_factory) -> dict[str, str]:
    """One pre-commit store for the module: the hooks' environment is built once."""
    return {"PRE_COMMIT_HOME": str(tmp_path_factory.mktemp("pre-commit-home"))}


def configure_pre_commit(project: Path, clone: tuple[Path, str]) -> None:
    """The documented .pre-commit-config.yaml, pinned to the clone's commit, staged."""
    root, head = clone
    doc = DOC.read_text()
    block = doc[doc.index("## pre-commit") :].split("```yaml\n", 1)[1].split("```", 1)[0]
    assert f"repo: {URL} " in block and f"rev: {COMMIT} " in block, block
    config = block.replace(f"repo: {URL} ", f"repo: {root} ").replace(
        f"rev: {COMMIT} ", f"rev: {head} "
    )
    (project / ".pre-commit-config.yaml").write_text(config)
    assert sh(project, "git", "add", ".pre-commit-config.yaml").returncode == 0


@needs_pre_commit
def test_pre_commit_hooks_pass_and_fail(project: Path, clone, pre_commit_home):
    configure_pre_commit(project, clone)

    def hook(hook_id: str) -> subprocess.CompletedProcess:
        return sh(project, "pre-commit", "run", hook_id, "--all-files", env=pre_commit_home)

    for hook_id in ("bufc-validate", "bufc-check"):
        r = hook(hook_id)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "Passed" in r.stdout

    spec = project / "buffers.yaml"
    good = spec.read_text()
    spec.write_text(good.replace("max_batch_size", "max_batch_sise", 1))  # a typo
    r = hook("bufc-validate")
    assert r.returncode == 1 and "Failed" in r.stdout
    assert "buffers.yaml:" in r.stdout and "error(s)" in r.stdout

    spec.write_text(good.replace("doc: The plain one.", "doc: Edited."))  # valid, stale output
    assert hook("bufc-validate").returncode == 0
    r = hook("bufc-check")
    assert r.returncode == 1 and "mypkg/buffers/ is out of date with buffers.yaml" in r.stdout


@needs_pre_commit
def test_a_commit_with_the_ci_recipe_beside_the_spec_passes_the_installed_hooks(
    project: Path, clone, pre_commit_home
):
    """The recipe copied where its header says is not taken for a spec; a spec named
    *.buffers.yaml is, and a bad one blocks the commit."""
    configure_pre_commit(project, clone)
    workflow = project / ".github" / "workflows" / "buffers.yml"
    workflow.parent.mkdir(parents=True)
    shutil.copy(RECIPE, workflow)
    extra = project / "specs" / "extra.buffers.yaml"
    extra.parent.mkdir()
    shutil.copy(MINI, extra)
    assert sh(project, "pre-commit", "install", env=pre_commit_home).returncode == 0

    def commit(message: str) -> tuple[int, str]:
        assert sh(project, "git", "add", "-A").returncode == 0
        r = sh(project, "git", "commit", "-qm", message, env=pre_commit_home)
        return r.returncode, r.stdout + r.stderr

    def result(output: str, hook: str) -> str:
        found = re.search(rf"^bufc {hook}\.*(\(no files to check\))?(\w+)$", output, re.M)
        assert found, output
        return found.group(2)

    code, out = commit("the CI workflow and a second spec")
    assert code == 0, out
    assert (result(out, "validate"), result(out, "check")) == ("Passed", "Passed")
    assert "workflows" not in out

    extra.write_text(extra.read_text().replace("max_batch_size", "max_batch_sise", 1))
    code, out = commit("a bad spec")
    assert code == 1, out
    assert (result(out, "validate"), result(out, "check")) == ("Failed", "Passed")
    assert "specs/extra.buffers.yaml:" in out and "error(s)" in out
    assert sh(project, "git", "log", "--format=%s", "-1").stdout == (
        "the CI workflow and a second spec\n"
    )
    assert sh(project, "git", "checkout", "HEAD", "--", "specs").returncode == 0

    workflow.write_text(workflow.read_text() + "# edited\n")
    code, out = commit("the workflow alone")
    assert code == 0, out
    assert (result(out, "validate"), result(out, "check")) == ("Skipped", "Passed")
