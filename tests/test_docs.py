"""Every code block of README.md and docs/quickstart.md runs, in order, in an empty folder, and
every `print(...)  # comment` prints what its comment says.

How each block runs (the fence's first word is its language; `file=PATH` after it names a file):

- a block with `file=PATH` is written to PATH in the folder (a spec, a rules module);
- `python`: executed; the blocks of one page share a namespace, as a reader running them in one
  session would. A line `print(ARGS)  # TEXT` must print TEXT, or the start of TEXT up to a
  `:` `;` `,` or space that begins its explanation;
- `sh`: each line runs in bash in the folder (stops at the first failure), with `bufc` on PATH
  meaning this checkout's `python -m bufc.codegen`. Two kinds of lines are not run as written:
  - `pip install ...` of bufc: the placeholders of the documented forms are replaced by this
    checkout (OWNER/COMMIT by `file://localhost<checkout>@<HEAD>`, `./bufc` by the checkout's
    path) and pip runs with `--no-deps --no-build-isolation --no-index --target DIR` added, so
    nothing is downloaded and this environment is untouched; both take about 2 s here. That
    checks the requirement strings as written (quoting, extras, the `name @ git+URL@COMMIT`
    form) and that they install bufc; the dependencies themselves are this venv's.
  - `make TARGET`: `make -n TARGET` in the checkout (the target exists and its recipe
    expands). Running them is what CI does already; `make test` here would run this suite
    inside itself.

A page whose block breaks fails here (test_a_broken_block_fails shows it for both pages)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PAGES = ("README.md", "docs/quickstart.md")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
PRINT = re.compile(r"^(?P<indent>\s*)print\((?P<args>.*)\)\s*#\s?(?P<said>.*)$")


class DocFailure(AssertionError):
    pass


def blocks(text: str) -> list[tuple[str, dict[str, str], str, int]]:
    """(language, attributes, code, line) of every fenced block of a page."""
    found = []
    for m in FENCE.finditer(text):
        info = m.group(1).split()
        lang = info[0] if info else ""
        attrs = dict(word.split("=", 1) for word in info[1:] if "=" in word)
        found.append((lang, attrs, m.group(2), text.count("\n", 0, m.start()) + 2))
    return found


def said(text: str, comment: str) -> bool:
    """The comment states the printed text: all of it, or its start then an explanation."""
    comment = comment.strip()
    return comment == text or (
        bool(text) and comment.startswith(text) and comment[len(text)] in ":;, "
    )


def checked(code: str) -> str:
    """`code` with each `print(ARGS)  # TEXT` line turned into a check of what it prints."""
    lines = []
    for line in code.splitlines():
        m = PRINT.match(line)
        if m is None:
            lines.append(line)
        else:
            args, comment = m.group("args"), m.group("said")
            lines.append(f"{m.group('indent')}__doc_print__({args}, __said__={comment!r})")
    return "\n".join(lines) + "\n"


def _doc_print(*args: object, __said__: str) -> None:
    text = " ".join(map(str, args))
    print(text)
    if not said(text, __said__):
        raise DocFailure(f"printed {text!r}, but the comment says {__said__!r}")


def _bufc_bin(where: Path) -> Path:
    """A folder with a `bufc` command: this checkout's generator under this interpreter."""
    where.mkdir(parents=True, exist_ok=True)
    script = where / "bufc"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m bufc.codegen "$@"\n')
    script.chmod(0o755)
    return where


def _head() -> str | None:
    out = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() if out.returncode == 0 else None


def shell_line(line: str, folder: Path) -> str | None:
    """What runs for one line of an `sh` block (None: nothing, a blank or a comment)."""
    command = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
    if not command:
        return None
    words = shlex.split(command)
    if words[:2] == ["pip", "install"]:
        head = _head()
        if head is None:
            pytest.skip("the checkout is not a git repository: the git+ form cannot be installed")
        target = folder / ".pip-target"
        requirements = []
        for req in words[2:]:
            req = req.replace("https://github.com/OWNER/bufc", f"file://localhost{REPO}")
            req = req.replace("@COMMIT", f"@{head}")
            if req.startswith("./bufc"):
                req = str(REPO) + req[len("./bufc") :]
            if "OWNER" in req or "COMMIT" in req:
                raise DocFailure(f"an install line with an unknown placeholder: {line!r}")
            requirements.append(shlex.quote(req))
        return (
            f"{shlex.quote(sys.executable)} -m pip install -q --no-deps --no-build-isolation "
            f"--no-index --upgrade --target {shlex.quote(str(target))} {' '.join(requirements)}"
            f" && test -f {shlex.quote(str(target / 'bufc' / '__init__.py'))}"
        )
    if words[0] == "make":
        return f"make -n -C {shlex.quote(str(REPO))} {' '.join(map(shlex.quote, words[1:]))}"
    return command


