"""The batch fuzz's families and their small Configs (make_config and make_buffers, which
other tests use too), the labels of its calls (VALID, INVALID, MAYBE) and the limits they are
judged by."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from bufc.runtime.decl import ENGINE, EXTERNAL, STATIC

VALID, INVALID, MAYBE = "valid", "invalid", "maybe"
INT32_MAX = 2**31 - 1
LORA_MODULES = ("attn_qkv", "attn_dense", "mlp_gate")
COMMON = dict(
    max_batch_size=6,
    max_beam_width=3,
    max_num_tokens=96,
    max_draft_tokens=3,
    vocab_size=1000,
    num_layers=4,
    max_attention_window=256,
)
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt": COMMON,
    # a 64-token window of 16 blocks and a pool of 64 blocks: sequences outgrow the window
    "llama": dict(COMMON, max_attention_window=64, tokens_per_block=4, num_kv_blocks=64),
    # the FlashAttention/vLLM contract has no cyclic window: one long enough for the traffic
    "llama_flash": dict(COMMON, max_attention_window=256, tokens_per_block=4, num_kv_blocks=256),
    "llama_flashinfer": dict(
        COMMON, max_attention_window=256, tokens_per_block=4, num_kv_blocks=256
    ),
    "gpt_lora": dict(
        COMMON, max_attention_window=128, tokens_per_block=8, lora_modules=LORA_MODULES
    ),
    "enc_dec": dict(
        COMMON,
        max_attention_window=64,
        tokens_per_block=4,
        max_input_length=16,
        max_encoder_length=16,
        encoder_hidden_size=8,
    ),
    "medusa": dict(
        COMMON, max_beam_width=1, max_attention_window=128, tokens_per_block=8, num_medusa_heads=2
    ),
    "mamba": dict(COMMON, max_beam_width=1, max_draft_tokens=0),
}
ADVANCES = {"gpt", "llama", "medusa", "mamba"}  # families whose every fill rule has an advance form
HISTORY = (ENGINE, EXTERNAL, STATIC)  # written by the engine, the decoder or the caller


def family(name: str):
    return importlib.import_module(f"bufc.generated.{name}")


def make_config(name: str, **overrides):
    mod = family(name)
    fields = {f.name for f in dataclasses.fields(mod.Config) if f.init}
    values = {**CONFIGS.get(name, COMMON), **overrides}
    return mod.Config(**{k: v for k, v in values.items() if k in fields})


def make_buffers(
    name: str,
    device: str = "cpu",
    device_tokens: bool | None = None,
    double_buffered: bool = True,
    **overrides,
):
    return family(name).RuntimeBuffers(
        make_config(name, **overrides),
        device=device,
        device_tokens=device_tokens,
        double_buffered=double_buffered,
    )


def index_limits(config) -> tuple[int, int]:
    """(valid, invalid): block ids below `valid` are good, ids from `invalid` on are not: the
    pool's size (num_kv_blocks), or without one the int32 KVCacheIndex encoding, ids below
    (2**31 - 2) // (2 * num_local_layers). That id itself still encodes (its V index is
    2**31 - 7 with 4 layers), so it is left open (MAYBE)."""
    if getattr(config, "num_kv_blocks", 0):
        return config.num_kv_blocks, config.num_kv_blocks
    limit = (2**31 - 2) // (2 * config.num_local_layers)
    return limit, limit + 1
