"""The typed step record: each family's generated StepInputs reads every bound input and step
scalar by attribute (documented, checked by mypy), still reads by engine name, says the step
mode, and names the nearest input when a name is mistyped."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_buffers

from bufc.codegen.emit_inputs import RESERVED
from bufc.runtime import Request, StepInputs, StepMode
from bufc.runtime.step import UnknownInput

REPO = Path(__file__).resolve().parents[1]


def flash(**overrides):
    b = make_buffers("llama_flash", tokens_per_block=4, max_beam_width=1, **overrides)
    b.add(Request(seq_slot=0, prompt=[11, 12, 13, 14, 15, 16], kv_block_ids=[[7, 3]]))
    b.add(Request(seq_slot=1, prompt=[21, 22, 23], kv_block_ids=[[5, 6]]))
    return b


def test_attributes_are_the_bound_inputs_and_the_scalars() -> None:
    b = flash()
    step = b.step(chunks={0: 4, 1: 3})
    inputs = step.inputs
    assert type(inputs).__name__ == "StepInputs" and isinstance(inputs, StepInputs)
    for name, view in inputs.items():  # every engine name a property reads
        assert getattr(inputs, name) is view, name
    assert inputs.cu_seqlens_k.tolist() == [0, 4, 7]
    assert inputs.row_slots.tolist() == [0, 1]
    assert inputs.max_seq_len == step.scalars["max_seq_len"] == 4
    assert inputs.num_actual_tokens == 7
    assert "seq_lens" in inputs and len(inputs) == len(list(inputs))
    assert inputs == dict(inputs)  # a Mapping: equal to the dict of its views


def test_the_step_mode() -> None:
    b = flash()
    assert b.step(chunks={0: 4}).mode is StepMode.PREFILL  # slot 1 waits
    assert b.step(chunks={0: 2, 1: 3}).mode is StepMode.PREFILL
    tokens = [0] * 8
    tokens[0], tokens[1] = 17, 24
    step = b.step(tokens)
    assert step.mode is StepMode.DECODE and step.inputs.mode is StepMode.DECODE
    b.add(Request(seq_slot=2, prompt=[31, 32], kv_block_ids=[[9]]))
    assert b.step(tokens).mode is StepMode.MIXED
    for slot in (0, 1, 2):
        b.finish(slot)
    assert b.step().mode is StepMode.IDLE


def test_a_mistyped_engine_name_names_the_nearest() -> None:
    inputs = flash().step(chunks={0: 4}).inputs
    with pytest.raises(UnknownInput) as caught:
        inputs["seq_len"]
    assert str(caught.value) == (
        "the step binds no input 'seq_len'; did you mean 'seq_lens', 'seq_lens_cpu' or "
        "'cu_seqlens_k'?"
    )
    assert isinstance(caught.value, KeyError)  # what a dict raised
    assert inputs.get("seq_len") is None


def test_a_mistyped_attribute_names_the_nearest() -> None:
    inputs = flash().step(chunks={0: 4}).inputs
    with pytest.raises(
        AttributeError,
        match=r"^StepInputs has no input or scalar 'cu_seqlen_k'; did you mean 'cu_seqlens_k'",
    ):
        inputs.cu_seqlen_k  # noqa: B018


def test_an_input_this_config_does_not_bind_says_so() -> None:
    inputs = flash().step(chunks={0: 4}).inputs  # max_kv_read_tokens 0: no read index
    with pytest.raises(
        AttributeError,
        match=r"^'kv_read_index' is not among this step's inputs: this Config binds it "
        r"elsewhere \(a static input: static_inputs\) or not at all",
    ):
        inputs.kv_read_index  # noqa: B018
    assert flash(max_kv_read_tokens=64).step(chunks={0: 4}).inputs.kv_read_index.numel() == 64


def test_the_record_is_read_only() -> None:
    inputs = flash().step(chunks={0: 4}).inputs
    with pytest.raises(
        AttributeError, match=r"a step's inputs are read-only \(setting 'seq_lens'\)"
    ):
        inputs.seq_lens = inputs.seq_lens  # type: ignore[misc]
    with pytest.raises(TypeError):
        inputs["seq_lens"] = inputs.seq_lens  # type: ignore[index]


def test_a_repeated_binding_reads_as_one_tuple_in_order() -> None:
    """LoRA's pointers, bound per (module, layer): one attribute, the views in binding order."""
    b = make_buffers("gpt_lora", num_layers=2, lora_modules=("attn_q", "attn_v"))
    inputs = b.views(b.sizes_type(*(1,) * 10))[0]
    names = [f"{m}_lora_ranks_{layer}" for m in ("attn_q", "attn_v") for layer in (0, 1)]
    assert inputs.host_lora_ranks == tuple(inputs[n] for n in names)
    assert all(a is inputs[n] for a, n in zip(inputs.host_lora_ranks, names))


def test_the_names_the_record_keeps_for_itself_are_its_api() -> None:
    """An input named like the record's own API is read by name only (codegen's RESERVED)."""
    public = {n for n in dir(StepInputs) if not n.startswith("_")}
    assert public == RESERVED


def test_every_family_has_its_record() -> None:
    generated = REPO / "generated"
    for path in sorted(generated.glob("*.py")):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"bufc.generated.{path.stem}")
        assert issubclass(module.StepInputs, StepInputs), path.stem
        assert module.RuntimeBuffers.step_inputs is module.StepInputs
        assert path.stem == module.StepInputs.FAMILY


