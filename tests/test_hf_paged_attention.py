"""transformers' own continuous-batching attention (its PagedAttentionCache, allocator and
"sdpa" / "paged|eager" paged path) driven by bufc's llama_flash tensors in flight, on the CPU in
float64 (examples/hf_paged.py): chunked prefill, mixed steps, KV blocks appended as sequences
grow, finishes and slot reuse give exactly transformers.generate's greedy tokens, and one wrong
entry of a bound tensor changes them."""

from __future__ import annotations

import dataclasses
import random

import pytest

pytest.importorskip("transformers")
hf_paged = pytest.importorskip(
    "bufc.examples.hf_paged",
    reason="transformers' continuous batching (PagedAttentionCache, build_attention_mask) is "
    "not importable in this transformers version",
)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers.generation.continuous_batching.requests import RequestState  # noqa: E402

from bufc.examples.compare import random_jobs, reference_tokens, tiny_llama  # noqa: E402
from bufc.generated import llama_flash  # noqa: E402
from bufc.runtime import Request  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, TPB, SLOTS, BUDGET, CHUNK = 100, 4, 3, 12, 5


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def jobs():
    lengths = [23, 1, 9, 14, 2, 31, 6, 11]  # 8 requests through 3 slots
    return random_jobs(
        random.Random(5), lengths, vocab_size=VOCAB, new_tokens=(2, 7), last_arrival=5
    )


@pytest.fixture(scope="module")
def reference(model, jobs):
    return reference_tokens(model, jobs)


@dataclasses.dataclass
class Flight:
    rid: int
    prompt: list[int]
    max_new: int
    done: int = 0  # prompt tokens computed
    tokens: list[int] = dataclasses.field(default_factory=list)


def run(model, jobs, mutate=None, seen=None) -> dict[int, list[int]]:
    """Every job through bufc + transformers' paged attention; each request's greedy tokens.
    `mutate(step)` may corrupt the first mixed step; `seen` counts what the run exercised."""
    config = llama_flash.Config(
        max_batch_size=SLOTS,
        max_num_tokens=BUDGET,
        vocab_size=VOCAB,
        num_layers=2,
        max_attention_window=64,
        tokens_per_block=TPB,
        logits_dtype=torch.float64,
        max_kv_read_tokens=SLOTS * 64,  # the read index: every slot's whole window
    )
    buffers = llama_flash.RuntimeBuffers(config)
    cache = hf_paged.new_cache(model, page_size=TPB, num_blocks=40, max_batch_tokens=BUDGET)
    table = cache.cache_allocators["full_attention"].block_table  # request id -> block ids
    pending = sorted(jobs, key=lambda j: (j.arrival_step, j.rid))
    active: dict[int, Flight] = {}  # by seq slot, in arrival order
    free = list(range(SLOTS))
    out: dict[int, list[int]] = {}
    tokens = np.zeros(SLOTS, np.int64)  # what the sampler wrote, by seq slot
    produced, step_index, mutated = False, 0, False
    seen = {} if seen is None else seen
    used: set[int] = set()  # seq slots a request has held
    while pending or active:
        while pending and pending[0].arrival_step <= step_index and free:
            job = pending.pop(0)
            slot = free.pop(0)
            seen["reused"] = seen.get("reused", 0) + (slot in used)
            used.add(slot)
            active[slot] = Flight(job.rid, list(job.prompt), job.max_new_tokens)
            buffers.add(Request(seq_slot=slot, prompt=list(job.prompt), kv_block_ids=[[]]))
        decoding = [s for s, f in active.items() if f.done == len(f.prompt)]
        chunks, left = {}, BUDGET - len(decoding)
        for slot, f in active.items():
            n = min(CHUNK, len(f.prompt) - f.done, left)
            if f.done < len(f.prompt) and n > 0:
                chunks[slot], left = n, left - n
        blocks = {}
        for slot in [*chunks, *decoding]:  # the cache's allocator grows the KV; bufc is told
            f = active[slot]
            state = RequestState(request_id=str(f.rid), initial_tokens=[])
            state.position_offset = f.done + max(len(f.tokens) - 1, 0)  # KV before the step
            before = len(table.get(state.request_id, ()))
            assert cache.can_store_request_tokens(state, chunks.get(slot, 1))
            if len(table[state.request_id]) > before:
                new = table[state.request_id][before:]
                blocks[slot] = hf_paged.kv_block_ids(cache, new)
        if not chunks and not decoding:
            step_index += 1
            continue
        step = buffers.step(tokens if produced else None, chunks=chunks, blocks=blocks)
        mixed = bool(chunks and decoding)
        if mutate is not None and mixed and not mutated:
            mutate(step)
            mutated = True
        logits = hf_paged.forward(model, cache, step)
        # each logit row's seq slot and whether its token is kept: the contract's row_slots and
        # produces_token where llama_flash binds them (checked against the schedule), else ours
        slots = buffers.tensors["host_seq_slots"][: step.sizes.num_requests].tolist()
        keeps = [
            s in decoding or active[s].done + chunks[s] == len(active[s].prompt) for s in slots
        ]
        if "row_slots" in step.inputs:
            assert step.inputs["row_slots"].tolist() == slots
            slots = step.inputs["row_slots"].tolist()
        if "produces_token" in step.inputs:
            assert step.inputs["produces_token"].tolist() == keeps
            keeps = step.inputs["produces_token"].tolist()
        for key, hit in (
            ("chunked", any(len(active[s].prompt) - active[s].done > n for s, n in chunks.items())),
            ("mixed", mixed),
            ("blocks", any(active[s].done or active[s].tokens for s in blocks)),
        ):
            seen[key] = seen.get(key, 0) + hit
        sampled = logits.argmax(dim=-1).tolist()
        for slot, n in chunks.items():
            active[slot].done += n
        produced = False
        for row, (slot, keep) in enumerate(zip(slots, keeps)):
            if not keep:
                continue
            f = active[slot]
            f.tokens.append(sampled[row])
            tokens[slot] = sampled[row]
            if len(f.tokens) == f.max_new:
                out[f.rid] = f.tokens
                buffers.finish(slot)
                cache.free_blocks(str(f.rid))
                del active[slot]
                free.append(slot)
            else:
                produced = True
        step_index += 1
    return out


@pytest.mark.parametrize("attention", ["sdpa", "paged|eager"])
def test_tokens_equal_transformers_generate(model, jobs, reference, attention):
    before = model.config._attn_implementation
    model.set_attn_implementation(attention)
    try:
        seen: dict[str, int] = {}
        got = run(model, jobs, seen=seen)
    finally:
        model.set_attn_implementation(before)
    assert got == reference
    assert all(seen.get(k) for k in ("chunked", "mixed", "blocks", "reused")), seen


def _kv_read(inputs: dict) -> None:
    """The last KV slot the first sequence reads, one back."""
    inputs["kv_read_index"][int(inputs["seq_lens_cpu"][0]) - 1].sub_(1)


MUTATIONS = {
    "positions + 1": lambda inputs: inputs["positions"][-1].add_(1),
    "slot_mapping + 1": lambda inputs: inputs["slot_mapping"][-1].add_(1),
    "kv read - 1": _kv_read,
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_one_wrong_entry_changes_the_tokens(model, jobs, reference, name):
    """One entry of the first mixed step off by one: some request's tokens differ."""
    assert run(model, jobs, mutate=lambda step: MUTATIONS[name](step.inputs)) != reference
