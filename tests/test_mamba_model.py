"""A real Mamba driven by the generated mamba buffers equals transformers, token for token and
logit for logit (float64, within 1e-9), under in-flight batching with state slots that later
requests reuse; and the comparison can fail: a swapped slot_mapping row, a last-token index off
by one or a flipped request type breaks it at the step it was made in."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from step_mutations import assert_fails_at, first_row, first_target  # noqa: E402

from bufc.examples.compare import Mismatch, reference_tokens  # noqa: E402
from bufc.examples.executor import Job  # noqa: E402
from bufc.examples.mamba import (  # noqa: E402
    MambaDriver,
    check,
    mamba_workload,
    tiny_mamba,
)
from bufc.runtime import BatchError, Request  # noqa: E402

TOL = 1e-9
DRIVER = dict(max_batch_size=4, max_num_tokens=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_mamba(seed=0)


@pytest.fixture(scope="module")
def jobs(model):
    return mamba_workload(16, seed=1, vocab_size=model.config.vocab_size)


@pytest.fixture(scope="module")
def reference(model, jobs):
    return reference_tokens(model, jobs)


@pytest.fixture(scope="module")
def clean(model, jobs):
    return MambaDriver(model, **DRIVER).run(jobs)


def test_in_flight_mamba_equals_transformers(model, jobs, reference, clean):
    worst = check(model, clean, reference, TOL)  # every logit row, then every token
    assert worst <= TOL
    steps = clean.steps
    assert sum(len(s.rids) for s in steps) == sum(j.max_new_tokens for j in jobs)
    # the family's contract: context and generation in separate steps, whole prompts
    assert {s.kind for s in steps} == {"context", "generation"}
    for s in steps:
        if s.kind == "context":
            assert sum(s.prompt_lengths) <= DRIVER["max_num_tokens"]
    # requests waited for a slot, and later requests reused the slots of finished ones
    assert any(s.waiting and len(s.rids) == DRIVER["max_batch_size"] for s in steps)
    assert clean.slot_reuses > 0
    assert clean.slot_reuses == sum(sum(s.reused_slot) for s in steps)
    # a context step follows a context step only when nothing runs; steady steps use advance()
    for a, b in zip(steps, steps[1:]):
        if a.kind == b.kind == "context" and b.step == a.step + 1:
            assert a.running == 0
    assert any(s.advanced for s in steps)


def test_steady_decoding_uses_advance_and_stays_exact(model):
    jobs = [Job(rid=i, prompt=tuple(range(5 + i, 14 + 3 * i)), max_new_tokens=8) for i in range(4)]
    driver = MambaDriver(model, **DRIVER)
    calls = []
    advance = driver.buffers.advance
    driver.buffers.advance = lambda tokens: calls.append(len(tokens)) or advance(tokens)
    result = driver.run(jobs)
    # one context step (4 whole prompts), one prepared generation step, then advance()
    assert [s.kind for s in result.steps] == ["context"] + ["generation"] * 7
    assert calls == [4] * 6
    assert check(model, result, reference_tokens(model, jobs), TOL) <= TOL


def _swap_slots(step, row):
    slots = step.inputs["slot_mapping"]
    slots[[row, row + 1]] = slots[[row + 1, row]]


def _flip_type(step, row):
    types = step.inputs["host_request_types"]
    types[row] = 1 - types[row]


# name -> (picks the step and row to mutate in the clean run, the mutation)
MUTATIONS = {
    # two generation rows exchange states: each continues the other's sequence
    "slot_mapping rows swapped": (
        first_row("generation", lambda s, i: i == 0 and len(s.rids) >= 2),
        _swap_slots,
    ),
    # the second context row's logits are taken one token early
    "last_token_ids - 1": (
        first_row("context", lambda s, i: i == 1),
        lambda step, row: step.inputs["last_token_ids"][row].sub_(1),
    ),
    # a 1-token prompt (so the tokens still add up) on a slot an earlier request used: as a
    # generation row it continues that request's stale state instead of starting from zero
    "request type context -> generation": (
        first_row("context", lambda s, i: s.prompt_lengths[i] == 1 and s.reused_slot[i]),
        _flip_type,
    ),
    # a generation row of a 1-token prompt (its context length is 1): as a context row its
    # state restarts from zero
    "request type generation -> context": (
        first_row("generation", lambda s, i: s.prompt_lengths[i] == 1),
        _flip_type,
    ),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_one_wrong_value_makes_the_comparison_fail(model, jobs, reference, clean, name):
    pick, mutation = MUTATIONS[name]
    target, row = first_target(clean.steps, pick)

    def mutate(index, step):
        if index == target:
            mutation(step, row)

    result = MambaDriver(model, **DRIVER).run(jobs, mutate=mutate)
    with pytest.raises(Mismatch) as exc:
        check(model, result, reference, TOL)
    assert_fails_at(exc, target, name)


def test_the_engine_refuses_a_state_pointer_that_is_not_a_pool(model, jobs):
    driver = MambaDriver(model, **DRIVER)
    pointers = [[t.data_ptr()] for t in driver.pools.conv]
    pointers[1] = [pointers[1][0] + 8]
    driver.buffers.set_static("host_conv_state_pointers", pointers)
    with pytest.raises(ValueError, match=r"conv_state_ptr_1 = 0x[0-9a-f]+ is not the address"):
        driver.run(jobs[:1])


def test_the_runtime_refuses_batches_the_engine_cannot_take(model):
    buffers = MambaDriver(model, **DRIVER).buffers
    with pytest.raises(BatchError, match="chunked context is not supported"):
        buffers.prepare_step([Request(seq_slot=0, prompt=[1, 2, 3], context_chunk_size=2)], [])
    with pytest.raises(BatchError, match="separate steps"):
        buffers.prepare_step(
            [Request(seq_slot=0, prompt=[1, 2])],
            [Request(seq_slot=1, prompt=[3], generated=[[4]])],
        )
