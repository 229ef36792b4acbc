"""The bufc command as a user meets it: --version, schema, report (table, JSON, sweep, plot,
from the spec or from the installed generated module), help texts, exit codes, and the YAML
mistakes rewritten to the house format."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, family
from diagnostics_spec import BASE, diagnostics

from bufc import __version__
from bufc.codegen.cli import main

LLAMA = [
    "--set",
    "max_batch_size=8",
    "--set",
    "max_num_tokens=256",
    "--set",
    "vocab_size=1000",
    "--set",
    "num_layers=4",
    "--set",
    "max_attention_window=512",
]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"bufc {__version__}"


def test_help_documents_exit_codes_and_streams(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit status: 0 success; 1 an invalid spec" in text
    assert "2 a usage error" in text and "diagnostics to stderr" in text


def test_a_usage_error_exits_2_on_stderr(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "the following arguments are required: family" in err


def test_demo_help_is_complete(capsys):
    from bufc.examples.demo import parser

    parser().print_help()
    text = " ".join(capsys.readouterr().out.split())
    assert "check every token against transformers.generate." in text


def test_schema_path_and_print(capsys):
    code, out, _ = run(capsys, "schema", "--path")
    assert code == 0
    path = out.strip()
    assert path.endswith("buffers.schema.json")
    code, out, _ = run(capsys, "schema", "--print")
    schema = json.loads(out)
    with open(path, encoding="utf-8") as fh:
        assert schema == json.load(fh)
    assert "$id" not in schema  # no made-up URL


def test_report_json_equals_the_table(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    _, table, _ = run(capsys, "report", "llama", *LLAMA)
    code, out, _ = run(capsys, "report", "llama", *LLAMA, "--json")
    assert code == 0
    data = json.loads(out)
    lines = {line.split()[0]: line for line in table.splitlines() if line.startswith("  ")}
    assert {t["name"] for t in data["tensors"]} == set(lines) - {"tensor"}
    for t in data["tensors"]:
        line = lines[t["name"]]
        assert f" {t['dtype']} " in line and "[" + ", ".join(map(str, t["shape"])) + "]" in line
        assert all(f"in:{name}" in line for name in t["inputs"])
        assert (" x2 " in line) == (t["copies"] == 2)
    totals = data["totals"]
    assert totals["all"] == sum(t["bytes"] * t["copies"] for t in data["tensors"])
    assert totals["device"] == sum(
        t["bytes"] * t["copies"] for t in data["tensors"] if t["memory"] == "device"
    )
    assert table.splitlines()[-1].startswith(f"{len(data['tensors'])} tensors, ")


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("llama", []),
        ("gpt_lora", ["--set", "lora_modules=attn_qkv,mlp_gate"]),
        ("medusa", ["--set", "max_draft_tokens=2", "--set", "num_medusa_heads=2"]),
    ],
)
def test_report_without_a_spec_reads_the_builtin_spec(capsys, monkeypatch, tmp_path, family, extra):
    """An installed package carries bufc's spec: without one at hand, the same report from it,
    saying so on stderr."""
    monkeypatch.chdir(REPO)
    _, from_spec, _ = run(capsys, "report", family, *LLAMA, *extra)
    monkeypatch.chdir(tmp_path)  # no buffers.yaml here
    code, from_builtin, err = run(capsys, "report", family, *LLAMA, *extra)
    assert code == 0, err
    assert from_builtin == from_spec
    assert err == "bufc report: no --spec and no ./buffers.yaml: reading bufc's built-in spec\n"


@pytest.mark.parametrize(
    ("settings", "config"),
    [
        (["lora_modules=attn_qkv,attn_qkv"], {"lora_modules": ("attn_qkv", "attn_qkv")}),
        (
            ["lora_modules=attn_qkv,attn_k,mlp_gates", "max_batch_size=0"],
            {"lora_modules": ("attn_qkv", "attn_k", "mlp_gates"), "max_batch_size": 0},
        ),
        (
            ["lora_modules=attn_qkv", "num_layers=3", "pp_size=2", "pp_rank=2"],
            {"lora_modules": ("attn_qkv",), "num_layers": 3, "pp_size": 2, "pp_rank": 2},
        ),
    ],
    ids=["a_module_twice", "parameters", "checks"],
)
def test_report_refuses_what_the_config_refuses_with_its_message(
    capsys, monkeypatch, tmp_path, settings, config
):
    """`--set lora_modules=attn_qkv,attn_qkv` was reported (2 modules) though the Config
    refuses it: from the repository's spec as from the built-in one, the report says what the Config
    says, every problem at once."""
    from bufc.runtime import ConfigError

    values = {k: int(v) for k, v in (s.split("=") for s in LLAMA[1::2])} | config
    with pytest.raises(ConfigError) as refused:
        family("gpt_lora").Config(**values)
    said = str(refused.value)
    assert said.startswith("bufc.generated.gpt_lora.Config: ")
    argv = [a for s in settings for a in ("--set", s)]
    monkeypatch.chdir(REPO)
    code, out, from_spec = run(capsys, "report", "gpt_lora", *LLAMA, *argv)
    assert (code, out) == (1, "")
    assert from_spec == f"bufc report: {said.removeprefix('bufc.generated.')}\n"
    monkeypatch.chdir(tmp_path)  # no buffers.yaml: bufc's built-in spec
    code, out, from_builtin = run(capsys, "report", "gpt_lora", *LLAMA, *argv)
    assert (code, out) == (1, "")
    note, refusal = from_builtin.split("\n", 1)
    assert "reading bufc's built-in spec" in note
    assert refusal == f"bufc report: {said.removeprefix('bufc.generated.')}\n"


def test_report_from_the_builtin_spec_names_a_bad_parameter(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "report", "llama", *LLAMA, "--set", "max_batch_sise=3")
    assert code == 1
    assert (
        "family 'llama' has no parameter 'max_batch_sise' (did you mean 'max_batch_size'?)" in err
    )


def test_report_sweep_and_plot(capsys, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(REPO)
    svg = tmp_path / "memory.svg"
    sweep = "max_batch_size=8,64,256"
    code, out, err = run(capsys, "report", "llama", *LLAMA, "--sweep", sweep, "--plot", str(svg))
    assert code == 0, err
    assert out == ""  # the note goes to stderr: with --json, stdout is the JSON alone
    assert f"{svg}: memory of family llama over max_batch_size (3 points)" in err
    assert svg.stat().st_size > 1000 and svg.read_text().lstrip().startswith("<?xml")
    code, out, _ = run(
        capsys, "report", "llama", *LLAMA, "--sweep", "max_batch_size=8, 64,256", "--json"
    )
    points = json.loads(out)["points"]  # values stripped
    assert [p["value"] for p in points] == ["8", "64", "256"]
    device = [p["totals"]["device"] for p in points]
    assert device == sorted(device) and device[0] < device[-1]


def test_the_plot_legend_covers_no_bar(capsys, monkeypatch, tmp_path):
    """The legend sat inside each panel (loc 'best') over the tallest bars: it is placed
    beside its panel, clear of every bar and of the other panels, and inside the saved image."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    monkeypatch.chdir(REPO)
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at
    sweep = "max_batch_size=8,16"  # bars of about one height: no corner of a panel is free
    png = tmp_path / "memory.png"
    code, _, err = run(capsys, "report", "llama", *LLAMA, "--sweep", sweep, "--plot", str(png))
    assert code == 0, err
    (fig,) = figures
    renderer = fig.canvas.get_renderer()
    panels = [ax.get_window_extent(renderer) for ax in fig.axes]
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent(renderer)
        bars = [patch.get_window_extent(renderer) for patch in ax.patches]
        assert bars and not any(legend.overlaps(bar) for bar in bars)
        assert not any(legend.overlaps(panel) for panel in panels)
    for ax in fig.axes:  # within the figure (and what bbox_inches="tight" saves)
        box = ax.get_legend().get_window_extent(renderer)
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1, (box, fig.bbox)


