"""docs/contract.md: generated from the spec (stale is an error), and its worked examples are what
each family writes for that step."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_buffers

from bufc.codegen.contract_doc import render_page
from bufc.codegen.pipeline import compile_file
from bufc.runtime import Request

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "contract.md"
EXAMPLE = re.compile(r"<!-- worked example: (\w+) -->\n```text\n(.*?)```", re.S)


def examples() -> dict[str, dict[str, object]]:
    """Each worked example of the page: family -> {engine name: value}."""
    out = {}
    for family, body in EXAMPLE.findall(PAGE.read_text()):
        lines = (line.split(": ", 1) for line in body.strip().splitlines())
        out[family] = {name: ast.literal_eval(value) for name, value in lines}
    return out


def test_the_page_is_generated_from_the_spec() -> None:
    assert PAGE.read_text() == render_page(compile_file(str(REPO / "buffers.yaml")))


def test_every_contract_has_a_worked_example() -> None:
    assert set(examples()) == {"llama", "llama_flash", "llama_flashinfer"}


def _shown(name: str, value: list, want: object) -> object:
    """The part of a tensor the page shows: block tables' first two columns, the pages used."""
    if name in ("kv_cache_block_offsets", "host_kv_cache_block_offsets"):
        return [[kv[0][:2], kv[1][:2]] for kv in value[0]]
    if name == "block_table":
        return [row[:2] for row in value]
    if name == "paged_kv_indices":
        return value[: len(want)]  # type: ignore[arg-type]
    return value


@pytest.mark.parametrize("family", ["llama", "llama_flash", "llama_flashinfer"])
def test_the_worked_example_is_what_the_family_writes(family: str) -> None:
    """One context chunk and two decode sequences (the page's text describes them), every value
    shown on the page equal to the family's step."""
    b = make_buffers(
        family, tokens_per_block=4, max_beam_width=1, num_layers=2, max_attention_window=32
    )
    b.add(Request(seq_slot=0, prompt=[11, 12, 13, 14, 15, 16], kv_block_ids=[[7, 3]]))
    b.add(Request(seq_slot=1, prompt=[21, 22, 23], kv_block_ids=[[5]]))
    b.add(Request(seq_slot=2, prompt=[31, 32, 33, 34, 35], kv_block_ids=[[9, 2]]))
    b.step(chunks={1: 3, 2: 5})
    tokens = [0] * 8
    tokens[1], tokens[2] = 24, 36
    step = b.step(tokens, chunks={0: 4}, blocks={1: [6]})
    want = examples()[family]
    for name, value in want.items():
        assert _shown(name, step.inputs[name].tolist(), value) == value, name


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bufc.codegen", "contract", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "contract.md"
    stale.write_text(PAGE.read_text().replace("`seq_lens`", "`seq_len`", 1))
    run = _cli("--check", str(stale))
    assert run.returncode == 1
    assert f"{stale} is out of date with buffers.yaml; run 'bufc contract" in run.stderr
    assert _cli("--check", str(PAGE)).returncode == 0


def test_a_familys_tables_for_any_spec() -> None:
    """`bufc contract FAMILY` prints the family's bound tensors with their pads, and its
    scalars; an unknown family is a usage error naming the ones there are."""
    run = _cli("llama_flash")
    assert run.returncode == 0
    assert "| `query_start_loc` | input | int32 | device | `[num_sequences + 1]` | " in run.stdout
    assert "`repeat_last`" in run.stdout and "| `max_seq_len` | `max_of(host_seq_lens)` |" in (
        run.stdout
    )
    bad = _cli("lama_flash")
    assert bad.returncode == 2
    assert "no family 'lama_flash' in buffers.yaml (gpt, chatglm" in bad.stderr
