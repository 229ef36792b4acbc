"""The generated Config: what it accepts, how it stores it, and how it reports what is wrong."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from bufc.generated import gpt, gpt_lora, llama
from bufc.runtime import ConfigError, check_dtype

REQUIRED = dict(
    max_batch_size=8, max_num_tokens=64, vocab_size=100, num_layers=4, max_attention_window=128
)


def test_numpy_and_other_integral_ints_are_accepted_and_stored_as_int():
    config = gpt.Config(
        **{**REQUIRED, "max_batch_size": np.int64(16), "num_layers": np.uint8(4)},
        max_beam_width=np.int32(2),
    )
    assert (config.max_batch_size, config.num_layers, config.max_beam_width) == (16, 4, 2)
    assert {type(config.max_batch_size), type(config.num_layers), type(config.max_beam_width)} == {
        int
    }
    assert config.max_num_sequences == 32 and type(config.max_num_sequences) is int


@pytest.mark.parametrize("value", [True, 8.0, "8", np.float64(8), None])
def test_bools_floats_and_strings_are_not_ints(value):
    with pytest.raises(ConfigError, match=r"max_batch_size must be an int, got "):
        gpt.Config(**{**REQUIRED, "max_batch_size": value})


def test_every_parameter_error_is_reported_at_once():
    with pytest.raises(ConfigError) as exc:
        gpt.Config(
            **{**REQUIRED, "max_batch_size": 0, "vocab_size": "many", "max_num_tokens": -3},
            logits_dtype=torch.int32,
            gather_context_logits=1,
        )
    message = str(exc.value)
    assert message.splitlines() == [
        "bufc.generated.gpt.Config: 5 errors:",
        "  max_batch_size must be at least 1, got 0",
        "  max_num_tokens must be at least 1, got -3",
        "  vocab_size must be an int, got 'many'",
        "  logits_dtype must be one of float16, bfloat16, float32, float64, got torch.int32",
        "  gather_context_logits must be True or False, got 1",
    ]


def test_every_failed_check_is_reported_at_once():
    with pytest.raises(ConfigError) as exc:
        gpt.Config(**{**REQUIRED, "num_layers": 3}, pp_size=2, pp_rank=2, sink_token_length=500)
    lines = str(exc.value).splitlines()
    assert lines[0] == "bufc.generated.gpt.Config: 4 errors:"
    assert lines[1:] == [  # each names its check by its condition, not by a spec line
        "  pp_rank must be below pp_size (buffers.yaml: pp_rank < pp_size)",
        "  num_layers must split evenly over the pipeline ranks (buffers.yaml: "
        "num_layers % pp_size == 0)",
        "  sink_token_length cannot exceed max_attention_window (buffers.yaml: "
        "sink_token_length <= max_attention_window)",
        "  this family has no pipeline-parallel buffers; use its pipeline-parallel variant "
        "(buffers.yaml: pp_size == 1)",
    ]


def test_one_error_is_one_line():
    with pytest.raises(ConfigError) as exc:
        gpt.Config(**{**REQUIRED, "max_batch_size": 0})
    assert str(exc.value) == "bufc.generated.gpt.Config: max_batch_size must be at least 1, got 0"


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn, torch.int16])
def test_a_dtype_parameter_without_values_takes_only_the_dtypes_of_buffers_yaml(dtype):
    holder = types.SimpleNamespace(any_dtype=dtype)
    with pytest.raises(ConfigError, match=r"any_dtype must be one of bool, uint8, int8, "):
        check_dtype(holder, "any_dtype")
    holder.any_dtype = "float16"
    check_dtype(holder, "any_dtype")
    assert holder.any_dtype is torch.float16


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn, torch.bool, torch.int16])
def test_logits_dtype_takes_only_what_the_logits_can_be(dtype):
    with pytest.raises(ConfigError, match=r"logits_dtype must be one of float16, bfloat16, "):
        gpt.Config(**REQUIRED, logits_dtype=dtype)
    assert gpt.Config(**REQUIRED, logits_dtype="bfloat16").logits_dtype is torch.bfloat16


def test_a_sequence_parameter_is_read_once_then_checked():
    modules = (m for m in ["attn_q", "attn_k", "attn_v"])
    config = gpt_lora.Config(**REQUIRED, lora_modules=modules)
    assert config.lora_modules == ("attn_q", "attn_k", "attn_v")
    assert config.num_lora_modules == 3
    with pytest.raises(ConfigError, match=r"lora_modules: 'attn_z' not in attn_qkv, "):
        gpt_lora.Config(**REQUIRED, lora_modules=iter(["attn_q", "attn_z"]))
    with pytest.raises(
        ConfigError, match=r"lora_modules must be a sequence of names, got 'attn_q'"
    ):
        gpt_lora.Config(**REQUIRED, lora_modules="attn_q")


@pytest.mark.parametrize("value", [2**62, 2**64, 10**400])
def test_integers_stay_below_2_to_the_62(value):
    with pytest.raises(ConfigError, match=r"max_num_tokens must be below 2\*\*62, got "):
        gpt.Config(**{**REQUIRED, "max_num_tokens": value})
    assert gpt.Config(**{**REQUIRED, "max_num_tokens": 2**62 - 1}).max_num_tokens == 2**62 - 1


@pytest.mark.parametrize("name", ["attention_windows", "kv_heads_per_layer"])
@pytest.mark.parametrize("value", [{64, 16}, frozenset({64, 16}), {64: 1, 16: 2}])
def test_a_per_layer_list_has_an_order(name, value):
    """A set or a dict (its keys) was taken as the per-layer list in its hash order: refused,
    naming the parameter and the type (a list or tuple, or an iterator, is read in order)."""
    kind = type(value).__name__
    with pytest.raises(ConfigError, match=rf"{name} must be a sequence of ints .*, got a {kind}"):
        llama.Config(**REQUIRED, **{name: value})
    assert getattr(llama.Config(**REQUIRED, **{name: iter([64, 16])}), name) == (64, 16)


def test_a_names_list_has_an_order():
    with pytest.raises(
        ConfigError, match=r"lora_modules must be a sequence of names .*, got a set"
    ):
        gpt_lora.Config(**REQUIRED, lora_modules={"attn_q", "attn_k"})
