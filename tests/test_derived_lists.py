"""List-valued parameters (`type: ints`) and derived values computed by a function (`derive`),
as the KV pools of per-layer attention windows need them: validated and located like the rest
of a spec, generated into the Config, checked when it is built, and written by a constant fill
element by element."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
from diagnostics_spec import diagnostics
from project_spec import with_token_tensors

from bufc.codegen.cli import main
from bufc.errors import ConfigError

SPEC = with_token_tensors(
    textwrap.dedent(
        """\
        version: 1
        parameters:
          max_batch_size: {doc: Requests., min: 1}
          max_num_tokens: {doc: Tokens., min: 1}
          num_local_layers: {doc: Layers., min: 1}
          first_local_layer: {doc: First layer., min: 0, default: 0}
          max_attention_window: {doc: Widest window., min: 1}
          attention_windows: {doc: Per-layer windows., type: ints, min: 1, default: []}
          kv_heads_per_layer: {doc: Per-layer KV heads., type: ints, min: 1, default: []}
        derived:
          num_kv_pools:
            doc: KV pools.
            derive: bufc.rules.pools:num_kv_pools
            reads: [attention_windows, kv_heads_per_layer, max_attention_window,
              first_local_layer, num_local_layers]
          kv_pool_mapping:
            doc: Pool and layer in pool of each layer.
            derive: bufc.rules.pools:kv_pool_mapping
            reads: [attention_windows, kv_heads_per_layer, max_attention_window,
              first_local_layer, num_local_layers]
            type: ints
          layer_windows:
            doc: Window of each layer.
            derive: bufc.rules.pools:layer_windows
            reads: [attention_windows, max_attention_window, first_local_layer, num_local_layers]
            type: ints
          pools_and_windows:
            doc: A formula over a derived int and a derived list.
            value: "num_kv_pools * 100 + len(layer_windows)"
        sizes:
          num_tokens: {doc: Tokens., max: "max_num_tokens"}
          num_requests: {doc: Requests., max: "max_batch_size"}
        families:
          fam: {doc: A family.}
        tensors:
          - TOKEN_TENSORS
          - name: host_pool_pointers
            doc: Pool pointers.
            dtype: int64
            memory: host
            capacity: ["num_kv_pools", 2]
            shape: ["num_kv_pools", 2]
            fill: static
            bind: [{input: host_pool_pointers}]
          - name: host_pool_mapping
            doc: Pool mapping.
            dtype: int32
            memory: host
            capacity: ["num_local_layers", 2]
            shape: ["num_local_layers", 2]
            fill: {constant: kv_pool_mapping}
            bind: [{input: host_pool_mapping}]
          - name: host_windows
            doc: Windows.
            dtype: int32
            memory: host
            capacity: ["num_local_layers"]
            shape: ["num_local_layers"]
            fill: {constant: layer_windows}
            bind: [{input: host_windows}]
          - name: host_flag
            doc: A formula over them.
            dtype: int32
            memory: host
            capacity: [1]
            shape: [1]
            fill: {constant: pools_and_windows}
            bind: [{input: host_flag}]
        """
    )
)


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lists")
    (root / "buffers.yaml").write_text(SPEC)
    out = root / "generated"
    assert main(["generate", "--spec", str(root / "buffers.yaml"), "--out", str(out)]) == 0
    spec = importlib.util.spec_from_file_location("lists_fam", out / "fam.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lists_fam"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["lists_fam"]


def _config(fam, **kw):
    base = dict(max_batch_size=4, max_num_tokens=64, num_local_layers=6, max_attention_window=4096)
    return fam.Config(**{**base, **kw})


def test_a_config_derives_its_lists_and_a_constant_fill_writes_them(fam) -> None:
    c = _config(fam, attention_windows=[16, 4096], kv_heads_per_layer=(2, 2, 8))
    assert c.attention_windows == (16, 4096)  # stored as a tuple
    assert c.num_kv_pools == 4
    assert c.kv_pool_mapping == (0, 0, 2, 0, 1, 0, 2, 1, 0, 1, 3, 0)
    assert c.layer_windows == (16, 4096, 16, 4096, 16, 4096)
    assert c.pools_and_windows == 406
    b = fam.RuntimeBuffers(c)
    t = b.tensors
    assert t["host_pool_mapping"].tolist() == [[0, 0], [2, 0], [1, 0], [2, 1], [0, 1], [3, 0]]
    assert t["host_windows"].tolist() == [16, 4096, 16, 4096, 16, 4096]
    assert t["host_flag"].tolist() == [406]
    assert list(t["host_pool_pointers"].shape) == [4, 2]


def test_empty_lists_mean_one_pool_of_the_one_window(fam) -> None:
    c = _config(fam)
    assert c.num_kv_pools == 1
    assert c.kv_pool_mapping == (0, 0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5)
    assert c.layer_windows == (4096,) * 6


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([16, True], "attention_windows must be a sequence of ints, got (16, True)"),
        ([16, 0], "attention_windows: every value must be at least 1 and below 2**62, got 0"),
        (16, "attention_windows must be a sequence of ints, got 16"),
        ("16", "attention_windows must be a sequence of ints, got '16'"),
    ],
)
def test_a_bad_list_is_refused_when_the_config_is_built(fam, value, message) -> None:
    with pytest.raises(ConfigError) as info:
        _config(fam, attention_windows=value)
    assert str(info.value) == f"lists_fam.Config: {message}"


def test_a_derived_value_of_the_wrong_type_is_refused(fam, monkeypatch) -> None:
    monkeypatch.setattr(fam.pools, "num_kv_pools", lambda **kw: "4")
    with pytest.raises(ConfigError, match="derived value num_kv_pools must be an int, got '4'"):
        _config(fam)


@pytest.mark.parametrize(
    ("old", "new", "want"),
    [
        (
            "kv_heads_per_layer: {doc: Per-layer KV heads., type: ints, min: 1, default: []}",
            "kv_heads_per_layer: {doc: Per-layer KV heads., type: ints, min: 1, default: [2, 0]}",
            "buffers.yaml:9:3: default of 'kv_heads_per_layer' holds a value below its min 1",
        ),
        (
            "kv_heads_per_layer: {doc: Per-layer KV heads., type: ints, min: 1, default: []}",
            "kv_heads_per_layer: {doc: Per-layer KV heads., type: ints, min: 1, default: [a]}",
            "buffers.yaml:9:3: default of 'kv_heads_per_layer' must be a list of integers",
        ),
        (
            "reads: [attention_windows, max_attention_window, first_local_layer, num_local_layers]",
            "reads: [attention_windows, max_attention_window, first_local_layer, num_layers]",
            "buffers.yaml:22:3: derived value 'layer_windows' reads 'num_layers'; its function "
            "reads parameters and derived values (did you mean 'num_local_layers'?)",
        ),
        (
            "reads: [attention_windows, max_attention_window, first_local_layer, num_local_layers]",
            "reads: [attention_windows, max_attention_window, first_local_layer, num_tokens]",
            "buffers.yaml:22:3: derived value 'layer_windows' reads 'num_tokens', a step size; "
            "its function reads parameters and derived values (did you mean 'max_num_tokens'?)",
        ),
        (
            'value: "num_kv_pools * 100 + len(layer_windows)"',
            'value: "num_kv_pools * 100 + layer_windows"',
            "buffers.yaml:29:34: 'layer_windows' is a derived list; formulas can only take its "
            "len()",
        ),
        (
            'value: "num_kv_pools * 100 + len(layer_windows)"',
            'value: "num_kv_pools * 100 + attention_windows"',
            "buffers.yaml:29:34: 'attention_windows' is a list parameter; formulas can only take "
            "its len()",
        ),
        (
            "doc: A formula over a derived int and a derived list.",
            "doc: A formula over a derived int and a derived list.\n    derive: os:getpid",
            "buffers.yaml:28:5: a derived value takes exactly one of 'value' (a formula) or "
            "'derive' (MODULE:NAME, with optional 'reads' and 'type')",
        ),
        (
            'value: "num_kv_pools * 100 + len(layer_windows)"',
            "type: int",
            "buffers.yaml:28:5: a derived value takes exactly one of 'value' (a formula) or "
            "'derive' (MODULE:NAME, with optional 'reads' and 'type')",
        ),
    ],
    ids=[
        "below-min",
        "not-ints",
        "unknown-read",
        "size-read",
        "list-in-formula",
        "ints-param",
        "value-and-derive",
        "neither",
    ],
)
def test_each_list_diagnostic_names_its_line(old: str, new: str, want: str) -> None:
    assert old in SPEC
    got = diagnostics(SPEC.replace(old, new, 1))
    assert got == [want]


def test_a_constant_fill_of_names_is_refused() -> None:
    text = SPEC.replace(
        "  kv_heads_per_layer:",
        "  mods: {doc: Modules., type: names, values: [q, k], default: [q]}\n  kv_heads_per_layer:",
    ).replace("fill: {constant: layer_windows}", "fill: {constant: mods}")
    got = diagnostics(text)
    assert len(got) == 1 and got[0].endswith(
        "'mods' is a list of names; a constant fill writes numbers"
    )
