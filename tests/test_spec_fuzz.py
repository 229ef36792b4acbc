"""Random mutations of the real buffers.yaml through the loader, the validator and the emitter.

Every input must either compile and render (each module parses) or raise SpecError whose every
diagnostic starts with FILE:LINE:COL: never another exception, never a hang, and nothing written
when it fails. The mutations are seeded (the same inputs on every run): lines deleted, duplicated,
swapped, re-indented; characters and tokens replaced by huge, negative, unicode and control
values, deep nesting, tabs, formulas with random operators and the names of other parameters.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO

from bufc.codegen import SpecError, compile_text, emit, files
from bufc.codegen.cli import main

SEED = 20261202
INPUTS = 300
FULL_EVERY = 6  # one input in 6 mutates the whole file; the others a window of its tensors
WINDOW = 14  # tensors in a window (keeps the test well under a minute on a slow machine)
PER_INPUT_S = 10  # a hang is a failure, not a slow test
FILE = "buffers.yaml"
LOCATED = re.compile(r"^buffers\.yaml:[1-9][0-9]*:[1-9][0-9]*: \S")

REAL = (REPO / "buffers.yaml").read_text()
HEAD, _, BODY = REAL.partition("\ntensors:\n")
TENSORS = ["  - name:" + t for t in BODY.split("  - name:")[1:]]


def base_text(rng: random.Random, i: int) -> str:
    """The whole spec, or its header with WINDOW consecutive tensors."""
    if i % FULL_EVERY == 0:
        return REAL
    start = rng.randrange(len(TENSORS) - WINDOW)
    return HEAD + "\ntensors:\n" + "".join(TENSORS[start : start + WINDOW])


NAMES = sorted(set(re.findall(r"^  ([a-z][a-z0-9_]*):\s*$", REAL, re.M)))
ODD_VALUES = [
    "99999999999999999999999999999999999999",
    "-1",
    "-99999999",
    "1e308",
    "0",
    "0x10",
    "4611686018427387904",
    "\u00e9\u00e8\u4e2d\u6587",
    "\U0001f600",
    "\x00",
    "\x07",
    "\x1b[31m",
    "\u2028",
    "\ufeff",
    "\t",
    "'",
    '"',
    "\\",
    "{",
    "[",
    "]]]]",
    "&a",
    "*a",
    "!!python/object:os.system",
    "~",
    "null",
    "yes",
    "- ",
    ": ",
    "#",
    "---",
    "[" * 60 + "]" * 60,
    "{a: " * 40 + "1" + "}" * 40,
    "__import__('os')",
    "lambda: 1",
    '"""',
    "a" * 300,
]
OPERATORS = ["+", "-", "*", "//", "%", "==", "!=", "<", "<=", ">", ">=", "and", "or", "not"]


def formula(rng: random.Random) -> str:
    atoms = [*NAMES, "0", "1", "2", "7", "-3", "cdiv(a, b)", "len(lora_modules)", "true", "'gpt'"]
    parts = [rng.choice(atoms)]
    for _ in range(rng.randint(0, 5)):
        op = rng.choice(OPERATORS)
        parts += [op, rng.choice(atoms)] if op != "not" else ["and not", rng.choice(atoms)]
    text = " ".join(parts)
    if rng.random() < 0.3:
        text = f"max({text}, {rng.choice(NAMES)})"
    if rng.random() < 0.2:
        text = "(" * rng.randint(1, 40) + text + ")" * rng.randint(0, 40)
    return text


