"""A real RecurrentGemma driven by the generated recurrentgemma buffers equals transformers,
token for token and logit for logit (float64, within 1e-9).

The model has six layers, two of them attention layers (2 and 5) with a 10-token sliding
window, shorter than most prompts; the engine (bufc.examples.recurrentgemma) reads only the
step's bound tensors: its attention layers share one paged, cyclic KV pool addressed through
kv_cache_block_offsets (the pool's 2 layers in the KVCacheIndex encoding),
host_kv_cache_pool_mapping and host_max_attention_window_sizes, and its recurrent layers keep
their convolution and RG-LRU states in per-slot pools found through the conv/rnn state pointers
and slot_mapping. The requests are served in flight (add / step / finish): arrivals over time,
whole prompts in context steps of their own (generation=False), KV blocks grown from an
allocator, slots (and their states) reused by later requests.

And the comparison can fail: one wrong value in a bound tensor (the two attention layers'
rows of the pool mapping swapped, or both (0, 0) as bufc once left them; block ids encoded with
all six layers; a swapped slot_mapping row; a last-token index, a sequence length or a window
off by one; a request type flipped, so that a prompt on a reused slot continues the state its
last request left instead of restarting it) breaks it at the step it was made in. The bound
values are also checked directly against TensorRT-LLM's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import numpy as np  # noqa: E402
from step_mutations import assert_fails_at, first_row, first_target  # noqa: E402

from bufc.examples.compare import Mismatch, torch_threads  # noqa: E402
from bufc.examples.recurrentgemma import (  # noqa: E402
    RecurrentGemmaDriver,
    Reference,
    check,
    reference_tokens,
    tiny_recurrentgemma,
    workload,
)
from bufc.runtime import Request  # noqa: E402

TOL = 1e-9
WINDOW = 10
DRIVER = dict(max_batch_size=4, max_num_tokens=64, tokens_per_block=4, kv_blocks=64)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_recurrentgemma(seed=0, window=WINDOW)


@pytest.fixture(scope="module")
def jobs(model):
    return workload(32, seed=1, vocab_size=model.config.vocab_size, window=WINDOW)


@pytest.fixture(scope="module")
def tokens(model, jobs):
    with torch_threads(1):
        return reference_tokens(model, jobs)


@pytest.fixture(scope="module")
def reference(model):
    return Reference(model)  # shared: the mutated runs repeat the clean run's sequences


@pytest.fixture(scope="module")
def clean(model, jobs):
    with torch_threads(1):
        return RecurrentGemmaDriver(model, **DRIVER).run(jobs)


def test_in_flight_recurrentgemma_equals_transformers(model, jobs, tokens, reference, clean):
    worst = check(reference, clean, tokens, TOL)  # every logit row, then every token
    assert worst <= TOL
    steps = clean.steps
    rows = sum(len(s.rids) for s in steps)
    assert rows == sum(j.max_new_tokens for j in jobs) == sum(map(len, tokens.values()))
    print(f"{len(jobs)} requests, {len(steps)} steps, {rows} logit rows, worst {worst:.3g}")
    # whole prompts in context steps of their own, within the token budget
    assert {s.kind for s in steps} == {"context", "generation"}
    for s in steps:
        if s.kind == "context":
            assert sum(s.prompt_lengths) <= DRIVER["max_num_tokens"]
    # prompts longer than the window, and decoding past it (the cyclic cache wrapped)
    assert any(s.kind == "context" and max(s.prompt_lengths) > WINDOW for s in steps)
    assert sum(s.wrapped for s in steps) > 0
    # requests waited for a slot; later requests reused the slots (and states) of finished
    # ones, generation steps grew KV blocks
    assert any(s.waiting and len(s.rids) == DRIVER["max_batch_size"] for s in steps)
    assert clean.slot_reuses > 0 and any(any(s.reused_slot) for s in steps)
    assert clean.blocks_grown > 0


def test_bound_values_match_tensorrt_llm(model):
    """TensorRT-LLM's pool holds the attention layers only (2 of 6): block b of a sequence is
    b * 2 * 2 (+1 for V), attention layer a is (pool 0, index a), each with the model's
    window; the recurrent layers (0, 1, 3, 4) are bound to the driver's state pools."""
    driver = RecurrentGemmaDriver(model, **DRIVER)
    c, b, storage = driver.config, driver.buffers, driver.storage
    assert c.kv_pool_layers == (2,) and c.num_local_attention_layers == 2
    static = b.static_inputs
    assert static["host_kv_cache_pool_mapping"].tolist() == [[0, 0], [0, 1]]
    assert static["host_kv_cache_pool_pointers"].tolist() == [[storage.kv.data_ptr(), 0]]
    for i in (0, 1, 3, 4):
        assert int(static[f"conv_state_ptr_{i}"][0]) == storage.conv[i].data_ptr()
        assert int(static[f"rnn_state_ptr_{i}"][0]) == storage.rnn[i].data_ptr()
    assert not any(f"state_ptr_{i}" in name for name in static for i in (2, 5))
    assert c.max_blocks_per_seq == 3  # the cyclic cache: 10 tokens in blocks of 4
    b.add(Request(seq_slot=2, prompt=list(range(1, 14)), kv_block_ids=[[5, 7, 9]]))
    step = b.step(None, generation=False)
    inputs = step.inputs
    assert inputs["kv_cache_block_offsets"].tolist() == [[[[20, 28, 36], [21, 29, 37]]]]
    assert inputs["host_max_attention_window_sizes"].tolist() == [WINDOW, WINDOW]
    assert inputs["slot_mapping"].tolist() == [2]
    assert inputs["host_past_key_value_lengths"].tolist() == [13]
    assert inputs["last_token_ids"].tolist() == [13]
    sampled = np.zeros(c.max_batch_size, np.int64)
    sampled[2] = 99
    inputs = b.step(sampled).inputs  # decoding past the window: no block to add
    assert inputs["input_ids"].tolist() == [99] and inputs["position_ids"].tolist() == [13]
    assert inputs["sequence_length"].tolist() == [14]
    assert inputs["host_past_key_value_lengths"].tolist() == [13]
    assert inputs["host_request_types"].tolist() == [1]
    assert inputs["kv_cache_block_offsets"].tolist() == [[[[20, 28, 36], [21, 29, 37]]]]


