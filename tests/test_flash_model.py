"""A real Llama fed by the FlashAttention/vLLM contract (llama_flash) or FlashInfer's
(llama_flashinfer): tokens equal transformers.generate under in-flight batching with chunked
prefill, mixed steps and slot reuse, each step's logits equal a teacher-forced forward, and one
wrong entry of query_start_loc, slot_mapping, block_table, seq_lens or logits_indices (or of
FlashInfer's indptr, indices and last-page lengths) breaks the run."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from bufc.examples.compare import (  # noqa: E402
    Mismatch,
    assert_same_tokens,
    reference_tokens,
    tiny_llama,
    workload,
)
from bufc.examples.executor import Executor  # noqa: E402
from bufc.examples.flash_llama import FlashKVCache, FlashLlama  # noqa: E402
from bufc.generated import llama_flash, llama_flashinfer  # noqa: E402
from bufc.runtime import Request  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def jobs():
    return workload(32, seed=1)


@pytest.fixture(scope="module")
def reference(model, jobs):
    return reference_tokens(model, jobs)


STANDARD = dict(
    max_batch_size=12, token_budget=100, chunk_size=24, tokens_per_block=16, max_sequence_length=512
)
CONFIGS = {
    # chunks that end mid-block, a budget far below the longest prompt (400), one-token blocks
    "tpb1-chunk7-budget64": dict(tokens_per_block=1, chunk_size=7, token_budget=64),
    "tpb16-chunk24-budget100": {},
    # 5 slots for 32 requests: every slot is reused several times
    "tpb16-budget256-few-slots": dict(tokens_per_block=16, token_budget=256, max_batch_size=5),
}


@pytest.mark.parametrize("mode", ["stateless", "bucketed_decode", "in_flight", "overlap"])
@pytest.mark.parametrize("name", CONFIGS)
def test_flash_contract_equals_transformers_generate(model, jobs, reference, name, mode):
    """prepare_step (its generation-only steps also through the fixed-shape decode over the
    batch bucket's padded views), add/finish/step, and add/finish/step with the sampled tokens
    left on the device (here the CPU): the same tokens as transformers.generate."""
    kwargs = {**STANDARD, **CONFIGS[name], "contract": "flash"}
    if mode != "stateless":
        kwargs[mode] = True
    ex = Executor(model, **kwargs)
    result = ex.run(jobs)
    assert_same_tokens(result, reference)
    assert any(s.context_requests and s.generation_requests for s in result.steps), "no mixed step"
    assert ex.allocator.free == ex.allocator.num_blocks


@pytest.mark.parametrize("mode", ["stateless", "in_flight"])
def test_flashinfer_arrays_give_the_same_tokens(model, jobs, reference, mode):
    """The same engine reading llama_flashinfer's qo_indptr and paged KV arrays instead of
    llama_flash's query starts, lengths and block table: the same tokens."""
    kwargs = {**STANDARD, **CONFIGS["tpb1-chunk7-budget64"], "contract": "flashinfer"}
    if mode != "stateless":
        kwargs[mode] = True
    assert_same_tokens(Executor(model, **kwargs).run(jobs), reference)


def test_each_steps_logits_equal_a_teacher_forced_forward(model):
    """Requests fed the tokens transformers chose (teacher forcing), in chunks and mixed steps:
    every logit row, found through the step's own tensors (its token's position and its
    request's slot), is within 1e-9 of the full forward's logits at that position (float64)."""
    config = llama_flash.Config(
        max_batch_size=4,
        max_num_tokens=40,
        vocab_size=512,
        num_layers=2,
        max_attention_window=256,
        tokens_per_block=8,
        logits_dtype=torch.float64,
    )
    buffers = llama_flash.RuntimeBuffers(config)
    flash = FlashLlama(model)
    cache = FlashKVCache(64, 2, 8, flash.kv_heads, flash.head_dim, torch.float64, "cpu")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (37, 5, 19, 1)]
    full = {}  # slot -> prompt + the tokens fed after it
    want = {}  # slot -> the full forward's logits at every position
    for slot, prompt in enumerate(prompts):
        sequence = prompt + torch.randint(0, 512, (6,), generator=g).tolist()
        full[slot] = sequence
        with torch.no_grad():
            want[slot] = model(torch.tensor([sequence])).logits[0]
        blocks = list(range(1 + 8 * slot, 1 + 8 * slot + 6))  # 48 tokens each, block 0 unused
        buffers.add(Request(seq_slot=slot, prompt=prompt, kv_block_ids=[blocks]))
    tokens = torch.zeros(4, dtype=torch.int64)
    checked = 0
    for i, chunks in enumerate(({0: 16, 1: 5}, {0: 16, 2: 10}, {0: 5, 2: 9, 3: 1}, {}, {}, {})):
        step = buffers.step(tokens if i else None, chunks=chunks)
        flash.forward(step, cache)
        inp = step.inputs
        logits = step.outputs["logits"]
        positions = inp["positions"][inp["logits_indices"]].tolist()
        slots = buffers.tensors["host_seq_slots"][: step.sizes.num_requests].tolist()
        for row, (slot, position) in enumerate(zip(slots, positions)):
            assert torch.allclose(logits[row], want[slot][position], rtol=0, atol=1e-9), slot
            checked += 1
        for slot, length in zip(slots, inp["seq_lens_cpu"].tolist()):
            tokens[slot] = full[slot][length]  # what a producer "sampled": the teacher's token
    assert checked >= 20


def _mixed_step_mutation(tensor: str, change):
    """Mutate `tensor` of the first mixed step (context and generation rows) of the run."""
    done = []

    def mutate(index, step):
        s = step.sizes
        if not done and s.num_context_requests and s.num_generation_requests:
            done.append(index)
            change(step.inputs[tensor])

    return mutate


