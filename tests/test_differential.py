"""The generated modules against the loop-by-loop reference, on many random batches."""

from __future__ import annotations

import copy

from conftest import VARIANT, assert_matches_reference, batch, make_buffers
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
    want = reference_step(
        VARIANT[name], ref_ctx, ref_gen, vocab_size=buffers.config.vocab_size, kv=kv
    )
    step = buffers.prepare_step(ctx, gen)
    assert {k: getattr(step.sizes, k) for k in want["sizes"]} == want["sizes"]
    assert_matches_reference(step, want, paged=kv is not None)
    n = step.sizes.num_requests
    assert buffers.tensors["host_seq_slots"][:n].tolist() == want["seq_slots"]
    assert buffers.tensors["seq_slots"][:n].tolist() == want["seq_slots"]
    assert step.inputs["row_slots"].tolist() == want["row_slots"]
    assert step.inputs["row_slots_cpu"].tolist() == want["row_slots"]
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


@st.composite
def family_and_wide_batch(draw):
    name = draw(st.sampled_from(["gpt", "chatglm", "glm", "llama"]))
    ctx, gen = draw(batch(VARIANT[name], max_requests=24, slots=24))
    return name, ctx, gen


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family_and_wide_batch())
def test_many_context_requests_match_reference(case):
    """Up to 24 requests, so that a step has more context requests than the few whose
    positions the rule writes one range at a time (its vectorised branch runs too)."""
    name, ctx, gen = case
    buffers = make_buffers(name, max_batch_size=24, max_num_tokens=2048)
    assert_step_matches(name, buffers, ctx, gen)
