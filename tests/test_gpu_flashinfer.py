"""FlashInfer's own kernels driven by the llama_flashinfer family's tensors.

Seeded in-flight traffic (arrivals, prompts of 5..90 tokens in random chunks, decode rows,
finishes, seq slots and KV blocks reused) steps llama_flashinfer buffers. Each step the test
writes random K/V for the step's tokens into a paged NHD pool at `slot_mapping`, plans
`BatchPrefillWithPagedKVCacheWrapper` from the host mirrors (`qo_indptr_cpu`,
`paged_kv_indptr_cpu`, `paged_kv_last_page_len_cpu`) and `paged_kv_indices`, runs it on random
q and compares with float32 SDPA over K/V gathered through the test's OWN block lists and KV
lengths. Decode-only steps also run `BatchDecodeWithPagedKVCacheWrapper` over the views padded
to a batch bucket, bufc's device indptr, indices and last-page lengths as its CUDA-graph
buffers: captured once per bucket, re-planned and replayed. K/V no sequence owns (block 0,
never handed out, and freed blocks) hold a sentinel, so a read of one shows; the mutation tests
perturb a copy of one array and see the comparison fail. `test_the_driver_on_cpu` runs the
same driver with a torch paged attention reading the arrays as FlashInfer does (no GPU).

The GPU tests are skipped without CUDA or flashinfer. FlashInfer 0.7.2.post1 (pruned) and what
it imports are carried in the git-ignored `.dev-wheels/flashinfer/`, built on a machine with the
network (about 17 MB) by `sh bench/flashinfer_carry.sh`. On the H100 machine, `.dev-wheels`
carried, from the checkout root (the fa2 kernels are JIT-built first, about a minute):

    sh bench/flashinfer_install.sh > /tmp/fi.env && . /tmp/fi.env &&
        python3 -P -m pytest -q -s tests/test_gpu_flashinfer.py

The installer puts flashinfer and bufc (the checkout's folders as the distribution lays them
out) in /tmp/site; `-P` keeps the checkout's own bufc/ folder from shadowing that package.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bufc.generated import llama_flashinfer
from bufc.runtime import Request

PAGE, HQ, HKV, DIM, NUM_BLOCKS, SLOTS, VOCAB, BUDGET = 16, 4, 2, 64, 512, 16, 1000, 256
BUCKETS = (4, 8, 16)
SENTINEL = 30.0  # every K/V element no sequence owns: a read of one moves the output
TOL = 2e-2  # float16 q/K/V, FlashInfer's float16 output, against float32 SDPA
ARRAYS = ("qo_indptr_cpu", "paged_kv_indptr_cpu", "paged_kv_indices", "paged_kv_last_page_len_cpu")
PLAN = (HQ, HKV, DIM, PAGE)  # num_qo_heads, num_kv_heads, head_dim, page_size of plan()
MUTATIONS = ("paged_kv_indices", "paged_kv_last_page_len_cpu", "paged_kv_indptr_cpu")


def make_buffers(device: str) -> llama_flashinfer.RuntimeBuffers:
    sizes = dict(max_batch_size=SLOTS, max_num_tokens=BUDGET, max_attention_window=256)
    config = llama_flashinfer.Config(
        **sizes, vocab_size=VOCAB, num_layers=1, tokens_per_block=PAGE, num_kv_blocks=NUM_BLOCKS
    )
    return llama_flashinfer.RuntimeBuffers(config, device=device)


def make_pools(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, PAGE, HKV, DIM)
    return tuple(torch.full(shape, SENTINEL, dtype=dtype, device=device) for _ in range(2))


class Traffic:
    """Seeded in-flight traffic, and the test's own record of each slot's request: prompt
    length, prompt tokens computed, KV length, block list and decode steps left."""

    def __init__(self, buffers, pools, seed: int) -> None:
        self.buffers, self.pools, self.rng = buffers, pools, random.Random(seed)
        self.free = list(range(1, NUM_BLOCKS))  # block 0 stays out (the contract's null block)
        self.rng.shuffle(self.free)
        self.handed: set[int] = set()  # blocks ever handed out
        self.slots_used: set[int] = set()  # slots ever given a request
        self.seqs: dict[int, dict] = {}  # insertion order = arrival order
        self.tokens = np.zeros(SLOTS, np.int64)  # what "sampling" gave each slot
        self.seen: Counter = Counter()

    def take(self, n: int) -> list[int]:
        out = [self.free.pop() for _ in range(n)]  # last freed first: blocks are reused
        self.seen["blocks reused"] += len(self.handed.intersection(out))
        self.handed.update(out)
        return out

    def step(self, decode_only: bool):
        rng, seqs = self.rng, self.seqs
        for slot in [s for s, r in seqs.items() if r["left"] == 0]:
            self.buffers.finish(slot)
            blocks = seqs.pop(slot)["blocks"]
            for pool in self.pools:
                pool[blocks] = SENTINEL  # stale pages hold the sentinel again
            self.free += blocks
            self.seen["finished"] += 1
        gen = [s for s, r in seqs.items() if r["done"] == r["prompt"]]
        decode_only = decode_only and bool(gen)
        for slot in range(SLOTS):
            if decode_only or slot in seqs or (seqs and rng.random() > 0.3):
                continue
            n = rng.randint(5, 90)
            prompt = [rng.randrange(1, VOCAB) for _ in range(n)]
            first = self.take(1)
            self.buffers.add(Request(seq_slot=slot, prompt=prompt, kv_block_ids=[first]))
            self.seen["slots reused"] += slot in self.slots_used
            self.slots_used.add(slot)
            seqs[slot] = dict(prompt=n, done=0, kv=0, blocks=first, left=rng.randint(1, 12))
        want = {s: 1 for s in gen}  # slot -> query tokens of this step
        chunks, blocks, budget = {}, {}, BUDGET - len(gen)
        for s, r in seqs.items():
            rest = r["prompt"] - r["done"]
            if rest and not decode_only and budget and (rng.random() < 0.8 or not want):
                chunks[s] = want[s] = n = rng.randint(1, min(rest, budget))
                budget -= n
                self.seen["mid-prompt chunks"] += n < rest
        for s, n in want.items():
            r = seqs[s]
            short = -(-(r["kv"] + n) // PAGE) - len(r["blocks"]) + (rng.random() < 0.2)
            if short > 0:  # what the step needs, sometimes one block ahead
                blocks[s] = self.take(short)
                r["blocks"] = r["blocks"] + blocks[s]
        step = self.buffers.step(self.tokens if gen else None, chunks=chunks, blocks=blocks)
        for s, n in want.items():
            r = seqs[s]
            r["kv"] += n
            if s in chunks:
                r["done"] += n
            else:
                r["left"] -= 1
            self.tokens[s] = rng.randrange(1, VOCAB)
        self.seen["decode-only steps"] += decode_only
        return step, want, decode_only


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 SDPA of q [n, HQ, D] at the last n of L positions of k, v [L, HKV, D]: query j
    at position L - n + j sees positions 0 .. L - n + j; q head h reads KV head h // group."""
    n, length = len(q), len(k)
    k, v = (x.float().repeat_interleave(HQ // HKV, dim=1).transpose(0, 1) for x in (k, v))
    pos = torch.arange(length, device=q.device)
    mask = pos[None, :] <= pos[length - n :, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1)


def reference(q: torch.Tensor, traffic: Traffic, slot: int) -> torch.Tensor:
    """From the test's own record: the slot's first `kv` positions through its block list."""
    r = traffic.seqs[slot]
    pos = torch.arange(r["kv"], device=q.device)
    rows = torch.tensor(r["blocks"], device=q.device)[pos // PAGE] * PAGE + pos % PAGE
    return attend(q, *(pool.view(-1, HKV, DIM)[rows] for pool in traffic.pools))


def torch_paged(pools):
    """A stand-in for FlashInfer's paged prefill: each sequence's KV length and pages from the
    four arrays exactly as FlashInfer reads them (its device get_length: 0 without pages)."""

    def run(q: torch.Tensor, a: dict) -> torch.Tensor:
        qo, ind, last = (a[n].tolist() for n in ARRAYS if n != "paged_kv_indices")
        pages, out = a["paged_kv_indices"], torch.zeros(q.shape, device=q.device)
        for i in range(len(last)):
            length = (ind[i + 1] - ind[i] - 1) * PAGE + last[i] if ind[i + 1] > ind[i] else 0
            if qo[i + 1] > qo[i] and not length:  # queries over no KV (a mutated array)
                out[qo[i] : qo[i + 1]] = float("nan")  # torch before 2.13 refuses an empty SDPA
            elif qo[i + 1] > qo[i]:
                page_rows = pages[ind[i] : ind[i + 1], None].long() * PAGE
                rows = (page_rows + torch.arange(PAGE, device=q.device)).flatten()[:length]
                k, v = (pool.view(-1, HKV, DIM)[rows] for pool in pools)
                out[qo[i] : qo[i + 1]] = attend(q[qo[i] : qo[i + 1]], k, v)
        return out

    return run


def mutated(arrays: dict, name: str) -> dict:
    """A copy of the arrays with one perturbed: row 0's first page made row 1's (block 0 in a
    one-row step), row 0's last-page length off by one, or row 1's first page moved to row 0."""
    out = dict(arrays)
    x = out[name] = arrays[name].clone()
    ind = arrays["paged_kv_indptr_cpu"].tolist()
    if name == "paged_kv_indices":
        x[ind[0]] = x[ind[1]] if len(ind) > 2 else 0
    elif name == "paged_kv_last_page_len_cpu":
        x[0] += -1 if x[0] > 1 else 1
    else:
        x[1] += 1
    return out


def worst(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().nan_to_num(float("inf")).max())


def check_mirrors(inp: dict) -> None:
    """bufc's device copies hold what the host mirrors FlashInfer plans from hold."""
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len"):
        assert torch.equal(inp[name].cpu(), inp[name + "_cpu"]), name


def padded_views(buffers, step) -> tuple[dict, int, int]:
    """A decode-only step's views at its bucket, with the pads checked against what FlashInfer
    needs: indptr arrays repeat their last value, last-page lengths are 0, so FlashInfer's host
    KV length (clamp(pages - 1, 0) * page + last) and its device one (0 without pages) agree."""
    n = step.sizes.num_sequences
    b = next(x for x in BUCKETS if x >= n)
    inp, _ = buffers.views(step.sizes.generation_bucket(b))
    qo, ind, last = (inp[k] for k in ARRAYS if k != "paged_kv_indices")
    assert len(ind) == len(qo) == b + 1 and len(last) == b
    assert (ind[n:] == ind[n]).all() and (qo[n:] == qo[n]).all() and (last[n:] == 0).all()
    assert ((ind[1:] - ind[:-1] - 1).clamp(min=0) * PAGE + last)[n:].eq(0).all()
    check_mirrors(inp)
    return inp, n, b


def drive(buffers, pools, prefill, decode=None, steps=30, seed=0, mutate=None) -> dict:
    """Steps the traffic; each step checks prefill(q, arrays) (and, on decode-only steps,
    decode(step, q)) against the reference. Returns each kernel's worst error per step."""
    traffic = Traffic(buffers, pools, seed)
    g = torch.Generator().manual_seed(seed)
    device, dtype = pools[0].device, pools[0].dtype
    errors: dict = {"prefill": [], "decode": []}
    for i in range(steps):
        step, want, decode_only = traffic.step(decode_only=i % 3 == 2)
        inp, s = step.inputs, step.sizes
        slots = buffers.tensors["host_seq_slots"][: s.num_requests].tolist()
        qo = inp["qo_indptr_cpu"].tolist()
        assert sorted(slots) == sorted(want), (slots, want)
        assert [qo[j + 1] - qo[j] for j in range(len(slots))] == [want[x] for x in slots]
        check_mirrors(inp)
        assert torch.equal(inp["paged_kv_indices"].cpu(), buffers.tensors["host_paged_kv_indices"])
        mapping = inp["slot_mapping"]
        assert len(mapping) == s.num_tokens and int(mapping.min()) >= 0
        k, v, q = (torch.randn(s.num_tokens, h, DIM, generator=g) for h in (HKV, HKV, HQ))
        for pool, new in zip(pools, (k, v)):  # this step's K/V, where bufc says they go
            pool.view(-1, HKV, DIM).index_copy_(0, mapping, new.to(device, dtype))
        q = q.to(device, dtype)
        ref = torch.cat([reference(q[qo[j] : qo[j + 1]], traffic, x) for j, x in enumerate(slots)])
        arrays = {name: inp[name] for name in ARRAYS}
        out = prefill(q, mutated(arrays, mutate) if mutate else arrays)
        errors["prefill"].append(worst(out, ref))
        if decode_only and decode is not None:
            errors["decode"].append(worst(decode(step, q), ref))
    errors["seen"] = traffic.seen
    return errors


@pytest.mark.usefixtures("one_torch_thread")
def test_the_driver_on_cpu():
    """The driver, the reference and the mutations with a torch stand-in for FlashInfer; the
    traffic (the GPU test's too: the same seed) covers what the module says it does."""
    buffers, pools = make_buffers("cpu"), make_pools("cpu", torch.float32)
    prefill = torch_paged(pools)

    def decode(step, q):  # the padded bucket views read the same way: the pads attend nothing
        inp, n, b = padded_views(buffers, step)
        q = torch.cat([q, torch.zeros(b - n, HQ, DIM)])
        return prefill(q, {name: inp[name] for name in ARRAYS})[:n]

    errors = drive(buffers, pools, prefill, decode)
    assert max(errors["prefill"] + errors["decode"]) < 1e-5, errors
    seen = errors["seen"]
    assert min(seen[w] for w in ("finished", "blocks reused", "slots reused")) >= 3, seen
    assert seen["mid-prompt chunks"] >= 10 and seen["decode-only steps"] >= 6, seen
    for name in MUTATIONS:
        buffers, pools = make_buffers("cpu"), make_pools("cpu", torch.float32)
        errors = drive(buffers, pools, torch_paged(pools), steps=2, mutate=name)
        assert max(errors["prefill"]) > 5 * TOL, (name, errors)


@pytest.fixture(scope="module")
def fi():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return pytest.importorskip("flashinfer")


def flashinfer_prefill(fi, pools, times: list):
    """BatchPrefillWithPagedKVCacheWrapper (fa2), planned and run every step."""
    workspace = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")

    def run(q: torch.Tensor, a: dict) -> torch.Tensor:
        start = time.perf_counter()
        dtypes = dict(q_data_type=q.dtype, kv_data_type=q.dtype)
        wrapper.plan(*(a[name] for name in ARRAYS), *PLAN, causal=True, **dtypes)
        out = wrapper.run(q, pools)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        return out

    return run


class DecodeGraphs:
    """BatchDecodeWithPagedKVCacheWrapper (fa2, use_cuda_graph) per batch bucket over the
    padded views, bufc's device paged_kv_indptr, paged_kv_indices and paged_kv_last_page_len
    as its buffers; captured at a bucket's first step, re-planned and replayed after."""

    def __init__(self, fi, buffers, pools) -> None:
        self.fi, self.buffers, self.pools = fi, buffers, pools
        self.workspace = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
        self.graphs: dict[int, SimpleNamespace] = {}
        self.times, self.replays = [], 0

    def __call__(self, step, q: torch.Tensor) -> torch.Tensor:
        inp, n, b = padded_views(self.buffers, step)
        start = time.perf_counter()
        g = self.graphs.get(b)
        if g is None:
            names = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, backend="fa2",
                **{f"{name}_buffer": inp[name] for name in names},
            )  # fmt: skip
            g = self.graphs[b] = SimpleNamespace(
                wrapper=wrapper, graph=None, q=q.new_zeros(b, HQ, DIM), out=q.new_zeros(b, HQ, DIM)
            )
        dtypes = dict(q_data_type=q.dtype, kv_data_type=q.dtype)
        g.wrapper.plan(*(inp[name] for name in ARRAYS[1:]), *PLAN, **dtypes)  # no qo_indptr
        g.q.zero_()
        g.q[:n] = q
        if g.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                g.wrapper.run(g.q, self.pools, out=g.out)
            torch.cuda.current_stream().wait_stream(side)
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph):
                g.wrapper.run(g.q, self.pools, out=g.out)
        else:
            self.replays += 1
        g.graph.replay()
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)
        return g.out[:n]


