"""The generated modules against the loop-by-loop reference, on many random batches."""

from __future__ import annotations

import copy

from conftest import BASE, VARIANT, batch, make_buffers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_step

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_step_matches(name: str, buffers, ctx, gen) -> None:
    ref_ctx, ref_gen = copy.deepcopy(ctx), copy.deepcopy(gen)
    kv = (
        (buffers.config.max_blocks_per_seq, buffers.config.num_local_layers)
        if name == "llama"
        else None
    )
    want = reference_step(VARIANT[name], ref_ctx, ref_gen, vocab_size=BASE["vocab_size"], kv=kv)
    step = buffers.prepare_step(ctx, gen)
    got = {k: v.tolist() for k, v in step.inputs.items()}
    assert {k: getattr(step.sizes, k) for k in want["sizes"]} == want["sizes"]
    for key in (
        "input_ids",
        "context_lengths",
        "host_context_lengths",
        "sequence_length",
        "host_request_types",
        "host_past_key_value_lengths",
        "last_token_ids",
        "position_ids",
    ):
        assert got[key] == want[key], key
    if kv is not None:
        assert got["kv_cache_block_offsets"] == want["kv_cache_block_offsets"]
        assert got["host_kv_cache_block_offsets"] == want["kv_cache_block_offsets"]
    n = step.sizes.num_requests
    assert buffers.tensors["host_seq_slots"][:n].tolist() == want["seq_slots"]
    assert buffers.tensors["seq_slots"][:n].tolist() == want["seq_slots"]
    assert list(step.outputs["logits"].shape) == want["logits_shape"]
    assert step.max_kv_cache_length_rounded == want["max_kv_cache_length_rounded"]
    if name == "glm":  # the mask position is stored on each context request, as the reference does
        assert [r.mask_position for r in ctx] == [r.mask_position for r in ref_ctx]


@st.composite
def family_and_batches(draw):
    name = draw(st.sampled_from(["gpt", "chatglm", "glm", "llama"]))
    return name, draw(st.lists(batch(VARIANT[name]), min_size=1, max_size=3))


@SETTINGS
@given(family_and_batches())
def test_random_batches_match_reference(case):
    name, batches = case
    buffers = make_buffers(name)  # several steps through the same buffers: no stale values
    for ctx, gen in batches:
        assert_step_matches(name, buffers, ctx, gen)
