"""Beam search on a real model: requests of beam width 2 and 4 under in-flight batching (mixed
context and generation steps, chunked prefill, a paged KV cache whose beams share the prompt's
blocks and read each other's KV through the cache indirection bufc binds) return exactly
transformers.generate(num_beams=W)'s beams and sequences_scores, and every beam's logits of
every step equal a teacher-forced forward (float64); one wrong position id, sequence length or
cache-indirection copy destination makes the comparison fail."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


from bufc.examples.beam import (  # noqa: E402
    BeamExecutor,
    assert_logits_match,
    assert_same_beams,
    beam_workload,
    reference_beams,
)
from bufc.examples.compare import Mismatch, tiny_llama  # noqa: E402

TOL = 1e-9
SETUP = dict(
    max_batch_size=6,
    max_beam_width=4,
    token_budget=24,
    chunk_size=10,
    tokens_per_block=4,
    max_sequence_length=64,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def jobs():
    return beam_workload(14, seed=1, max_new_tokens=8)


@pytest.fixture(scope="module")
def reference(model, jobs):
    return reference_beams(model, jobs)


@pytest.fixture(scope="module")
def clean(model, jobs):
    """The unmutated run, with what each prepared step scheduled."""
    ex = BeamExecutor(model, **SETUP)
    scheduled = []
    prepare = ex.buffers.prepare_step

    def spy(context, generation):
        tpb = SETUP["tokens_per_block"]
        for r in generation:
            lists, shared = r.kv_block_ids, len(r.prompt) // tpb
            own = [b for x in lists for b in x[shared:]]
            assert len(lists) == r.beam_width
            assert all(x[:shared] == lists[0][:shared] for x in lists), "prompt blocks not shared"
            assert len(own) == len(set(own)), "two beams share a block past the prompt's"
        scheduled.append(([r.beam_width for r in context], [r.beam_width for r in generation]))
        return prepare(context, generation)

    ex.buffers.prepare_step = spy
    return ex, ex.run(jobs), scheduled


def test_workload_covers_the_contract(jobs, clean):
    ex, result, scheduled = clean
    widths = {j.beam_width for j in jobs}
    assert widths == {2, 4} and ex.config.max_beam_width == 4
    assert {j.length_penalty for j in jobs} == {1.0, 0.7}
    assert any(s.context_requests and s.generation_requests for s in result.steps), "no mixed step"
    assert any(ctx and set(gen) == {2, 4} for ctx, gen in scheduled), "no mixed widths in a step"
    assert any(len(j.prompt) > SETUP["chunk_size"] for j in jobs), "no chunked prompt"
    assert result.advanced > 0, "no steady decode step through advance()"
    assert result.reordered > 0, "no beam ever took another slot's history"
    assert ex.allocator.free == ex.allocator.num_blocks  # every block came back


def test_beams_and_scores_equal_transformers_generate(model, reference, clean):
    result = clean[1]
    figures = assert_same_beams(result, reference, tol=TOL)
    worst_logit = assert_logits_match(model, result, tol=TOL)
    print(
        f"\nmax |score - sequences_scores| {figures.max_score_difference:.3g}, max |log-prob - "
        f"scores| {figures.max_log_prob_difference:.3g}, max |logit - teacher-forced| "
        f"{worst_logit:.3g}"
    )
    assert figures.max_score_difference <= TOL and worst_logit <= TOL


def _target_step(result) -> int:
    """The first mixed step with two or more generation requests."""
    return next(s.step for s in result.steps if s.context_requests and s.generation_requests >= 2)


def _wrong_copy_destination(step, copies):
    copies[1, 0] = copies[1, 1]  # generation request 0's beams land on request 1's rows


MUTATIONS = {
    "position id + 1 (one beam)": lambda step, copies: step.inputs["position_ids"][-1].add_(1),
    "sequence length + 1 (one beam)": lambda step, copies: step.inputs["sequence_length"][-1].add_(
        1
    ),
    "cache_indirection_copies destination": _wrong_copy_destination,
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_one_wrong_value_makes_the_comparison_fail(model, jobs, reference, clean, name):
    target = _target_step(clean[1])

    def mutate(index, step, copies):
        if index == target:
            MUTATIONS[name](step, copies)

    result = BeamExecutor(model, **SETUP).run(jobs, mutate=mutate)
    with pytest.raises(Mismatch) as exc:
        assert_logits_match(model, result, tol=TOL)
        assert_same_beams(result, reference, tol=TOL)
    print(f"\n{name}: {exc.value}")
    assert f"at step {target}:" in str(exc.value)
