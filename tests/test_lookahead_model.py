"""Lookahead decoding on a real Llama through the generated lookahead buffers (TensorRT-LLM's
lookahead runtime contract): a Jacobi window of W columns and G n-gram guesses of N - 1 tokens,
merged into one tree per generation request (up to N - 2 + (W - 1 + G)(N - 1) drafts) and
verified in one base-model step while requests arrive, prefill in chunks, finish and hand their
slots on. Proven here:

* every request's tokens equal transformers.generate (greedy, float64), and every logit row
  (one per tree node, one per context chunk) equals the HF model's logits at its position
  within 1e-9, over four seeds with a noisy oracle among the guesses, one run of lookahead
  alone (its window and n-gram pool) and one of trees over 32 nodes (two mask words):
  bufc's position_ids bound per token (the context part bufc's, the generation part the
  drafter's), past KV and sequence lengths, last_token_ids, block offsets and the shapes it
  binds the drafter's tensors at (spec_decoding_position_offsets at [generation requests,
  1 + most drafts], the packed mask at [generation requests * max_decoding_tokens, words])
  carry a lookahead step exactly, with greedy verification (at most N - 1 drafts) and
  ``step(accepted=...)`` growing each sequence by its accepted path plus the bonus token;
* the runs have rejected, partly and fully accepted trees, paths accepted through the oracle's
  guesses (off the first branch: their K/V moved), through the Jacobi window and through the
  n-gram pool, mixed steps, chunked prefill, slot reuse, trees of max_draft_tokens;
* one step's binding, value by value, and the drafter's layout (TensorRT-LLM's posIdsToMask
  and treeEncode), window shift and pool;
* the comparison fails when the drafter writes every generation position one off, writes the
  packed mask at stride max_decoding_tokens instead of the cumulative generation lengths,
  when the accepted K/V is not moved or one accepted count is one short; the engine refuses
  a step whose position offsets were written at stride max_decoding_tokens (they disagree
  with position_ids)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

pytest.importorskip("transformers")

from speculative_checks import (  # noqa: E402
    TOL,
    TREES,
    assert_chunked_and_reused,
    assert_comparison_fails,
    assert_tree_inputs,
    compare,
)

from bufc.examples.compare import reference_tokens, tiny_llama  # noqa: E402
from bufc.examples.eagle import DraftTree, accept, workload  # noqa: E402
from bufc.examples.lookahead import (  # noqa: E402
    Faults,
    LookaheadDraft,
    LookaheadDrafter,
    LookaheadExecutor,
    LookaheadLlama,
    NgramPool,
    acceptance,
    encode,
    write_lookahead_inputs,
)
from bufc.examples.speculative import HFLogits  # noqa: E402
from bufc.generated import lookahead  # noqa: E402
from bufc.runtime import Request  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEEDS = (1, 2, 3, 4)
WNG = (3, 4, 2)  # window, n-gram, guesses: max_draft_tokens 14, max_decoding_tokens 15
RUNS = {  # name: (seed, (W, N, G), hint)
    **{f"seed {s}": (s, WNG, 0.5) for s in SEEDS},
    "lookahead alone": (3, WNG, 0.0),
    "two mask words": (1, (9, 5, 2), 0.5),  # max_decoding_tokens 44
}
MAIN = dict(max_batch_size=4, chunk_size=8, tokens_per_block=4, max_sequence_length=96)


def executor(model, reference, seed, wng, hint, faults=None):
    drafter = LookaheadDrafter(*wng, truth=reference if hint else None, hint=hint, seed=seed)
    budget = 4 * (1 + drafter.max_draft_tokens) + 8
    return LookaheadExecutor(model, drafter, token_budget=budget, faults=faults or Faults(), **MAIN)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def hf(model):
    return HFLogits(model)  # memoised: paths of one tree share their prefix


@pytest.fixture(scope="module")
def runs(model):
    """Per run: its workload, the reference tokens, the executor and its result."""
    out, references = {}, {}
    for name, (seed, wng, hint) in RUNS.items():
        jobs = workload(12, seed=seed)
        if seed not in references:
            references[seed] = reference_tokens(model, jobs)
        ex = executor(model, references[seed], seed, wng, hint)
        out[name] = (jobs, references[seed], ex, ex.run(jobs))
    return out


@pytest.mark.parametrize("name", RUNS)
def test_lookahead_equals_transformers_generate(runs, hf, name):
    jobs, reference, ex, result = runs[name]
    assert compare(result, reference, hf) <= TOL
    c = ex.config
    d, words = c.max_decoding_tokens, c.spec_mask_words
    assert (d, words) == ((15, 1) if RUNS[name][1] == WNG else (44, 2))
    for s in result.steps:
        # the offsets at [generation requests, max_generation_length]; none: max_decoding
        width = 1 + s.most_drafts if s.generation_requests else d
        assert s.offsets_shape == (s.generation_requests, width), s
        assert s.mask_shape == (s.generation_requests * d, words), s
        assert s.positions_shape == (s.tokens,), s  # one position per token
        assert s.logits == s.context_requests + s.nodes, s  # one row per chunk, per node
        assert s.tokens <= c.max_num_tokens
    assert ex.allocator.free == ex.allocator.num_blocks  # every block came back
    assert not ex.drafter.states  # every request's drafter state went with it
    assert {len(t) for t in result.tokens.values()} == {len(t) for t in reference.values()}


def test_the_runs_cover_every_case(runs):
    verifications = [v for *_, r in runs.values() for v in r.verifications]
    outcomes = Counter(v.outcome for v in verifications)
    assert set(outcomes) == {"rejected", "partial", "full"}, outcomes
    hinted = [v for v in verifications if "hint" in v.via]
    assert any(v.moved and v.accepted >= 2 for v in hinted)  # off the first branch: moved
    alone = runs["lookahead alone"][3].verifications
    assert {"window", "pool"} <= {s for v in alone for s in v.via}  # no oracle: both accept
    assert all(v.accepted <= v.cap for v in verifications)
    assert any(v.accepted == v.cap == WNG[1] - 1 for v in verifications)  # the cap, N - 1
    steps = [s for *_, r in runs.values() for s in r.steps]
    assert any(s.context_requests and s.generation_requests for s in steps), "no mixed step"
    for name, (jobs, _, ex, result) in runs.items():
        assert_chunked_and_reused(jobs, ex, result)
        most = max(s.most_drafts for s in result.steps)
        assert most <= ex.config.max_draft_tokens
        print(f"\n{name}: {acceptance(result)}; steps {len(result.steps)}, most drafts {most}")
    assert any(
        max(s.most_drafts for s in r.steps) == ex.config.max_draft_tokens
        for _, _, ex, r in runs.values()
    ), "no tree of max_draft_tokens"
    wide = runs["two mask words"][3]
    assert any(s.most_drafts >= 32 for s in wide.steps)  # node 32 on: bits of word 1


def test_one_step_binds_the_lookahead_inputs(model):
    """A context chunk beside three generation requests with 2, 5 and 0 drafts: position_ids
    bound per token, bufc's context part and the drafter's generation part; the offsets at
    [3, 6], the mask at [3 * 7, 1], its rows dense (0..2, 3..8, 9); the engine reads every
    position back, and refuses one that disagrees with the offsets."""
    config = lookahead.Config(
        max_batch_size=4, max_num_tokens=40, vocab_size=512, num_layers=2,
        max_attention_window=64, tokens_per_block=4, max_draft_tokens=6,
    )  # fmt: skip
    b = lookahead.RuntimeBuffers(config)
    for slot in range(3):
        b.add(Request(seq_slot=slot, prompt=[1, 2, 3], kv_block_ids=[[3 * slot + 1]]))
    b.add(Request(seq_slot=3, prompt=list(range(10, 16)), kv_block_ids=[[10]]))
    b.step(chunks={0: 3, 1: 3, 2: 3, 3: 4})
    blocks = {0: [2], 1: [5, 6], 3: [11]}
    step = b.step(np.full(4, 9), drafts={0: [7, 8], 1: [4, 5, 6, 7, 8]}, blocks=blocks)
    inp = step.inputs
    assert b.tensors["seq_slots"][:4].tolist() == [3, 0, 1, 2]
    assert inp["position_ids"].tolist() == [4, 5] + [0] * 10  # the drafter writes the rest
    assert tuple(inp["spec_decoding_position_offsets"].shape) == (3, 6)
    assert tuple(inp["spec_decoding_packed_mask"].shape) == (3 * 7, 1)
    assert inp["input_ids"].tolist() == [14, 15, 9, 7, 8, 9, 4, 5, 6, 7, 8, 9]
    assert inp["host_past_key_value_lengths"].tolist() == [6, 3, 3, 3]
    assert inp["sequence_length"].tolist() == [6, 6, 9, 4]
    assert inp["last_token_ids"].tolist() == list(range(2, 13))
    none = frozenset()
    drafts = [LookaheadDraft(t, 3, (), (none,) * t.size) for t in TREES]
    write_lookahead_inputs(step, [None, *drafts])
    assert inp["position_ids"].tolist() == [4, 5, 3, 4, 4, 3, 4, 4, 5, 5, 6, 3]
    assert_tree_inputs(inp)
    engine = LookaheadLlama(model)
    seqs = engine.layout(inp)
    assert [s.positions.tolist() for s in seqs] == [[4, 5], [3, 4, 4], [3, 4, 4, 5, 5, 6], [3]]
    assert [(s.start, s.new, s.past) for s in seqs] == [(0, 2, 4), (2, 3, 3), (5, 6, 3), (11, 1, 3)]
    inp["position_ids"][6] += 1  # request 1's node 1 one off: positions and offsets disagree
    with pytest.raises(ValueError, match="disagree"):
        engine.layout(inp)


def test_encode_lays_out_the_window_and_the_guesses_as_tensorrt_llm():
    """Root at 10; column 0 [5] from 11, column 1 [6, 7] from 11, guesses (5, 8), (6, 7),
    (9, 4): equal prefixes merge, nodes depth first, children as first seen."""
    tokens = [5, 6, 7, 5, 8, 6, 7, 9, 4]
    tree, node_of = encode(tokens, [11, 11, 12, 11, 12, 11, 12, 11, 12], 10)
    assert tree == DraftTree((5, 8, 6, 7, 9, 4), (0, 1, 0, 3, 0, 5))
    assert node_of == [1, 3, 4, 1, 2, 3, 4, 5, 6]
    # a third column hangs off the second's first token (the window's first level a chain)
    tree, _ = encode([1, 2, 3, 4, 5], [11, 11, 12, 12, 13], 10)
    assert tree.parents == (0, 0, 2, 2, 4) and tree.depths == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="does not follow"):
        encode([1], [12], 10)


def test_the_drafter_shifts_its_window_and_fills_its_pool():
    pool = NgramPool(3, 2)
    for key, gram in ((1, (2, 3)), (1, (2, 4)), (1, (2, 3)), (1, (5, 6))):
        pool.insert(key, gram)  # one seen again moves last; two kept per key
    assert pool.guess(1) == [(2, 3), (5, 6)] and pool.guess(9) == []
    pool = NgramPool(3, 3)
    for gram in ((1, 2), (3, 4), (5, 6), (1, 2)):
        pool.insert(0, gram)
    assert pool.guess(0) == [(3, 4), (5, 6), (1, 2)]
    d = LookaheadDrafter(window=2, ngram=3, guesses=2)
    assert d.max_draft_tokens == 1 + (2 - 1 + 2) * 2
    d.start(0, [1, 2, 3, 1, 2, 4])  # the prompt's n-grams: 1 -> (2, 3), (2, 4), ...
    d.states[0].columns = [[0, 5], [6, 7]]
    committed = (1, 2, 3, 1, 2, 4, 1)
    draft = d.draft(0, committed)  # window [5] and [6, 7], guesses (2, 3) and (2, 4)
    assert draft.tree == DraftTree((5, 6, 7, 2, 3, 4), (0, 0, 2, 0, 4, 4))
    assert draft.positions == [6, 7, 7, 8, 7, 8, 8] and draft.column_ends == (1, 3)
    assert [sorted(s) for s in draft.sources[1:]] == [["window"]] * 3 + [["pool"]] * 3
    greedy = [2, 9, 0, 8, 3, 5, 0]  # the base model's argmax at each node
    path = accept(draft.tree, greedy)
    assert path == [0, 4, 5]  # the guess (2, 3), then the bonus token 5
    d.update(0, draft, greedy, (*committed, 2, 3, 5))
    assert d.states[0].columns == [[5, 9], [7, 8]]  # shifted up by each column's argmax
    pool = d.states[0].pool
    assert pool.guess(1) == [(5, 9), (2, 3)]  # column 0's n-gram, then (1, 2, 3) again
    assert pool.guess(6) == [(7, 8)] and pool.guess(2) == [(3, 1), (3, 5)]
    assert pool.guess(4) == [(1, 2)]


FAULTS = {
    "generation positions one off": Faults(position_shift=1),
    "packed mask written at stride max_decoding_tokens": Faults(mask_stride=15),
    "accepted K/V not moved": Faults(keep_kv=True),
    "one accepted count one short": Faults(accepted_short=True),
}


@pytest.mark.parametrize("name", FAULTS)
def test_one_fault_makes_the_comparison_fail(model, runs, hf, name):
    jobs, reference, *_ = runs[f"seed {SEEDS[0]}"]
    result = executor(model, reference, SEEDS[0], WNG, 0.5, FAULTS[name]).run(jobs)
    assert_comparison_fails(result, reference, hf, name)


def test_offsets_written_at_stride_max_decoding_tokens_are_refused(model, runs):
    jobs, reference, *_ = runs[f"seed {SEEDS[0]}"]
    ex = executor(model, reference, SEEDS[0], WNG, 0.5, Faults(offset_stride=15))
    with pytest.raises(ValueError, match="disagree with its first position"):
        ex.run(jobs)
