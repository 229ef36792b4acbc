"""`pip install .` gives one distribution, import name bufc, usable from outside the repo."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return target


def run_installed(installed, cwd, code: str) -> subprocess.CompletedProcess:
    """Run `code` in an isolated interpreter that sees the installed copy first."""
    return subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"import sys; sys.path.insert(0, {str(installed)!r})\n" + code,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_no_generic_top_level_names(installed):
    top = {p.name for p in installed.iterdir() if not p.name.endswith((".dist-info", ".egg-info"))}
    assert "bufc" in top
    assert not top & {"runtime", "codegen", "generated", "schema", "tests", "examples"}


def test_installed_copy_works_from_outside_the_repository(installed, tmp_path):
    script = """
import bufc, bufc.codegen, bufc.runtime
from bufc.generated import gpt
from bufc.runtime import Request
assert bufc.__file__.startswith(TARGET), bufc.__file__
assert gpt.__file__.startswith(TARGET), gpt.__file__
config = gpt.Config(max_batch_size=4, max_num_tokens=64, vocab_size=50,
                    num_layers=2, max_attention_window=64)
step = gpt.RuntimeBuffers(config).prepare_step([Request(seq_slot=0, prompt=[1, 2, 3])], [])
assert step.inputs["input_ids"].tolist() == [1, 2, 3]
from bufc.codegen.schema import schema
assert schema()["title"] == "bufc buffer spec"
print("ok")
""".replace("TARGET", repr(str(installed)))
    r = run_installed(installed, tmp_path, script)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "ok\n"


def test_installed_copy_validates_a_spec_outside_the_repository(installed, tmp_path):
    (tmp_path / "buffers.yaml").write_text((REPO / "buffers.yaml").read_text())
    code = "from bufc.codegen.cli import main; raise SystemExit(main(['validate', 'buffers.yaml']))"
    r = run_installed(installed, tmp_path, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "buffers.yaml: ok\n"


def test_installed_copy_reports_from_its_generated_modules_without_a_spec(installed, tmp_path):
    """No buffers.yaml at hand: report (table, JSON, plot) reads bufc.generated.gpt."""
    args = (
        "'report', 'gpt', '--set', 'max_batch_size=4', '--set', 'max_num_tokens=64', "
        "'--set', 'vocab_size=50', '--set', 'num_layers=2', '--set', 'max_attention_window=64'"
    )
    code = f"from bufc.codegen.cli import main; raise SystemExit(main([{args}, '--json']))"
    r = run_installed(installed, tmp_path, code)
    assert r.returncode == 0, r.stderr
    import json

    data = json.loads(r.stdout)
    assert data["family"] == "gpt" and data["totals"]["all"] > 0
    pytest.importorskip("matplotlib")
    plot = f"[{args}, '--sweep', 'max_batch_size=4,8', '--plot', 'mem.svg']"
    code = f"from bufc.codegen.cli import main; raise SystemExit(main({plot}))"
    r = run_installed(installed, tmp_path, code)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "mem.svg").stat().st_size > 1000


def test_without_torch_the_runtime_says_how_to_install_it_and_report_needs_none(
    installed, tmp_path
):
    """The generated modules need torch; report reads the spec the package carries, so it
    needs none, in a folder without a spec."""
    block = "import sys; sys.modules['torch'] = None\n"  # as if torch were not installed
    r = run_installed(installed, tmp_path, block + "from bufc.generated import gpt")
    assert r.returncode == 1
    assert "need torch (bufc's [runtime] extra): pip install torch numpy" in r.stderr
    argv = ["report", "gpt", "--set", "max_batch_size=2", "--set", "max_num_tokens=8"]
    argv += ["--set", "vocab_size=10", "--set", "num_layers=1", "--set", "max_attention_window=8"]
    report = f"from bufc.codegen.cli import main; raise SystemExit(main({argv!r}))"
    r = run_installed(installed, tmp_path, block + report)
    assert r.returncode == 0, r.stderr
    assert (
        r.stderr == "bufc report: no --spec and no ./buffers.yaml: reading bufc's built-in spec\n"
    )
    assert "allocated for runtime buffers" in r.stdout


def test_the_rules_and_the_request_layer_run_without_torch(installed, tmp_path):
    """The rule functions and the request state are plain numpy: importing every module of
    bufc.rules and bufc.requests loads no torch, and a request is checked and laid out."""
    code = (
        "import sys\n"
        "from bufc.rules import adapters, batch_rows, core, decode, encoder_decoder, features\n"
        "from bufc.rules import kv_offsets, kv_rows, paged_attention, pools, request\n"
        "from bufc.requests import batch, blocks, rows, sampled, sizes, stateless, step, table\n"
        "from bufc.requests import values\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "limits = batch.limits(max_batch_size=2, vocab_size=10)\n"
        "state = table.RequestTable(limits)\n"
        "state.add(request.Request(seq_slot=0, prompt=[1, 2, 3]))\n"
        "plan = step.plan(state, None)\n"
        "assert plan.batch.sizes.num_tokens == 3 and 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    r = run_installed(installed, tmp_path, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_one_version_in_the_metadata_the_command_pyproject_and_the_changelog(installed, tmp_path):
    """`bufc --version` of the installed copy prints the version its metadata carries, which is
    pyproject.toml's and the newest entry of CHANGELOG.md."""
    tomllib = pytest.importorskip("tomllib")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    code = (
        "import importlib.metadata, bufc\n"
        "print(importlib.metadata.version('bufc'), bufc.__version__)\n"
        "from bufc.codegen.cli import main; main(['--version'])"
    )
    r = run_installed(installed, tmp_path, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{version} {version}\nbufc {version}\n"
    changelog = (REPO / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.M)
    assert releases[0] == version and "0.1.0" in releases