def mutate(rng: random.Random, text: str) -> str:
    lines = text.split("\n")
    for _ in range(rng.choice([0, 1, 1, 1, 1, 2, 3, 5])):
        i = rng.randrange(len(lines))
        kind = rng.randrange(11)
        if kind == 0:  # delete a line
            del lines[i]
        elif kind == 1:  # duplicate a line
            lines.insert(i, lines[i])
        elif kind == 2:  # swap two lines
            j = rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == 3:  # change the indentation
            lines[i] = " " * rng.choice([0, 1, 3, 5, 8]) + lines[i].lstrip(" ")
        elif kind == 4:  # a tab
            lines[i] = "\t" + lines[i]
        elif kind == 5:  # one character replaced
            if lines[i]:
                k = rng.randrange(len(lines[i]))
                ch = rng.choice([*":-[]{}\"'#&*!|>%@`,?", chr(rng.randrange(0, 0x3000))])
                lines[i] = lines[i][:k] + ch + lines[i][k + 1 :]
        elif kind == 6:  # a token replaced by an odd value
            tokens = re.findall(r"[A-Za-z0-9_.]+", lines[i])
            if tokens:
                lines[i] = lines[i].replace(rng.choice(tokens), rng.choice(ODD_VALUES), 1)
        elif kind == 7:  # a number replaced
            numbers = re.findall(r"(?<![A-Za-z_])[0-9]+", lines[i])
            if numbers:
                value = rng.choice(["0", "-1", "-7", "65536", "2147483648", "4611686018427387904"])
                lines[i] = lines[i].replace(rng.choice(numbers), value, 1)
        elif kind == 8:  # a formula replaced by a random one
            m = re.search(r'"[^"]*"', lines[i])
            if m:
                lines[i] = lines[i][: m.start()] + f'"{formula(rng)}"' + lines[i][m.end() :]
        elif kind == 9:  # a name replaced by another declared name
            found = [n for n in NAMES if n in lines[i]]
            if found:
                lines[i] = lines[i].replace(rng.choice(found), rng.choice(NAMES), 1)
        else:  # a value made deeply nested
            if ": " in lines[i]:
                depth = rng.choice([5, 31, 33, 200])
                key, _, _ = lines[i].partition(": ")
                lines[i] = f"{key}: " + "[" * depth + "1" + "]" * depth
    return "\n".join(lines)


class Hang(Exception):
    pass


def _alarm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise Hang


def run_one(text: str, out: Path) -> str:
    """Through compile_text and render_all: 'ok' or 'rejected'; AssertionError otherwise."""
    try:
        spec = compile_text(text, FILE)
        rendered = emit.render_all(spec, FILE)
    except SpecError as exc:
        assert exc.diagnostics, "SpecError without diagnostics"
        for d in exc.diagnostics:
            assert LOCATED.match(str(d)), f"unlocated diagnostic: {str(d)[:200]!r}"
        assert not out.exists() or not any(out.iterdir()), "files written for a rejected spec"
        return "rejected"
    for name, source in rendered.items():
        ast.parse(source, name)
    files.write(out, rendered)
    assert files.diff(out, rendered) == []
    return "ok"


def run_cli(data: bytes, workdir: Path) -> str:
    """Through `bufc generate` on a file holding `data` (bytes: not always UTF-8)."""
    (workdir / FILE).write_bytes(data)
    out = workdir / "out"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), _cwd(workdir):
        code = main(["generate", "--spec", FILE, "--out", "out"])
    if code == 0:
        for path in out.glob("*.py"):
            ast.parse(path.read_text(), str(path))
        return "ok"
    lines = stderr.getvalue().splitlines()
    assert code == 1 and lines and re.fullmatch(r"[0-9]+ error\(s\)", lines[-1]), lines[-3:]
    for line in lines[:-1]:
        assert LOCATED.match(line), f"unlocated diagnostic: {line[:200]!r}"
    assert not out.exists(), "files written for a rejected spec"
    return "rejected"


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def as_bytes(rng: random.Random, text: str) -> bytes:
    """`text` as UTF-8, sometimes with a byte that is not UTF-8 (latin-1, a binary tail)."""
    data = text.encode("utf-8", "surrogatepass")
    k = rng.randrange(len(data))
    return data[:k] + rng.choice([b"\xe9", b"\xff\xfe", b"\x80", bytes(range(256))]) + data[k:]


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="needs SIGALRM for the time limit")
def test_mutated_specs_are_compiled_or_rejected_with_located_errors(tmp_path):
    rng = random.Random(SEED)
    counts: Counter[str] = Counter()
    crashes = []
    slowest = 0.0
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(INPUTS):
            text = mutate(rng, base_text(rng, i))
            work = tmp_path / str(i)
            work.mkdir()
            start = time.perf_counter()
            signal.alarm(PER_INPUT_S)
            try:
                if i % 10 == 9:  # the command line, on bytes
                    counts[run_cli(as_bytes(rng, text), work)] += 1
                else:
                    counts[run_one(text, work / "out")] += 1
            except Hang:
                crashes.append((i, "hang", ""))
            except Exception as exc:  # noqa: BLE001 - every other exception is a finding
                crashes.append((i, type(exc).__name__, str(exc)[:300]))
            finally:
                signal.alarm(0)
            slowest = max(slowest, time.perf_counter() - start)
    finally:
        signal.signal(signal.SIGALRM, old)
    counts["crashes"] = len(crashes)
    print(f"\nspec fuzz: {INPUTS} inputs, {dict(counts)}, slowest {slowest:.2f} s")
    assert crashes == [], crashes[:5]
    assert counts["ok"] > 0 and counts["rejected"] > 0
