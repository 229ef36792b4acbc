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
    assert set(examples()) == {
        "llama",
        "llama_flash",
        "llama_flashinfer",
        "recurrentgemma",
        "eagle",
    }


def _shown(name: str, value: list, want: object) -> object:
    """The part of a tensor the page shows: block tables' first two columns, the pages used."""
    if name in ("kv_cache_block_offsets", "host_kv_cache_block_offsets"):
        return [[kv[0][:2], kv[1][:2]] for kv in value[0]]
    if name == "block_table":
        return [row[:2] for row in value]
    if name == "paged_kv_indices":
        return value[: len(want)]  # type: ignore[arg-type]
    return value


def _check(b, step, want: dict[str, object], skip: tuple[str, ...] = ()) -> None:
    """Every value of `want` (a shape where the page names `TENSOR.shape`) as the step or the
    buffers' statics hold it."""
    for name, value in want.items():
        tensor, _, attr = name.partition(".")
        if tensor in skip:
            continue
        t = step.inputs[tensor] if tensor in step.inputs else b.static_inputs[tensor]
        got = list(t.shape) if attr == "shape" else _shown(tensor, t.tolist(), value)
        assert got == value, name


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
    _check(b, step, examples()[family])


@pytest.mark.parametrize("family", ["recurrentgemma", "mamba"])
def test_the_recurrent_worked_example_is_what_the_family_writes(family: str) -> None:
    """Two prompts in a context step, then a decode step: the page's values, the hybrid pool
    encoding block ids with its 2 attention layers (mamba binds no attention input)."""
    hybrid = family == "recurrentgemma"
    kv = dict(attention_layer_period=3, tokens_per_block=4, max_attention_window=8)
    b = make_buffers(family, max_beam_width=1, num_layers=6, **(kv if hybrid else {}))
    for slot, prompt, blocks in ((3, [11, 12, 13, 14, 15], [7, 3]), (1, [21, 22], [5])):
        b.add(Request(slot, prompt, kv_block_ids=[blocks] if hybrid else None))
    b.step(None, generation=False)
    tokens = [0] * 8
    tokens[3], tokens[1] = 16, 23
    step = b.step(tokens)
    attention = ("position_ids", "host_past_key_value_lengths", "kv_cache_block_offsets")
    attention += ("host_kv_cache_pool_mapping", "host_max_attention_window_sizes")
    _check(b, step, examples()["recurrentgemma"], skip=() if hybrid else attention)


@pytest.mark.parametrize("family", ["eagle", "redrafter", "lookahead", "medusa"])
def test_the_speculative_worked_example_is_what_the_family_writes(family: str) -> None:
    """The first example's step with drafts: the page's values, for each tree family (their
    own positions and Eagle's next tokens aside) and Medusa (three drafts each)."""
    paths = {"eagle": {"max_draft_path_len": 2}, "medusa": {"num_medusa_heads": 3}}
    paths["redrafter"] = {"num_draft_paths": 2, "max_draft_path_len": 2}
    b = make_buffers(
        family,
        tokens_per_block=4,
        max_beam_width=1,
        num_layers=2,
        max_attention_window=32,
        max_draft_tokens=3,
        **paths.get(family, {}),
    )
    b.add(Request(seq_slot=0, prompt=[11, 12, 13, 14, 15, 16], kv_block_ids=[[7, 3]]))
    b.add(Request(seq_slot=1, prompt=[21, 22, 23], kv_block_ids=[[5, 6]]))
    b.add(Request(seq_slot=2, prompt=[31, 32, 33, 34, 35], kv_block_ids=[[9, 2, 4]]))
    b.step(chunks={1: 3, 2: 5})
    tokens = [0] * 8
    tokens[1], tokens[2] = 24, 36
    medusa = family == "medusa"
    drafts = {1: [25, 26, 27], 2: [37, 38, 39] if medusa else [37]}
    step = b.step(tokens, chunks={0: 4}, drafts=drafts)
    want = dict(examples()["eagle"])
    if medusa:
        want["input_ids"] = [11, 12, 13, 14, 24, 25, 26, 27, 36, 37, 38, 39]
        want["host_context_lengths"], want["sequence_length"] = [4, 6, 8], [4, 7, 9]
        want["last_token_ids"] = [4, 5, 6, 7, 8, 9, 10, 11, 12]
    if family in ("redrafter", "lookahead"):
        assert step.inputs["position_ids"][:4].tolist() == [0, 1, 2, 3]
        assert step.inputs["position_ids"].shape == (10,)
    skip = ("chunked_context_next_tokens",) if family != "eagle" else ()
    skip += ("position_ids",) if family in ("redrafter", "lookahead") else ()
    _check(b, step, want, skip)


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


@pytest.mark.parametrize("kind", ("binary", "endless", "folder"))
def test_check_of_a_file_that_is_not_the_page_says_it_is_out_of_date(tmp_path, kind) -> None:
    """Bytes that are not UTF-8, a device that never ends, a folder: out of date, said as for a
    stale page (no traceback, nothing read past the page's length)."""
    path = {"binary": tmp_path / "page.md", "endless": Path("/dev/zero"), "folder": tmp_path}[kind]
    if kind == "binary":
        path.write_bytes(b"\xff\xfe" + PAGE.read_bytes())
    run = _cli("--check", str(path))
    assert run.returncode == 1
    assert run.stderr == (
        f"{path} is out of date with buffers.yaml; run 'bufc contract --spec buffers.yaml "
        f"--out {path}'\n"
    )


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
    assert (
        "unknown family 'lama_flash' (did you mean 'llama_flash'?); buffers.yaml defines gpt, "
        "chatglm" in bad.stderr
    )


def test_no_device_row_says_it_is_on_the_host() -> None:
    """A device mirror's meaning is its host tensor's doc, without the host staging."""
    rows = [line for line in PAGE.read_text().splitlines() if "| device |" in line]
    assert len(rows) > 20
    assert not [row for row in rows if "on the host" in row]