def run_page(text: str, folder: Path, name: str) -> str:
    """Run every block of the page `text` in `folder`; what the python blocks printed."""
    env = dict(os.environ)
    env["PATH"] = f"{_bufc_bin(folder / '.bin')}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(folder), env.get("PYTHONPATH"))))
    namespace: dict = {"__name__": "__main__", "__doc_print__": _doc_print}
    out = io.StringIO()
    for lang, attrs, code, line in blocks(text):
        where = f"{name}:{line}"
        if "file" in attrs:
            path = folder / attrs["file"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(code)
        elif lang == "python":
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(checked(code), where, "exec"), namespace)  # noqa: S102
            except Exception as exc:
                raise DocFailure(f"{where}: the python block failed: {exc!r}") from exc
        elif lang == "sh":
            for shell in filter(None, (shell_line(x, folder) for x in code.splitlines())):
                run = subprocess.run(
                    ["bash", "-c", shell],
                    cwd=folder,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if run.returncode:
                    raise DocFailure(
                        f"{where}: {shell!r} exited {run.returncode}\n{run.stdout}{run.stderr}"
                    )
        else:
            raise DocFailure(f"{where}: a ```{lang} block this test does not know how to run")
    return out.getvalue()


@pytest.fixture
def in_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An empty folder, the current directory and first on sys.path; the page's own modules
    (mypkg) forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for module in set(sys.modules) - before:
        if module == "mypkg" or module.startswith("mypkg."):
            del sys.modules[module]


@pytest.mark.parametrize("page", PAGES)
def test_every_block_of_the_page_runs(page: str, in_folder: Path):
    import torch

    text = (REPO / page).read_text()
    kinds = {lang for lang, _, _, _ in blocks(text)}
    assert {"python", "sh"} <= kinds, kinds  # the page still has both kinds
    printed = run_page(text, in_folder, page)
    assert printed  # the commented prints ran
    if page == "docs/quickstart.md":  # the graphs were captured, or the page says they were not
        skipped = "no CUDA device: decode steps ran eagerly" in printed
        assert skipped != torch.cuda.is_available(), printed


MUTATIONS = {
    # an example's code changed: its commented print no longer holds
    "README.md": ("tokens[[3, 1]] = [11, 12]", "tokens[[3, 1]] = [11, 13]"),
    # the rule no longer repeats the last offset past the step: the padded view shows it
    "docs/quickstart.md": ("    out[n + 1 :] = out[n]\n", ""),
}


@pytest.mark.parametrize("page", PAGES)
def test_a_broken_block_fails(page: str, in_folder: Path):
    old, new = MUTATIONS[page]
    text = (REPO / page).read_text()
    assert text.count(old) == 1
    with pytest.raises(DocFailure, match="the comment says"):
        run_page(text.replace(old, new), in_folder, page)


def test_a_failing_shell_line_fails(in_folder: Path):
    page = "```sh\nbufc validate no-such-spec.yaml\n```\n"
    with pytest.raises(DocFailure, match="exited 1"):
        run_page(page, in_folder, "page")


def test_the_print_check_needs_the_whole_value():
    assert said("514", "514: a 512-token chunk + 2 beams")
    assert said("[87] 768", "[87] 768")
    assert not said("51", "514: a 512-token chunk")
    assert not said("", "anything")
    assert not said("[0, 1]", "[0, 1, 1]")


def _function(source: str, name: str) -> str:
    """The body of function `name` in `source`, without its docstring or comments."""
    import ast

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            body = node.body[1:] if ast.get_docstring(node) else node.body
            return ast.dump(ast.Module(body=body, type_ignores=[]))
    raise AssertionError(f"no function {name}")


def test_the_rule_docs_rules_md_shows_is_the_one_the_quickstart_runs():
    rules = [code for _, _, code, _ in blocks((REPO / "docs/rules.md").read_text())]
    shown = next(code for code in rules if "def cu_seqlens_q" in code)
    quickstart = blocks((REPO / "docs/quickstart.md").read_text())
    (run,) = [code for _, attrs, code, _ in quickstart if attrs.get("file") == "mypkg/rules.py"]
    assert _function(shown, "cu_seqlens_q") == _function(run, "cu_seqlens_q")


def test_the_quickstarts_spec_error_is_the_one_bufc_prints(in_folder: Path, capsys):
    """The quickstart quotes what `bufc generate` prints for a typo in its spec (it said
    46:14, the line of the tensor's name, while the error is located at the name itself)."""
    from bufc.codegen.cli import main

    text = (REPO / "docs/quickstart.md").read_text()
    quoted = re.search(r"`(buffers\.yaml:\d+:\d+:\s+unknown name 'num_context_tokns'[^`]*)`", text)
    assert quoted is not None
    for _, attrs, code, _ in blocks(text):
        if "file" in attrs:
            (in_folder / attrs["file"]).parent.mkdir(parents=True, exist_ok=True)
            (in_folder / attrs["file"]).write_text(code)
    spec = in_folder / "buffers.yaml"
    shape = 'shape: ["num_context_tokens + num_generation_sequences"]'
    assert spec.read_text().count(shape) == 1  # host_position_ids's
    spec.write_text(spec.read_text().replace(shape, shape.replace("tokens", "tokns", 1)))
    assert main(["generate", "--spec", "buffers.yaml", "--out", "mypkg/buffers"]) == 1
    printed = capsys.readouterr().err.splitlines()
    assert " ".join(quoted.group(1).split()) in printed