def _mypy(tmp_path: Path, engine: str) -> subprocess.CompletedProcess:
    """mypy over `engine` with bufc laid out as its distribution is (the editable install's
    import hook is invisible to mypy); torch and transformers are not followed."""
    site = tmp_path / "site" / "bufc"
    site.mkdir(parents=True)
    for f in (REPO / "bufc").glob("*.py"):
        shutil.copy(f, site / f.name)
    for folder in ("codegen", "runtime", "rules", "requests", "generated", "schema"):
        (site / folder).symlink_to(REPO / folder, target_is_directory=True)
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nfollow_imports = silent\n"
        "[mypy-torch.*,numpy.*,yaml.*,jinja2.*,jsonschema.*,transformers.*]\n"
        "follow_imports = skip\nignore_missing_imports = True\n"
    )
    (tmp_path / "engine.py").write_text(engine)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental"]
        + ["--cache-dir", str(tmp_path / "cache"), "engine.py"],
        cwd=tmp_path,
        env={"MYPYPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_mypy_checks_an_engine_that_reads_the_record(tmp_path: Path) -> None:
    """examples/hf_paged.py reads llama_flash's step by attribute: mypy passes it, and fails
    a copy that reads one mistyped name."""
    pytest.importorskip("mypy")
    engine = (REPO / "examples" / "hf_paged.py").read_text()
    (tmp_path / "ok").mkdir()
    ok = _mypy(tmp_path / "ok", engine)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    typo = engine.replace("inp.cu_seqlens_k_cpu[-1]", "inp.cu_seqlen_k_cpu[-1]")
    assert typo != engine
    (tmp_path / "typo").mkdir()
    bad = _mypy(tmp_path / "typo", typo)
    assert bad.returncode == 1
    assert '"StepInputs" has no attribute "cu_seqlen_k_cpu"' in bad.stdout


HOSTILE = """version: 1
extends: bufc
flags:
  hostile: {doc: Hostile names., type: bool, default: false}
families:
  hostile_flash:
    doc: llama_flash plus tensors bound under names the record keeps for itself.
    extends: llama_flash
    flags: {hostile: true}
tensors:
"""
TENSOR = """  - name: host_%s
    doc: Token ids again.
    dtype: int32
    memory: pinned
    capacity: ["max_num_tokens"]
    shape: ["num_tokens"]
    fill: {rule: token_ids}
    pad: 0
    when: hostile
    bind: [{input: %s}]
"""


def test_names_the_record_keeps_are_read_by_name_only() -> None:
    """Inputs named like the record's API or what its class body reads (`property`, `int`,
    `keys`) get no attribute, and a step scalar whose name an input takes stays in
    step.scalars; the generated docstring lists both; the module imports and reads them."""
    import types

    from bufc.codegen.emit import render_family
    from bufc.codegen.emit_inputs import step_fields
    from bufc.codegen.pipeline import compile_text

    names = ("property", "int", "keys", "max_query_len")
    spec = HOSTILE + "".join(TENSOR % (n, n) for n in names)
    plan = compile_text(spec, "buffers.yaml").plan("hostile_flash")
    fields, by_key, scalars_only = step_fields(plan)
    assert by_key == ["property", "int", "keys"] and scalars_only == ["max_query_len"]
    assert "max_query_len" in {f["name"] for f in fields}  # the input's
    module = types.ModuleType("hostile_flash")
    sys.modules["hostile_flash"] = module  # (dataclasses look their module up)
    try:
        source = render_family(plan, "buffers.yaml")
        exec(compile(source, "hostile_flash.py", "exec"), vars(module))  # noqa: S102
    finally:
        del sys.modules["hostile_flash"]
    doc = module.StepInputs.__doc__
    assert "Read by engine name only: property, int, keys." in doc
    assert "Step scalars in ``step.scalars`` only: max_query_len." in doc
    views = {n: torch.tensor([i]) for i, n in enumerate(names)}
    inputs = module.StepInputs(views, {"max_query_len": 7}, StepMode.DECODE, {})
    assert (
        inputs["property"] is views["property"] and inputs.max_query_len is views["max_query_len"]
    )
    assert callable(inputs.keys) and inputs.mode is StepMode.DECODE
    with pytest.raises(AttributeError, match=r"read the input '_x' by name: inputs\['_x'\]"):
        module.StepInputs({"_x": views["int"]}).__getattr__("_x")


def test_a_record_copies_and_pickles() -> None:
    import copy
    import pickle

    inputs = flash().step(chunks={0: 4}).inputs
    for twin in (copy.copy(inputs), copy.deepcopy(inputs), pickle.loads(pickle.dumps(inputs))):
        assert type(twin) is type(inputs) and twin.mode is inputs.mode
        assert list(twin) == list(inputs) and twin.cu_seqlens_k.equal(inputs.cu_seqlens_k)
        assert twin.max_seq_len == inputs.max_seq_len


def test_views_at_a_bucket_report_the_steps_mode() -> None:
    b = flash()
    step = b.step(chunks={0: 4})
    assert b.views(step.sizes.padded(8, 4))[0].mode is StepMode.PREFILL  # padded rows run nothing


def test_a_repeated_binding_this_step_lacks_says_so() -> None:
    b = make_buffers("mamba", num_layers=2, max_beam_width=1)  # pointers bound once: statics
    inputs = b.views(b.sizes_type(*(1,) * 10))[0]
    with pytest.raises(AttributeError, match=r"'host_conv_state_pointers' is not among this step"):
        inputs.host_conv_state_pointers  # noqa: B018