MUTATIONS = {
    "query_start_loc + 1": ("query_start_loc_cpu", lambda t: t[1].add_(1)),
    "slot_mapping + 1": ("slot_mapping", lambda t: t[-1].add_(1)),
    "block_table + 1": ("block_table", lambda t: t[0, 0].add_(1)),
    "seq_lens - 1": ("seq_lens_cpu", lambda t: t[-1].sub_(1)),
    "logits_indices - 1": ("logits_indices", lambda t: t[-1].sub_(1)),
}


FLASHINFER_MUTATIONS = {
    "qo_indptr + 1": ("qo_indptr_cpu", lambda t: t[1].add_(1)),
    "paged_kv_indptr + 1": ("paged_kv_indptr_cpu", lambda t: t[1].add_(1)),
    "paged_kv_indices + 1": ("paged_kv_indices", lambda t: t[0].add_(1)),
    "paged_kv_last_page_len - 1": ("paged_kv_last_page_len_cpu", lambda t: t[-1].sub_(1)),
}


@pytest.mark.parametrize(
    "contract, name",
    [("flash", n) for n in MUTATIONS] + [("flashinfer", n) for n in FLASHINFER_MUTATIONS],
)
def test_one_wrong_entry_makes_the_comparison_fail(model, jobs, reference, contract, name):
    tensor, change = {**MUTATIONS, **FLASHINFER_MUTATIONS}[name]
    ex = Executor(model, **STANDARD, contract=contract, in_flight=True)
    # a wrong token, or an engine that cannot even run on the wrong index
    with pytest.raises((Mismatch, RuntimeError, IndexError)):
        assert_same_tokens(ex.run(jobs, mutate=_mixed_step_mutation(tensor, change)), reference)


def _speculative_run(model, jobs, reference, contract: str, k: int = 3, noise: float = 0.35):
    """Every request in flight with k draft tokens per generation step, the drafts the greedy
    continuation (known from `reference`) corrupted at random: verified in one step (a logit row
    per query token), accepted greedily (the longest prefix equal to the argmax at each row,
    plus the argmax after it). Returns each request's tokens and the drafts accepted/proposed."""
    import random

    family = llama_flash if contract == "flash" else llama_flashinfer
    config = family.Config(
        max_batch_size=len(jobs),
        max_num_tokens=4096,
        max_draft_tokens=k,
        vocab_size=512,
        num_layers=2,
        max_attention_window=512,
        tokens_per_block=16,
        logits_dtype=torch.float64,
    )
    buffers = family.RuntimeBuffers(config)
    flash = FlashLlama(model)
    per = config.max_blocks_per_seq
    cache = FlashKVCache(
        1 + per * len(jobs), 2, 16, flash.kv_heads, flash.head_dim, torch.float64, "cpu"
    )
    rng = random.Random(7)
    out: dict[int, list[int]] = {}
    for slot, job in enumerate(jobs):
        blocks = list(range(1 + per * slot, 1 + per * (slot + 1)))  # block 0 stays null
        buffers.add(Request(seq_slot=slot, prompt=list(job.prompt), kv_block_ids=[blocks]))
        out[slot] = []
    tokens = torch.zeros(len(jobs), dtype=torch.int64)
    accepted: dict[int, int] = {}
    drafts: dict[int, list[int]] = {}
    proposed = taken = 0
    first = True
    while any(len(out[s]) < j.max_new_tokens for s, j in enumerate(jobs)):
        step = buffers.step(None if first else tokens, accepted=accepted, drafts=drafts)
        first = False
        flash.forward(step, cache)
        inp = step.inputs
        starts = inp["query_start_loc_cpu" if contract == "flash" else "qo_indptr_cpu"].tolist()
        rows = inp["logits_indices"].tolist()
        best = step.outputs["logits"].argmax(dim=-1).tolist()
        slots = buffers.tensors["host_seq_slots"][: step.sizes.num_requests].tolist()
        by_seq: dict[int, list[int]] = {}
        for row, token_row in enumerate(rows):  # each logit row's sequence, by its token
            seq = max(i for i, a in enumerate(starts[:-1]) if a <= token_row)
            by_seq.setdefault(seq, []).append(best[row])
        accepted, given = {}, drafts
        drafts = {}
        for seq, argmax in by_seq.items():
            slot = slots[seq]
            job, proposal = jobs[slot], given.get(slot, [])
            n = 0
            while n < len(proposal) and proposal[n] == argmax[n]:
                n += 1
            proposed, taken = proposed + len(proposal), taken + n
            out[slot] += proposal[:n] + [argmax[n]]
            if n:
                accepted[slot] = n
            tokens[slot] = argmax[n]
            want = reference[job.rid]
            done = len(out[slot])
            if done >= job.max_new_tokens:
                out[slot] = out[slot][: job.max_new_tokens]
                buffers.finish(slot)
                accepted.pop(slot, None)
                continue
            guess = want[done : done + k] + [0] * k
            drafts[slot] = [t if rng.random() > noise else (t + 1) % 512 for t in guess[:k]]
    return {jobs[s].rid: v for s, v in out.items()}, taken, proposed


@pytest.mark.parametrize("contract", ["flash", "flashinfer"])
def test_drafts_accepted_greedily_give_the_base_models_greedy_tokens(
    model, jobs, reference, contract
):
    """Draft tokens are query tokens with one logit row each (logits_indices): verified in one
    step and accepted greedily, they give exactly transformers' greedy tokens, with some drafts
    rejected and some accepted."""
    short = [j for j in jobs if len(j.prompt) < 200][:12]
    got, taken, proposed = _speculative_run(model, short, reference, contract)
    for job in short:
        assert got[job.rid] == reference[job.rid], job.rid
    assert 0 < taken < proposed, (taken, proposed)