def test_plot_needs_a_sweep(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, _, err = run(capsys, "report", "llama", *LLAMA, "--plot", "x.svg")
    assert code == 2
    assert "bufc report: --plot draws a sweep; give --sweep name=v1,v2,..." in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sweep", "max_batch_size=8,,16"], "--sweep has an empty value"),
        (["--sweep", "max_batch_size="], "--sweep expects name=v1,v2,..."),
        (["--sweep", "max_batch_size=8", "--sweep", "vocab_size=9"], "--sweep takes one parameter"),
        (
            ["--sweep", "max_batch_size=8,16", "--plot", "memory"],
            "name a file ending in one of .svg",
        ),
    ],
)
def test_malformed_report_options_are_usage_errors(capsys, monkeypatch, argv, message):
    monkeypatch.chdir(REPO)
    code, out, err = run(capsys, "report", "llama", *LLAMA, *argv)
    assert code == 2 and out == "" and message in err


def test_report_from_the_spec_refuses_a_dtype_the_spec_does_not_allow(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, _, err = run(capsys, "report", "llama", *LLAMA, "--set", "logits_dtype=int8")
    assert code == 1
    assert "logits_dtype: 'int8' is not one of float16, bfloat16, float32, float64" in err


def test_report_and_contract_find_a_family_as_generate_does(capsys, monkeypatch, tmp_path):
    """The project's spec when it has the family, else bufc's built-in one (saying so); a
    family neither has is a usage error listing both."""
    monkeypatch.chdir(tmp_path)
    mini = (REPO / "tests" / "cases" / "mini" / "buffers.yaml").read_text()
    (tmp_path / "buffers.yaml").write_text(mini)
    own = ", ".join(yaml_families(mini))
    code, _, err = run(capsys, "report", "llama", *LLAMA)
    assert code == 0
    assert err == "bufc report: buffers.yaml has no family 'llama': reading bufc's built-in spec\n"
    code, out, err = run(capsys, "contract", "llama_flash")
    assert code == 0 and "| `query_start_loc` | input |" in out
    assert "buffers.yaml has no family 'llama_flash': reading bufc's built-in spec" in err
    code, _, err = run(capsys, "report", "lama")
    assert code == 2
    assert err.startswith(
        f"bufc report: unknown family 'lama' (did you mean 'llama'?); buffers.yaml defines {own}, "
        "and bufc's built-in spec gpt, chatglm, glm, llama,"
    )
    (tmp_path / "buffers.yaml").unlink()
    code, _, err = run(capsys, "contract", "llama")
    assert code == 0
    assert err == "bufc contract: no --spec and no ./buffers.yaml: reading bufc's built-in spec\n"


def yaml_families(text: str) -> list[str]:
    import yaml

    return list(yaml.safe_load(text)["families"])


def test_validate_reports_every_file_under_the_path_given(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    (tmp_path / "a" / "buffers.yaml").write_text("version: 1\nflags: {a: 1\n")
    (tmp_path / "b" / "buffers.yaml").write_text("version: 1\nflags: [1, 2\n")
    code, _, err = run(capsys, "validate", "a/buffers.yaml", "b/buffers.yaml")
    assert code == 1
    assert "a/buffers.yaml:2:8: this mapping ('{') is never closed with '}'" in err
    assert "b/buffers.yaml:2:8: this list ('[') is never closed with ']'" in err


def test_check_of_a_folder_that_does_not_exist_says_so_in_one_line(capsys, tmp_path, monkeypatch):
    """Not a diff of every module and advice to generate there: the modules may well be in
    another folder (the default --out is generated), and that would make a second copy."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "buffers.yaml").write_text((REPO / "tests/cases/mini/buffers.yaml").read_text())
    for argv, out in ((["--out", "mypkg/buffers"], "mypkg/buffers"), ([], "generated")):
        code, stdout, err = run(capsys, "check", *argv)
        assert (code, stdout) == (1, "")
        assert err == (
            f"bufc check: {out} does not exist; give --out the folder that holds the generated "
            f"modules, or create it with 'bufc generate --spec buffers.yaml --out {out}'\n"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buffers.yaml"]  # nothing created


def test_plot_without_matplotlib_says_how_to_install_it(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    code, _, err = run(
        capsys, "report", "llama", *LLAMA, "--sweep", "max_batch_size=8,16", "--plot", "x.svg"
    )
    assert code == 1
    assert "--plot needs matplotlib (bufc's [plot] extra): pip install matplotlib" in err


# ------------------------------------------------------------------------- spec strictness
SLOTS = (
    "family 'fam_a' needs an integer parameter max_batch_size: its requests' seq slots are 0 .. "
    "max_batch_size - 1 (bufc.requests.batch.limits); declare it under parameters"
)


def test_a_spec_without_an_integer_max_batch_size_is_a_located_error():
    """The request table's seq slots are bounded by max_batch_size, whether or not a formula
    reads it: a spec without one (a renamed parameter) generated a module that could not be
    built."""
    assert diagnostics(BASE.replace("max_batch_size", "batch_cap")) == [
        f"buffers.yaml:12:3: {SLOTS}"
    ]
    as_bool = "max_batch_size: {doc: B., type: bool}"
    assert diagnostics(BASE.replace("max_batch_size: {doc: Batch., min: 1}", as_bool)) == [
        f"buffers.yaml:5:3: {SLOTS}",
        "buffers.yaml:10:40: a size bound must be an integer, got a condition: 'max_batch_size'",
    ]


def test_a_yaml_1_1_boolean_is_a_located_error():
    flag = "  variant: {doc: Variant., values: [a, b]}"
    text = BASE.replace(flag, flag + "\n  extras: {doc: Extras., type: bool, default: yes}")
    assert diagnostics(text) == [
        "buffers.yaml:4:47: 'yes' is a YAML 1.1 boolean; write true or false (or quote it for "
        "the text)"
    ]


@pytest.mark.parametrize("value", ("010", "1:04", "0x40", "6_4", "0b11"))
def test_a_yaml_1_1_integer_is_a_located_error(value):
    """Octal, base 60, hex, binary and underscored digits read as other numbers than they
    show (010 is 8, 1:04 is 64): refused where they stand."""
    flag = "  variant: {doc: Variant., values: [a, b]}"
    text = BASE.replace(flag, flag + f"\n  extras: {{doc: Extras., type: int, default: {value}}}")
    column = 47 + len("int, default: ") - len("bool, default: ")
    assert diagnostics(text) == [
        f"buffers.yaml:4:{column}: '{value}' reads as a YAML 1.1 integer (octal, base 60, hex, "
        "binary or with '_'); write it in decimal digits (or quote it for the text)"
    ]


def test_an_integer_of_thousands_of_digits_is_a_located_error():
    text = "version: 1\nflags: {a: {doc: A., default: " + "9" * 5000 + "}}\n"
    assert diagnostics(text) == [
        "buffers.yaml:2:31: this integer has 5000 digits; a buffer spec's numbers have at most 4000"
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "version: 1\nflags:\n  a: {doc: A.}\n b: 2\n",
            "buffers.yaml:4:2: this line does not fit the mapping or list above it: check its "
            "indentation (the keys of one mapping and the items of one list start at the same "
            "column), or remove text after a quoted value",
        ),
        (
            "version: 1\nflags: {doc: x: y}\n",
            "buffers.yaml:2:8: unexpected text inside '{...}': quote a value that contains ': ', "
            "and separate the entries with ','",
        ),
        (
            "version: 1\nflags: %x\n",
            "buffers.yaml:2:8: this character cannot start a plain value; quote the value",
        ),
        (
            'version: !!int "1"\n',
            "buffers.yaml:1:10: tag 'int' is not allowed in a buffer spec; write the value "
            "without it",
        ),
        (
            "version: 1\nflags: {a: {doc: 2001-12-14t21:59:43.10-05:00}}\n",
            "buffers.yaml:2:18: '2001-12-14t21:59:43.10-05:00' reads as a date and time; quote "
            "it for the text",
        ),
        (
            "version: 1\nflags:\n\t- 1\n",
            "buffers.yaml:3:1: a tab cannot indent YAML; indent with spaces",
        ),
        ('version: 1\nflags: "x\n', "buffers.yaml:2:8: this quoted string is never closed"),
        (
            "version: 1\nflags: a: b\n",
            "buffers.yaml:2:9: a ':' here cannot start a key: check this line's indentation, or "
            "quote a value that contains ': '",
        ),
    ],
)
def test_yaml_syntax_errors_are_plain_sentences(text, message):
    assert diagnostics(text) == [message]


def test_a_boolean_flag_compared_with_a_string_says_so():
    flag = "  variant: {doc: Variant., values: [a, b]}"
    fill = "    fill: {rule: token_ids}"
    text = BASE.replace(
        flag, flag + "\n  extras: {doc: Extras., type: bool, default: false}"
    ).replace(fill, fill + "\n    when: \"extras == 'yes'\"")
    assert diagnostics(text) == [
        "buffers.yaml:22:12: 'extras' is a boolean, not a string: write 'extras' or "
        "'not extras' instead of comparing it with a quoted value"
    ]


def test_a_long_value_is_not_repeated_in_its_error(tmp_path, capsys):
    spec = tmp_path / "buffers.yaml"
    value = "+".join(["1"] * 5000)
    spec.write_text(f'version: 1\nderived:\n  d: {{doc: D., value: "{value}"}}\n')
    code, _, err = run(capsys, "validate", str(spec))
    assert code == 1
    assert f"{spec}:3:24: derived.d.value is longer than 256 characters" in err
    assert max(map(len, err.splitlines())) < 400


def test_report_lists_the_kv_pools(capsys, monkeypatch):
    """Per-layer windows and KV heads: the pools, window ascending then heads, with the layers
    of each; the offsets table has one row set per pool."""
    monkeypatch.chdir(REPO)
    pools = ["--set", "attention_windows=16,512", "--set", "kv_heads_per_layer=2,2,8"]
    code, out, err = run(capsys, "report", "llama", *LLAMA, *pools)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("KV pools"))
    assert line == (
        "KV pools: 3 (pool 0: window 16, 1 layer; pool 1: window 16, 1 layer; "
        "pool 2: window 512, 2 layers)"
    )
    code, out, _ = run(capsys, "report", "llama", *LLAMA, *pools, "--json")
    report = json.loads(out)
    assert report["kv_pools"] == [
        {"window": 16, "layers": 1},
        {"window": 16, "layers": 1},
        {"window": 512, "layers": 2},
    ]
    offsets = next(t for t in report["tensors"] if t["name"] == "kv_cache_block_offsets")
    assert offsets["shape"][0] == 3


def test_report_refuses_an_empty_list_item(capsys):
    """`--set attention_windows=8,,64` once dropped the empty item and reported two windows."""
    code, _, err = run(capsys, "report", "llama", *LLAMA, "--set", "attention_windows=8,,64")
    assert code == 1
    assert err == (
        "bufc report: attention_windows: '8,,64' has an empty item; give the values "
        "comma-separated, as attention_windows=a,b (or attention_windows= for none)\n"
    )
    assert run(capsys, "report", "llama", *LLAMA, "--set", "attention_windows=")[0] == 0


@pytest.mark.parametrize(
    "command", ["generate", "check", "validate", "report", "contract", "schema"]
)
def test_every_subcommands_help_shows_examples(capsys, command):
    from bufc.codegen.cli import EXAMPLES

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "examples:\n" in out
    for line in EXAMPLES[command]:
        assert f"  {line}\n" in out


def test_the_report_example_runs(capsys, monkeypatch):
    from bufc.codegen.cli import EXAMPLES

    monkeypatch.chdir(REPO)
    first = " ".join(EXAMPLES["report"][:2]).replace("\\", "").split()
    assert first[0] == "bufc"
    code, out, err = run(capsys, *first[1:])
    assert code == 0, err
    assert "allocated for runtime buffers" in out