@pytest.mark.gpu
def test_flashinfer_prefill_and_graphed_decode_read_the_family_tensors(fi):
    buffers, pools = make_buffers("cuda"), make_pools("cuda", torch.float16)
    times: list[float] = []
    prefill, decode = flashinfer_prefill(fi, pools, times), DecodeGraphs(fi, buffers, pools)
    started = time.perf_counter()
    errors = drive(buffers, pools, prefill, decode)
    print(
        f"\nflashinfer {fi.__version__}: {len(errors['prefill'])} steps, "
        f"{len(errors['decode'])} graphed decode steps (buckets {sorted(decode.graphs)}, "
        f"{decode.replays} replays), {time.perf_counter() - started:.1f} s with the JIT; "
        f"worst error prefill {max(errors['prefill']):.2e} decode {max(errors['decode']):.2e}; "
        f"plan+run median prefill {statistics.median(times[1:]) * 1e6:.0f} us, "
        f"decode plan+replay {statistics.median(decode.times) * 1e6:.0f} us; {dict(errors['seen'])}"
    )
    assert max(errors["prefill"]) < TOL and max(errors["decode"]) < TOL, errors
    assert len(decode.graphs) >= 2 and decode.replays >= 3, (decode.graphs, decode.replays)


@pytest.mark.gpu
@pytest.mark.parametrize("name", MUTATIONS)
def test_a_perturbed_array_fails_the_comparison(fi, name):
    buffers, pools = make_buffers("cuda"), make_pools("cuda", torch.float16)
    errors = drive(buffers, pools, flashinfer_prefill(fi, pools, []), steps=2, mutate=name)
    assert max(errors["prefill"]) > 5 * TOL, errors
