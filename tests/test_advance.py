"""`advance(tokens)`: the O(1)-Python decode step equals a full prepare_step of the same
requests with the tokens appended, for every family, over many random steps."""

from __future__ import annotations

import copy

import pytest
from conftest import BASE, VARIANT, assert_matches_reference, generation_request, make_buffers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_step

from bufc.runtime import BatchError, Request

TPB = 4  # small blocks: sequences start new blocks often


def need_blocks(r) -> list[list[int]]:
    return [
        list(
            range(
                1000 * r.seq_slot + 10 * b,
                1000 * r.seq_slot + 10 * b + -(-(len(r.prompt) + len(g)) // TPB),
            )
        )
        for b, g in enumerate(r.generated)
    ]


@st.composite
def decode_case(draw):
    name = draw(st.sampled_from(["gpt", "chatglm", "glm", "llama"]))
    n = draw(st.integers(1, 8))
    slots = draw(st.permutations(range(BASE["max_batch_size"])))[:n]
    reqs = [draw(generation_request(VARIANT[name], slots[i], max_drafts=0)) for i in range(n)]
    steps = draw(st.integers(1, 6))
    tokens = draw(
        st.lists(st.integers(0, BASE["vocab_size"] - 1), min_size=steps * 32, max_size=steps * 32)
    )
    return name, reqs, steps, tokens, draw(st.booleans())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_case())
def test_advance_equals_a_full_step(case):
    """With the staging arena double-buffered or not (one half, advanced in place)."""
    name, reqs, steps, tokens, double_buffered = case
    for r in reqs:
        r.kv_block_ids = need_blocks(r)
    extra = {"tokens_per_block": TPB} if name == "llama" else {}
    b = make_buffers(name, max_attention_window=512, double_buffered=double_buffered, **extra)
    kv = (b.config.max_blocks_per_seq, b.config.num_local_layers) if name == "llama" else None
    # two runs (a full step, then advances), the second in reverse order: neither half may
    # keep values of the first run that the second does not write
    for run, order in enumerate((reqs, reqs[::-1])):
        b.prepare_step([], order)
        for k in range(steps):
            seqs = sum(r.beam_width for r in order)
            new = tokens[k * 32 : k * 32 + seqs]
            it = iter(new)
            for r in order:  # the caller appends the sampled tokens, and a block where one starts
                for beam in r.generated:
                    beam.append(next(it))
                for beam, ids in zip(r.generated, r.kv_block_ids):
                    if (len(r.prompt) + len(beam) - 1) % TPB == 0:
                        ids.append(ids[-1] + 1)
            step = b.advance(new)
            want = reference_step(
                VARIANT[name], [], copy.deepcopy(order), vocab_size=b.config.vocab_size, kv=kv
            )
            assert_matches_reference(step, want, paged=kv is not None, where=(run, k))


def test_advance_needs_a_generation_only_step_and_one_token_per_sequence():
    b = make_buffers("gpt")
    with pytest.raises(BatchError, match="follows a generation-only step"):
        b.advance([1])
    ctx = Request(seq_slot=0, prompt=[1, 2, 3])
    gen = Request(seq_slot=1, prompt=[4], generated=[[5]])
    b.prepare_step([ctx], [gen])
    with pytest.raises(BatchError, match="follows a generation-only step"):
        b.advance([1, 2])
    b.prepare_step([], [gen, Request(seq_slot=2, prompt=[4], generated=[[5], [6]], beam_width=2)])
    with pytest.raises(BatchError, match="needs 3 tokens, one per sequence, got 2"):
        b.advance([1, 2])
    b.prepare_step([], [Request(seq_slot=1, prompt=[4], generated=[[5]], draft_tokens=[7])])
    with pytest.raises(BatchError, match="without draft tokens"):
        b.advance([1])


def test_advance_without_the_next_kv_block_raises_and_leaves_the_step_as_it_was():
    b = make_buffers("llama", tokens_per_block=TPB, max_attention_window=512)
    r = Request(seq_slot=0, prompt=[1, 2, 3], generated=[[4]], kv_block_ids=[[9]])
    step = b.prepare_step([], [r])
    before = {k: v.clone() for k, v in step.inputs.items()}
    with pytest.raises(BatchError, match="needs KV block 1, which kv_block_ids does not hold"):
        b.advance([5])  # token 5 starts block 1; the request has one block
    again = b._step(step.sizes, step.sizes)  # noqa: SLF001 - the visible step is unchanged
    for key, value in before.items():
        assert again.inputs[key].tolist() == value.tolist(), key
    r.kv_block_ids[0].append(3)
    step = b.advance([5])
    assert step.inputs["kv_cache_block_offsets"][0, 0, 0, :2].tolist() == [9 * 8, 3 * 8]
