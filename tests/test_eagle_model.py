"""EAGLE tree verification on a real Llama through the generated eagle buffers (TensorRT-LLM's
EAGLE runtime contract): draft trees of 0..6 nodes, at most 3 deep, branching, verified in one
base-model step per request while requests arrive, prefill in chunks, finish and hand their
slots on. Proven here:

* every request's tokens equal transformers.generate (greedy, float64) over several seeds, and
  every logit row (one per tree node, one per context chunk) equals the HF model's logits at
  its position within 1e-9: bufc's position_ids (one per generation request), past KV and
  sequence lengths, last_token_ids, block offsets and the shapes it binds the external tree
  inputs at (spec_decoding_position_offsets at [generation requests, 1 + most drafts], the
  packed mask at [generation requests * max_decoding_tokens, words], draft paths one per
  decoding token) carry a tree verification step exactly, with greedy acceptance and
  ``step(accepted=...)`` growing each sequence by its accepted path plus the bonus token;
* the runs have rejected, partly and fully accepted trees, accepted paths off the first branch
  whose K/V had to move, mixed steps, chunked prefill, trees without drafts, slot reuse;
* the comparison fails when the engine reads the packed mask at stride max_decoding_tokens
  instead of the cumulative generation lengths, reads the position offsets at stride
  max_decoding_tokens instead of the bound row length, when the accepted path's K/V is not
  moved, or when one accepted count is one short."""

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
from bufc.examples.eagle import (  # noqa: E402
    DraftTree,
    EagleExecutor,
    Faults,
    TreeDrafter,
    accept,
    accept_on_paths,
    workload,
    write_tree_inputs,
)
from bufc.examples.speculative import HFLogits  # noqa: E402
from bufc.generated import eagle  # noqa: E402
from bufc.runtime import Request  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEEDS = (1, 2, 3, 4)
K = 6  # max_draft_tokens; max_decoding_tokens = 7
MAIN = dict(max_batch_size=4, token_budget=40, chunk_size=8, tokens_per_block=4)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def hf(model):
    return HFLogits(model)  # memoised: paths of one tree share their prefix


@pytest.fixture(scope="module")
def runs(model):
    """Per seed: its workload, the reference tokens, the executor and its result."""
    out = {}
    for seed in SEEDS:
        jobs = workload(12, seed=seed)
        reference = reference_tokens(model, jobs)
        ex = EagleExecutor(model, TreeDrafter(reference, 512, seed=seed), **MAIN)
        out[seed] = (jobs, reference, ex, ex.run(jobs))
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_tree_verification_equals_transformers_generate(runs, hf, seed):
    jobs, reference, ex, result = runs[seed]
    worst = compare(result, reference, hf)
    assert worst <= TOL
    for s in result.steps:
        # the offsets at [generation requests, max_generation_length]; none: max_decoding
        width = 1 + s.most_drafts if s.generation_requests else K + 1
        assert s.offsets_shape == (s.generation_requests, width), s
        assert s.mask_shape == (s.generation_requests * (K + 1), 1), s
        assert s.tokens <= MAIN["token_budget"]
    # logit rows: one per context request, one per tree node of a generation request
    trees = Counter(v.step for v in result.verifications)
    nodes = Counter()
    for v in result.verifications:
        nodes[v.step] += v.tree.size
    for s in result.steps:
        plain = s.generation_requests - trees[s.step]  # generation requests without drafts
        assert s.logits == s.context_requests + nodes[s.step] + plain, s
    assert ex.allocator.free == ex.allocator.num_blocks  # every block came back
    assert {len(t) for t in result.tokens.values()} == {len(t) for t in reference.values()}


def test_the_runs_cover_every_case(runs):
    verifications = [v for *_, r in runs.values() for v in r.verifications]
    outcomes = Counter(v.outcome for v in verifications)
    assert set(outcomes) == {"rejected", "partial", "full"}, outcomes
    moved = [v for v in verifications if v.moved]
    off_first = [v for v in verifications if v.off_first_branch]
    assert moved and off_first
    assert any(v.accepted >= 2 for v in moved)  # a path of depth >= 2 moved
    assert {v.proposed for v in verifications} == set(range(1, K + 1))
    assert max(max(v.tree.depths) for v in verifications) == 3
    assert any(len(v.tree.leaves()) > 1 for v in verifications)  # branching
    steps = [s for *_, r in runs.values() for s in r.steps]
    assert any(s.context_requests and s.generation_requests for s in steps), "no mixed step"
    # a generation request without drafts beside requests with drafts
    assert any(
        s.generation_requests > sum(v.step == s.step for v in r.verifications) and s.most_drafts
        for *_, r in runs.values()
        for s in r.steps
    )
    for jobs, _, ex, result in runs.values():
        assert_chunked_and_reused(jobs, ex, result)
    proposed = sum(v.proposed for v in verifications)
    accepted = sum(v.accepted for v in verifications)
    print(
        f"\neagle trees over seeds {SEEDS}: {len(verifications)} trees, drafts accepted "
        f"{accepted}/{proposed} ({100 * accepted / proposed:.1f} %); {dict(outcomes)}; "
        f"accepted off the first branch {len(off_first)}, K/V moved {len(moved)}; "
        f"steps {len(steps)}"
    )


