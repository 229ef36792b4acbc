"""Speculative decoding (Medusa) on a real Llama through the generated medusa buffers: whatever
the drafts, every request's tokens equal transformers.generate (greedy) and every logit row (1 +
drafts per request) equals the HF model's logits at its position; rejected, partly and fully
accepted drafts, drafts on last context chunks and mixed steps all happen; and the comparison
fails when one draft's position offset, one last-token index or one packed-mask bit is wrong."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bufc.examples.compare import (  # noqa: E402
    Mismatch,
    assert_same_tokens,
    reference_tokens,
    tiny_llama,
)
from bufc.examples.executor import Executor  # noqa: E402
from bufc.examples.speculative import (  # noqa: E402
    HFLogits,
    LogitsMismatch,
    MedusaDrafts,
    MedusaHeads,
    NoisyOracle,
    SpeculativeExecutor,
    workload,
)
from bufc.runtime import BatchError, Request  # noqa: E402

TOL = 1e-9


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def jobs():
    return workload(14, seed=3, max_prompt=48)


@pytest.fixture(scope="module")
def reference(model, jobs):
    return reference_tokens(model, jobs)


@pytest.fixture(scope="module")
def hf(model):
    return HFLogits(model)  # memoised: the runs share most prefixes


def compare(result, reference, hf) -> float:
    """Logits first, in step order (a wrong token follows a wrong logit row), then tokens."""
    from bufc.examples.speculative import assert_logits_match

    worst = assert_logits_match(result, hf, TOL)
    assert_same_tokens(result, reference)
    return worst


MAIN = dict(
    max_draft_tokens=3,
    max_batch_size=6,
    token_budget=40,
    chunk_size=12,
    tokens_per_block=4,
    max_sequence_length=128,
)


def oracle_executor(model, reference, *, noise=0.3, **overrides) -> SpeculativeExecutor:
    kwargs = {**MAIN, **overrides}
    source = NoisyOracle(reference, kwargs["max_draft_tokens"], 512, noise=noise, seed=2)
    return SpeculativeExecutor(model, source, **kwargs)


def _outcome(v) -> str:
    if v.accepted == 0:
        return "rejected"
    return "full" if v.accepted == v.proposed else "partial"


@pytest.fixture(scope="module")
def main_run(model, jobs, reference):
    ex = oracle_executor(model, reference)
    return ex, ex.run(jobs)


def test_speculative_decoding_equals_transformers_generate(model, jobs, reference, hf, main_run):
    ex, result = main_run
    worst = compare(result, reference, hf)

    gen = {_outcome(v) for v in result.verifications if v.kind == "generation"}
    ctx = {_outcome(v) for v in result.verifications if v.kind == "context"}
    assert gen == {"rejected", "partial", "full"}, gen
    assert "rejected" in ctx and ctx & {"partial", "full"}, ctx  # drafts on last chunks
    steps = result.steps
    assert any(s.context_requests and s.generation_requests for s in steps), "no mixed step"
    assert any(s.context_drafts and s.generation_requests for s in steps), (
        "no mixed step with context drafts"
    )
    prompts = {j.rid: len(j.prompt) for j in jobs}
    assert any(r.first + 1 < prompts[r.rid] for r in result.records), "no chunked prefill"
    assert any(
        v.kind == "context" and prompts[v.rid] > MAIN["chunk_size"] for v in result.verifications
    ), "no drafts on the last chunk of a chunked prompt"
    assert len({j.arrival_step for j in jobs}) > 1
    assert max(s.tokens for s in steps) <= MAIN["token_budget"]
    k = MAIN["max_draft_tokens"]  # logit rows: 1 + drafts per request
    assert all(
        s.logits == s.context_requests + s.context_drafts + s.generation_requests * (1 + k)
        for s in steps
    )
    assert ex.allocator.free == ex.allocator.num_blocks  # every block came back

    plain = Executor(model, **{k: v for k, v in MAIN.items() if k != "max_draft_tokens"}).run(jobs)
    assert_same_tokens(plain, reference)
    assert result.steps_saved > 0 and len(steps) < len(plain.steps)
    print(
        f"\nspeculative K=3: {len(steps)} steps (one token per step: {len(plain.steps)}); "
        f"drafts accepted {result.accepted}/{result.proposed} "
        f"({100 * result.acceptance_rate:.1f} %); token steps saved {result.steps_saved}; "
        f"max |logits - HF| {worst:.2e}"
    )


CONFIGS = {
    # one draft, one-token blocks, small chunks
    "K1-tpb1-chunk7": dict(max_draft_tokens=1, tokens_per_block=1, chunk_size=7, token_budget=24),
    "K5-tpb16-chunk20": dict(
        max_draft_tokens=5, tokens_per_block=16, chunk_size=20, token_budget=64
    ),
    # 34 tree tokens: two mask words, bit 31 of the first one set (a negative int32)
    "K33-two-mask-words": dict(
        max_draft_tokens=33, tokens_per_block=8, chunk_size=16, token_budget=80, noise=0.03
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_other_draft_counts_and_block_sizes(model, jobs, reference, hf, name):
    kwargs = dict(CONFIGS[name])
    picked = jobs if kwargs["max_draft_tokens"] < 33 else jobs[:6]
    result = oracle_executor(model, reference, **kwargs).run(picked)
    compare(result, {j.rid: reference[j.rid] for j in picked}, hf)
    gen = [v for v in result.verifications if v.kind == "generation"]
    assert all(v.proposed == kwargs["max_draft_tokens"] for v in gen)
    assert any(v.accepted for v in gen) and any(v.accepted < v.proposed for v in gen)


def test_drafts_from_random_medusa_heads(model, jobs, reference, hf):
    """The drafts are the heads' top-1 tokens, read from the family's medusa_logits output
    at each request's bonus row (random heads: nearly all rejected, still exact)."""
    heads = MedusaHeads(model, 3, seed=1)
    ex = SpeculativeExecutor(model, MedusaDrafts(), medusa_heads=heads, **MAIN)
    result = ex.run(jobs[:8])
    compare(result, {j.rid: reference[j.rid] for j in jobs[:8]}, hf)
    assert result.proposed and any(v.kind == "generation" for v in result.verifications)