# ------------------------------------------------------------------------------ mutations
def _swap_mapping(inputs, static, row):
    static["host_kv_cache_pool_mapping"][[0, 1]] = static["host_kv_cache_pool_mapping"][[1, 0]]


def _mapping_zeros(inputs, static, row):
    static["host_kv_cache_pool_mapping"].zero_()


def _six_layer_ids(inputs, static, row):
    offsets = inputs["kv_cache_block_offsets"]  # b * 2 * 2 + kv -> b * 6 * 2 + kv
    offsets.copy_(offsets // 4 * 12 + offsets % 2)


def _swap_slots(inputs, static, row):
    slots = inputs["slot_mapping"]
    slots[[row, row + 1]] = slots[[row + 1, row]]


ANY_ROW = first_row("generation", lambda s, i: i == 0)
PAST_WINDOW = first_row("generation", lambda s, i: s.positions[i] >= WINDOW)

# name -> (picks the step and row to mutate in the clean run, the mutation)
MUTATIONS = {
    # attention layer 2 writes and reads layer 5's cache, and 5 layer 2's
    "pool mapping rows swapped": (ANY_ROW, _swap_mapping),
    # both attention layers in layer 0 of the pool (what bufc used to leave): layer 5 reads 2's
    "pool mapping both (0, 0)": (ANY_ROW, _mapping_zeros),
    # the KVCacheIndex of a pool of every layer, not of the pool's two attention layers
    "block ids encoded with 6 layers": (ANY_ROW, _six_layer_ids),
    # two generation rows exchange states: each continues the other's sequence
    "slot_mapping rows swapped": (
        first_row("generation", lambda s, i: len(s.rids) > i + 1),
        _swap_slots,
    ),
    # the second context row's logits are taken one token early
    "last_token_ids - 1": (
        first_row("context", lambda s, i: i == 1),
        lambda inputs, static, row: inputs["last_token_ids"][row].sub_(1),
    ),
    # a token past the window written over the one before it, the window read one back
    "sequence_length - 1": (
        PAST_WINDOW,
        lambda inputs, static, row: inputs["sequence_length"][row].sub_(1),
    ),
    # the first attention layer's cyclic cache taken as 9 tokens
    "window - 1": (
        PAST_WINDOW,
        lambda inputs, static, row: inputs["host_max_attention_window_sizes"][0].sub_(1),
    ),
    # a 1-token prompt (so the tokens still add up) on a slot an earlier request used: as a
    # generation row it continues that request's stale state instead of restarting it
    "request type context -> generation": (
        first_row("context", lambda s, i: s.prompt_lengths[i] == 1 and s.reused_slot[i]),
        lambda inputs, static, row: inputs["host_request_types"][row].fill_(1),
    ),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_one_wrong_value_makes_the_comparison_fail(model, jobs, tokens, reference, clean, name):
    pick, mutation = MUTATIONS[name]
    target, row = first_target(clean.steps, pick)

    def mutate(index, inputs, static):
        if index == target:
            mutation(inputs, static, row)

    result = RecurrentGemmaDriver(model, **DRIVER).run(jobs, mutate=mutate, stop_after=target)
    with pytest.raises(Mismatch) as exc:
        check(reference, result, tokens, TOL)
    assert_fails_at(exc, target, name)


def test_the_engine_refuses_an_address_that_is_not_a_pool(model, jobs):
    driver = RecurrentGemmaDriver(model, **DRIVER)
    driver.buffers.set_static(
        "host_kv_cache_pool_pointers", [[driver.storage.kv.data_ptr() + 8, 0]]
    )
    with pytest.raises(ValueError, match=r"pool_pointers\[0\] = 0x[0-9a-f]+ is not the address"):
        driver.run(jobs[:1])