def test_one_step_binds_the_tree_inputs_at_its_longest_tree():
    """Three generation requests with 2, 5 and 0 drafts: the offsets bound at [3, 6], the mask
    at [3 * 7, 1]; the drafter's rows land dense (0..2, 3..8, 9) and the engine reads them
    back so; one position per generation request."""
    config = eagle.Config(
        max_batch_size=4, max_num_tokens=40, vocab_size=512, num_layers=2,
        max_attention_window=64, tokens_per_block=4, max_draft_tokens=K, max_draft_path_len=3,
    )  # fmt: skip
    b = eagle.RuntimeBuffers(config)
    for slot in range(3):
        b.add(Request(seq_slot=slot, prompt=[1, 2, 3], kv_block_ids=[[3 * slot + 1]]))
    b.step()
    drafts = {0: [7, 8], 1: [4, 5, 6, 7, 8]}
    blocks = {0: [2], 1: [5, 6]}
    step = b.step(np.full(4, 9), drafts=drafts, blocks=blocks)
    inp = step.inputs
    assert tuple(inp["spec_decoding_position_offsets"].shape) == (3, 1 + 5)
    assert tuple(inp["spec_decoding_packed_mask"].shape) == (3 * (K + 1), 1)
    assert tuple(inp["draft_paths"].shape) == (3, K + 1, 4)
    assert inp["position_ids"].tolist() == [3, 3, 3]
    assert inp["host_past_key_value_lengths"].tolist() == [3, 3, 3]
    assert inp["sequence_length"].tolist() == [6, 9, 4]
    assert inp["last_token_ids"].tolist() == list(range(1, 11))
    write_tree_inputs(step, TREES)
    assert_tree_inputs(inp)
    assert inp["draft_paths"][1, :3].tolist() == [[0, 2, 4, -1], [0, 1, 3, 5], [-1] * 4]


def test_greedy_acceptance_on_trees_and_on_paths_agree():
    """The tree walk and TensorRT-LLM's longest accepted path pick the same nodes, including
    a path through a second child."""
    tree = DraftTree((10, 11, 12, 13, 14), (0, 0, 1, 2, 2))  # 1:10 2:11 3:12<1 4:13<2 5:14<2
    tokens, paths = list(tree.tokens), [tree.path(j) + [-1] * 3 for j in tree.leaves()]
    for greedy, want in (
        ([11, 0, 14, 0, 0, 0], [0, 2, 5]),  # second child, then its second child
        ([10, 12, 0, 7, 0, 0], [0, 1, 3]),
        ([99, 0, 0, 0, 0, 0], [0]),
    ):
        assert accept(tree, greedy) == want
        assert accept_on_paths(tokens, [p[:4] for p in paths], greedy) == want
    drafter = TreeDrafter({0: list(range(40))}, 512, seed=5)
    for n in range(30):
        t = drafter.draft(0, n)
        assert len(t.tokens) <= K and max(t.depths) <= 3
        assert all(p < j for j, p in enumerate(t.parents, 1))  # tree order
        for j in range(t.size):  # sibling tokens differ
            kids = [t.token(c) for c in t.children(j)]
            assert len(kids) == len(set(kids))


FAULTS = {
    "packed mask read at stride max_decoding_tokens": Faults(mask_stride=K + 1),
    "position offsets read at stride max_decoding_tokens": Faults(offset_stride=K + 1),
    "accepted K/V not moved": Faults(keep_kv=True),
    "one accepted count one short": Faults(accepted_short=True),
}


@pytest.mark.parametrize("name", FAULTS)
def test_one_fault_makes_the_comparison_fail(model, runs, hf, name):
    jobs, reference, _, clean = runs[SEEDS[0]]
    ex = EagleExecutor(
        model, TreeDrafter(reference, 512, seed=SEEDS[0]), faults=FAULTS[name], **MAIN
    )
    assert_comparison_fails(ex.run(jobs), reference, hf, name)
