"""Per family: the engine names bound for a config and rank role equal the reference's set
(written out here from buffer-inventory.md §1), every capacity equals the reference's formula
at two configs, and nothing of another family is in its module."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import REPO, family, make_config

# ---- the reference's engine names (inventory §1.1, §1.3-§1.12)
CORE = {
    "host_context_lengths",
    "context_lengths",
    "sequence_length",
    "host_request_types",
    "last_token_ids",
}
FIRST_RANK = {"input_ids"}
TRANSFORMER = {
    "position_ids",
    "host_past_key_value_lengths",
    "host_max_attention_window_sizes",
    "host_sink_token_length",
    "cache_indirection",
    "host_context_progress",
}
KV = {"kv_cache_block_offsets", "host_kv_cache_block_offsets"}
STATIC_TRANSFORMER = {"host_runtime_perf_knobs"}
STATIC_KV = {"host_kv_cache_pool_pointers", "host_kv_cache_pool_mapping"}
CROSS = {
    "encoder_input_lengths",
    "encoder_max_input_length",
    "encoder_output",
    "cross_kv_cache_gen",
    "host_cross_kv_cache_block_offsets",
    "cross_kv_cache_block_offsets",
    "cross_attention_mask",
    "cross_attention_packed_mask",
    "skip_cross_attn_blocks",
}
STATIC_CROSS = {"host_cross_kv_cache_pool_pointers", "host_cross_kv_cache_pool_mapping"}
SPEC_COMMON = {
    "spec_decoding_packed_mask",
    "spec_decoding_generation_lengths",
    "spec_decoding_position_offsets",
    "spec_decoding_use",
}
REDRAFTER_IN = SPEC_COMMON | {
    "redrafter_inverted_temperature",
    "device_request_types",
    "draft_tokens",
    "draft_indices",
    "draft_probs",
    "rand_data_sample",
    "rand_data_validation",
    "position_ids_base",
    "position_ids",
}
REDRAFTER_OUT = {
    "next_spec_decoding_generation_lengths",
    "next_spec_decoding_position_offsets",
    "spec_decoding_mask",
    "next_draft_tokens",
    "next_draft_indices",
    "next_draft_probs",
    "next_flat_tokens",
    "num_accepted_tokens",
    "accepted_beam_index",
    "max_gen_token",
    "total_gen_token",
    "packed_position_ids",
}
EAGLE_IN = SPEC_COMMON | {
    "eagle_temperature",
    "posterior_alpha",
    "posterior_threshold",
    "rand_data_sample",
    "rand_data_validation",
    "draft_tokens",
    "draft_lens",
    "draft_paths",
    "host_ctx_eagle_net_request_types",
    "host_ctx_eagle_net_context_lengths",
    "host_ctx_eagle_net_past_key_value_lengths",
    "host_gen_eagle_net_request_types",
    "host_gen_eagle_net_context_lengths",
    "host_gen_eagle_net_past_key_value_lengths",
    "input_gen_tokens",
    "chunked_context_next_tokens",
    "prev_scores",
    "current_expand_indices",
    "all_layers_scores",
    "all_layers_draft_token_ids",
    "all_layers_draft_token_ids_predecessor",
}
STATIC_EAGLE = {"greedy_sampling", "use_dynamic_tree", "dynamic_tree_max_topK"}
EAGLE_OUT = {
    "next_draft_tokens",
    "next_draft_lens",
    "next_draft_paths",
    "accepted_tokens",
    "num_accepted_tokens",
    "accepted_paths",
}
MODULES = ("attn_qkv", "mlp_4h_to_h")
DECODER = CORE | FIRST_RANK | TRANSFORMER
PAGED = DECODER | KV
EXTRA = dict(
    max_encoder_length=24,
    max_input_length=20,
    encoder_hidden_size=16,
    lora_modules=MODULES,
    max_prompt_embedding_table_size=64,
    max_position_embeddings=8,
    rotary_embedding_dim=4,
    num_languages=3,
    num_medusa_heads=3,
    num_draft_paths=2,
    max_draft_path_len=3,
    hidden_size=32,
)
ONE_BEAM = {"max_beam_width": 1}
HYBRID = {"max_beam_width": 1, "attention_layer_period": 3}  # layer 2 of 4 holds attention


def lora_names(layers):
    return {
        f"{m}_lora_{kind}_{layer}"
        for m in MODULES
        for layer in layers
        for kind in ("weights_pointers", "ranks")
    }


# family, config overrides, inputs, outputs, static inputs
CASES = [
    ("gpt", {}, DECODER, {"logits"}, STATIC_TRANSFORMER),
    ("chatglm", {}, DECODER, {"logits"}, STATIC_TRANSFORMER),
    ("glm", {}, DECODER, {"logits"}, STATIC_TRANSFORMER),
    ("llama", {}, PAGED, {"logits"}, STATIC_TRANSFORMER | STATIC_KV),
    (
        "llama",
        {"tp_size": 2},
        PAGED,
        {"logits"},
        STATIC_TRANSFORMER | STATIC_KV | {"all_reduce_workspace"},
    ),
    (
        "gpt_pp",
        {"pp_size": 2, "pp_rank": 0},
        PAGED,
        {"hidden_states_output"},
        STATIC_TRANSFORMER | STATIC_KV,
    ),
    (
        "gpt_pp",
        {"pp_size": 4, "pp_rank": 1},
        PAGED - FIRST_RANK | {"hidden_states_input"},
        {"hidden_states_output"},
        STATIC_TRANSFORMER | STATIC_KV,
    ),
    (
        "gpt_pp",
        {"pp_size": 2, "pp_rank": 1},
        PAGED - FIRST_RANK | {"hidden_states_input"},
        {"logits"},
        STATIC_TRANSFORMER | STATIC_KV,
    ),
    ("gpt_lora", {}, PAGED | lora_names(range(4)), {"logits"}, STATIC_TRANSFORMER | STATIC_KV),
    ("gpt_outputs", {}, PAGED, {"logits", "hidden_states_last"}, STATIC_TRANSFORMER | STATIC_KV),
    (
        "gpt_prompt_tuning",
        {},
        PAGED | {"prompt_embedding_table", "tasks", "prompt_vocab_size"},
        {"logits"},
        STATIC_TRANSFORMER | STATIC_KV,
    ),
    (
        "gpt_language_adapter",
        {},
        PAGED | {"language_adapter_routings"},
        {"logits"},
        STATIC_TRANSFORMER | STATIC_KV,
    ),
    (
        "qwen2_vl",
        {},
        PAGED
        | {"mrope_rotary_cos_sin", "mrope_position_deltas"}
        | {"prompt_embedding_table", "tasks", "prompt_vocab_size"},
        {"logits"},
        STATIC_TRANSFORMER | STATIC_KV,
    ),
    (
        "mamba",
        ONE_BEAM,
        CORE | FIRST_RANK | {"slot_mapping"},
        {"logits"},
        {f"{k}_state_ptr_{layer}" for k in ("conv", "rnn") for layer in range(4)},
    ),
    (
        "recurrentgemma",
        HYBRID,
        PAGED | {"slot_mapping"},
        {"logits"},
        STATIC_TRANSFORMER
        | STATIC_KV
        | {f"{k}_state_ptr_{layer}" for k in ("conv", "rnn") for layer in (0, 1, 3)},
    ),
    ("enc_dec", {}, PAGED | CROSS, {"logits"}, STATIC_TRANSFORMER | STATIC_KV | STATIC_CROSS),
    (
        "encoder",
        {},
        {"input_ids", "position_ids", "input_lengths", "max_input_length"},
        {"encoder_output"},
        set(),
    ),
    (
        "medusa",
        ONE_BEAM,
        PAGED | SPEC_COMMON,  # the tree's mask, lengths and offsets: set once, bound per step
        {"logits", "medusa_logits"},
        STATIC_TRANSFORMER | STATIC_KV,
    ),
    ("lookahead", ONE_BEAM, PAGED | SPEC_COMMON, {"logits"}, STATIC_TRANSFORMER | STATIC_KV),
    (
        "redrafter",
        ONE_BEAM,
        PAGED | REDRAFTER_IN,
        {"logits"} | REDRAFTER_OUT,
        STATIC_TRANSFORMER | STATIC_KV,
    ),
    (
        "eagle",
        ONE_BEAM,
        PAGED | EAGLE_IN,
        {"logits"} | EAGLE_OUT,
        STATIC_TRANSFORMER | STATIC_KV | STATIC_EAGLE,
    ),
    ("gpt", {"gather_context_logits": True}, DECODER, {"logits"}, STATIC_TRANSFORMER),
    ("gpt", {"gather_generation_logits": True}, DECODER, {"logits"}, STATIC_TRANSFORMER),
]


def config_for(name, overrides, scale=1):
    mod = family(name)
    fields = {f.name for f in dataclasses.fields(mod.Config) if f.init}
    extra = {k: v for k, v in EXTRA.items() if k in fields}
    if scale > 1:
        extra |= {"max_batch_size": 8 * scale, "max_num_tokens": 512 * scale}
        if "num_layers" in fields:
            extra["num_layers"] = 4 * scale
        if "max_encoder_length" in fields:
            extra |= {"max_encoder_length": 40, "max_input_length": 33}
    return make_config(name, **{**extra, **overrides})


@pytest.mark.parametrize(("name", "overrides", "inputs", "outputs", "statics"), CASES)
def test_bound_names_equal_the_references(name, overrides, inputs, outputs, statics):
    mod = family(name)
    b = mod.RuntimeBuffers(config_for(name, overrides))
    got_in, got_out = b.views(one_of_each())
    if "cache_indirection" in inputs and getattr(b.config, "max_beam_width", 1) > 1:
        # bufc's mixed-width extension: requests of different beam widths in one step, each
        # request's width in host_beam_widths (cache_indirection is bound at the widest)
        inputs = inputs | {"host_beam_widths"}
    if name != "encoder":  # the row map every contract binds (the reference keeps it apart)
        inputs = inputs | {"row_slots", "row_slots_cpu"}
    assert set(got_in) == inputs
    assert set(got_out) == outputs
    assert set(b.static_inputs) == statics


def one_of_each():
    """Step sizes of one of everything (so every conditional binding shows)."""
    from bufc.runtime import StepSizes

    return StepSizes(
        *(1,) * 10, num_encoder_tokens=1, num_encoder_input_tokens=1, max_encoder_input_length=1
    )


# ---- capacities (inventory symbols: B, W, Tmax, Lmax, V, H, Aw, Lloc, Mb, E, Ein, Henc, K, D)
def capacities(c, flags) -> dict:
    B, W, T = c.max_batch_size, getattr(c, "max_beam_width", 1), c.max_num_tokens
    g = lambda k, d=None: getattr(c, k, d)  # noqa: E731
    V = g("vocab_size_padded")
    Aw = g("max_attention_window")
    K = g("max_draft_tokens", 0) + 1
    D = g("max_draft_tokens", 0)
    L = B * max(1 + D, W)
    Mb = -(-Aw // g("tokens_per_block", 64)) if Aw else None
    E, Ein, Henc = g("max_encoder_length"), g("max_input_length"), g("encoder_hidden_size")
    words = -(-K // 32)
    paths, plen = g("num_draft_paths", 0), g("max_draft_path_len", 0)
    out = {
        "input_ids": (T,) if flags["engine"] == "decoder" else (B * (Ein or 0),),
        "host_context_lengths": (B * W,),
        "context_lengths": (B * W,),
        "sequence_length": (B * W,),
        "host_request_types": (B * W,),
        "last_token_ids": (L,),
        "logits": (L, V),
        # the reference grows position_ids lazily ([2, n] for ChatGLM/GLM); allocated at capacity
        "position_ids": (
            (B * (Ein or 0),)
            if flags["engine"] == "encoder"
            else ((2, T) if flags["model_variant"] != "gpt" else (T,))
        ),
        "host_past_key_value_lengths": (B * W,),
        "host_sink_token_length": (1,),
        "cache_indirection": (B, W, Aw),
        "host_context_progress": (1,),
        "kv_cache_block_offsets": (1, B * W, 2, Mb),
        "host_kv_cache_block_offsets": (1, B * W, 2, Mb),
        "hidden_states_input": (T, g("hidden_size")),
        "hidden_states_output": (T, g("hidden_size")),
        "hidden_states_last": (T, g("hidden_size")),
        "slot_mapping": (B,),
        "mrope_rotary_cos_sin": (
            B * W,
            g("max_position_embeddings", 0) * g("rotary_embedding_dim", 0),
        ),
        "mrope_position_deltas": (B * W, 1),
        "language_adapter_routings": (T, 1),
        "prompt_embedding_table": (g("max_prompt_embedding_table_size"), g("hidden_size")),
        "tasks": (T,),
        "prompt_vocab_size": (1,),
        "encoder_input_lengths": (B * W,) if flags["engine"] == "decoder" else None,
        "encoder_max_input_length": (E,),
        "encoder_output": (B * (E if flags["engine"] == "decoder" else Ein), Henc) if E else None,
        "input_lengths": (B,),
        "max_input_length": (Ein,),
        "cross_kv_cache_gen": (1,),
        "cross_kv_cache_block_offsets": (1, B * W, 2, -(-E // g("tokens_per_block", 64)))
        if E
        else None,
        "host_cross_kv_cache_block_offsets": (1, B * W, 2, -(-E // g("tokens_per_block", 64)))
        if E
        else None,
        "cross_attention_mask": (T, E),
        "cross_attention_packed_mask": (B * (-(-Ein // 128) * 128), -(-E // 256) * 256 // 32)
        if E
        else None,
        "skip_cross_attn_blocks": (1,),
        "medusa_logits": (g("num_medusa_heads"), B * K, V),  # [heads, num_logits, V], packed
        "spec_decoding_packed_mask": (B * K, words),
        "spec_decoding_generation_lengths": (B,),
        "spec_decoding_position_offsets": (B, K),
        "spec_decoding_use": (1,),
        "draft_tokens": (B, paths, plen + 1) if flags["spec_decoding"] != "eagle" else (B, D),
        "next_draft_tokens": (B, paths, plen + 1) if paths else None,
        "draft_probs": (B, paths, plen, V) if paths else None,
        "rand_data_validation": (B, paths, plen) if paths else None,
        "next_flat_tokens": (B * K,),
        "posterior_threshold": (B,),
        "chunked_context_next_tokens": (B,),
        "all_layers_scores": (B, plen, D * D) if plen else None,
        "prev_scores": (B, D),
    }
    return out


@pytest.mark.parametrize("scale", [1, 2])
@pytest.mark.parametrize("name", sorted({c[0] for c in CASES}))
def test_capacities_equal_the_references(name, scale):
    overrides = next(o for n, o, *_ in CASES if n == name)
    c = config_for(name, overrides, scale)
    b = family(name).RuntimeBuffers(c)
    want = capacities(c, family(name).FLAGS)
    if name == "eagle":  # Eagle's rand_data_validation is [B, K]; one path per decoding token
        B, K = c.max_batch_size, c.max_draft_tokens + 1
        want["rand_data_validation"] = (B, K)
        for paths in ("draft_paths", "next_draft_tokens", "next_draft_paths"):
            want[paths] = (B, K, c.max_draft_path_len + 1)
    got_in, got_out = b.views(one_of_each())
    checked = 0
    for engine_name in {**got_in, **got_out}:
        decl = b.decls[_owner(b, engine_name)]
        shape = tuple(decl.capacity(c))
        expected = want.get(engine_name)
        if expected is None or decl.ring is not None:
            continue
        assert shape == tuple(expected), (engine_name, shape, expected)
        checked += 1
    assert checked >= 5


def _owner(b, engine_name):
    for e, n, *_ in (*b._bind.inputs, *b._bind.outputs):  # noqa: SLF001 - the binding table
        if e == engine_name:
            return n
    raise KeyError(engine_name)


def test_lora_capacities_and_ring_of_generation_logits():
    c = config_for("gpt_lora", {})
    b = family("gpt_lora").RuntimeBuffers(c)
    assert b.tensors["host_lora_weights_pointers"].shape == (2, 4, c.max_num_sequences, 3)
    assert b.tensors["host_lora_ranks"].shape == (2, 4, c.max_num_sequences)
    g = family("gpt").RuntimeBuffers(config_for("gpt", {"gather_generation_logits": True}))
    assert g.tensors["generation_logits_cache"].shape == (8, 24, 1000)
    assert "logits" not in g.tensors


# ---- nothing of another family in a module
def test_generated_modules_hold_only_their_familys_tensors():
    names = set(re.findall(r"^  - name: (\w+)$", (REPO / "buffers.yaml").read_text(), re.M))
    assert len(names) > 100
    for path in sorted((REPO / "generated").glob("*.py")):
        if path.name == "__init__.py":
            continue
        mod = family(path.stem)
        own = {d.name for d in mod.TENSORS}
        bound = {b.engine_name for d in mod.TENSORS for b in (*d.inputs, *d.outputs)}
        rules = set(mod.RuntimeBuffers.no_advance)  # rule names, named in advance()'s error
        quoted = set(re.findall(r"'(\w+)'", path.read_text()))
        assert (quoted & names) - own - bound - rules == set(), path.name


def test_static_inputs_are_bound_once_and_set_at_construction():
    c = config_for("recurrentgemma", HYBRID)
    mod = family("recurrentgemma")
    b = mod.RuntimeBuffers(
        c,
        static_inputs={
            "host_conv_state_pointers": [[10], [11], [12], [13]],
            "host_runtime_perf_knobs": 5,
        },
    )
    s = b.static_inputs
    assert sorted(s) == sorted(
        [
            "conv_state_ptr_0",
            "conv_state_ptr_1",
            "conv_state_ptr_3",
            "rnn_state_ptr_0",
            "rnn_state_ptr_1",
            "rnn_state_ptr_3",
        ]
        + ["host_runtime_perf_knobs", "host_kv_cache_pool_pointers", "host_kv_cache_pool_mapping"]
    )
    assert s["conv_state_ptr_3"].tolist() == [13]  # layer 2 is the attention layer
    assert s["host_runtime_perf_knobs"].tolist() == [5] * 16
    assert s["host_kv_cache_pool_mapping"].shape == (1, 2)  # one attention layer of four
    assert b.tensors["host_rnn_state_pointers"].tolist() == [[0]] * 4
    with pytest.raises(ValueError, match="'logits' is not a static tensor of this family"):
        b.set_static("logits", 1)
    with pytest.raises(ValueError, match="do not broadcast to its shape"):
        b.set_static("host_conv_state_pointers", [1, 2, 3])
    fresh = family("llama").RuntimeBuffers(config_for("llama", {}))
    assert fresh.static_inputs["host_runtime_perf_knobs"].tolist() == [-1] * 16  # the pad value


def test_ring_binds_the_next_slot_every_step():
    from bufc.runtime import Request

    b = family("gpt").RuntimeBuffers(config_for("gpt", {"gather_generation_logits": True}))
    cache = b.tensors["generation_logits_cache"]
    slots = []
    for _ in range(10):
        step = b.prepare_step([], [Request(seq_slot=0, prompt=[1], generated=[[2]])])
        view = step.outputs["logits"]
        slots.append(step.ring_slots["generation_logits_cache"])
        assert view.data_ptr() == cache[slots[-1]].data_ptr() and view.shape == cache.shape[1:]
    assert slots == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        0,
        1,
    ]  # the constructor takes none (reference: it does)
    assert torch.is_tensor(view)