def test_generation_requests_carry_exactly_max_draft_tokens(model, reference):
    ex = oracle_executor(model, reference)
    short = Request(seq_slot=0, prompt=[1, 2], generated=[[3]], draft_tokens=[4, 5])
    short.kv_block_ids = [[1, 2]]
    with pytest.raises(BatchError, match="exactly|max_draft_tokens=3"):
        ex.buffers.prepare_step([], [short])


def _offset(step):
    offsets = step.inputs["spec_decoding_position_offsets"]
    offsets[0, 2] += 1  # the second draft of the first generation request

    def undo():
        offsets[0, 2] -= 1

    return undo


def _last_token(step):
    step.inputs["last_token_ids"][-1] -= 1  # refilled by the next prepare_step


def _mask_bit(step):
    mask = step.inputs["spec_decoding_packed_mask"]
    depth = step.inputs["spec_decoding_position_offsets"].shape[1]
    row = 0 * depth + 2  # the first generation request's tree token 2 (its second draft)
    mask[row, 0] &= ~(1 << 1)  # no longer sees tree token 1 (its first draft)

    def undo():
        mask[row, 0] |= 1 << 1

    return undo


MUTATIONS = {
    "draft position offset + 1": _offset,
    "last_token_ids entry - 1": _last_token,
    "packed-mask bit cleared": _mask_bit,
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_one_wrong_tree_input_makes_the_comparison_fail(model, jobs, reference, hf, main_run, name):
    _, clean = main_run
    target = next(s.step for s in clean.steps if s.context_requests and s.generation_requests)

    def mutate(index, step):
        return MUTATIONS[name](step) if index == target else None

    result = oracle_executor(model, reference).run(jobs, mutate=mutate)
    with pytest.raises((LogitsMismatch, Mismatch)) as exc:
        compare(result, reference, hf)
    print(f"\n{name}: {exc.type.__name__}: {exc.value}")
    assert exc.type is LogitsMismatch and f"step {target}:" in str(exc.value)
