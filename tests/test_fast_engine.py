"""The fast engine (examples/fast_llama.py) served in flight (examples/serving.py), on the CPU
at float64: its tokens equal transformers.generate, fed by bufc's llama_flash buffers and by
bench/plain_flash.py's plain preparation alike, through chunked prefill, mixed steps and reused
slots, every step padded to a token and batch bucket (what the CUDA graphs run) or eager; one wrong input of a step breaks the run; the plain-torch
decode attention equals a loop-by-loop one. The same code runs on CUDA with the Triton decode
kernel, FlashAttention and CUDA graphs (tests/test_gpu_fast.py, by hand on the H200)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bufc.examples.compare import reference_tokens, tiny_llama, workload  # noqa: E402
from bufc.examples.executor import Job  # noqa: E402
from bufc.examples.fast_llama import FastLlama, paged_decode_reference  # noqa: E402
from bufc.examples.serving import (  # noqa: E402
    BufcFeeder,
    DeviceFeeder,
    Prepared,
    Server,
    churn_jobs,
)
from bufc.generated import llama_flash  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from plain_flash import PlainFeeder  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SLOTS, BUDGET, TPB, WINDOW = 6, 64, 16, 512


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def engine(model):
    return FastLlama(model, max_positions=WINDOW)


@pytest.fixture(scope="module")
def jobs():
    return workload(20, seed=4, max_prompt=150)


@pytest.fixture(scope="module")
def reference(model, jobs):
    return reference_tokens(model, jobs)


def feeder(name: str):
    config = llama_flash.Config(
        max_batch_size=SLOTS,
        max_num_tokens=BUDGET,
        vocab_size=512,
        num_layers=2,
        max_attention_window=WINDOW,
        tokens_per_block=TPB,
        logits_dtype=torch.float64,
    )
    return {"bufc": BufcFeeder, "plain": PlainFeeder, "device": DeviceFeeder}[name](config, "cpu")


def serve(engine, source, jobs, chunk: int = 24, graph_tokens: int | None = None):
    server = Server(
        engine,
        source,
        max_batch_size=SLOTS,
        token_budget=BUDGET,
        chunk_size=chunk,
        tokens_per_block=TPB,
        num_blocks=SLOTS * WINDOW // TPB + 1,
        graph_tokens=graph_tokens,
    )
    return server.run(jobs)


def first_difference(got: dict, want: dict) -> str | None:
    for rid, tokens in want.items():
        if got[rid] != tokens:
            return f"request {rid}: served {got[rid]}, transformers.generate {tokens}"
    return None


@pytest.mark.parametrize(
    "name, graph_tokens",
    [("bufc", None), ("plain", None), ("device", None), ("bufc", 0), ("plain", 0), ("device", 0)],
    ids=[
        "bufc-bucketed",
        "plain-bucketed",
        "device-bucketed",
        "bufc-eager",
        "plain-eager",
        "device-eager",
    ],
)
def test_served_tokens_equal_transformers_generate(engine, jobs, reference, name, graph_tokens):
    """Every step at a token and batch bucket (each query token a decode row: what the CUDA
    graphs run), or every step eagerly at its own shapes (prompt chunks through the packed
    prefill): the same tokens as transformers.generate."""
    served = serve(engine, feeder(name), jobs, graph_tokens=graph_tokens)
    assert first_difference(served.tokens, reference) is None
    assert all(r.graph is False for r in served.steps)  # no CUDA here: eager at those shapes
    kinds = {(r.context_requests > 0, r.generation_requests > 0) for r in served.steps}
    assert kinds == {(True, False), (True, True), (False, True)}  # prefill, mixed, decode
    assert sum(r.arrived for r in served.steps) == len(jobs) > SLOTS  # slots reused
    assert max(r.kv_tokens for r in served.steps) > 0


class Mutated:
    """bufc's feeder with one input of one step changed in place on the device (after the
    step is prepared)."""

    name = "mutated"

    def __init__(self, inner, at: int, mutate) -> None:
        self.inner, self.at, self.mutate, self.count = inner, at, mutate, 0
        if hasattr(inner, "bucketing"):  # the device build lays its step out at the bucket
            self.bucketing = None

    def __setattr__(self, name, value):
        if name == "bucketing" and hasattr(self, "inner") and value is not None:
            self.inner.bucketing = value
        object.__setattr__(self, name, value)

    def add(self, slot, prompt, blocks):
        self.inner.add(slot, prompt, blocks)

    def finish(self, slot):
        self.inner.finish(slot)

    def step(self, tokens, chunks, blocks) -> Prepared:
        prepared = self.inner.step(tokens, chunks, blocks)
        if self.count == self.at:
            self.mutate(prepared.batch.inputs)
        self.count += 1
        return prepared


def _bump(name: str, index: int, by: int = 1):
    def mutate(inputs):
        t = inputs[name].view(-1)
        t[index % len(t)] += by

    return mutate


MUTATIONS = {
    "an input token": _bump("input_ids", -1, 1),
    "a position": _bump("positions", -1, 3),
    "a slot": _bump("slot_mapping", -1, 2 * TPB),
    "a block id": _bump("block_table", 0, 1),
    "a sequence length": _bump("seq_lens", -1, -3),
    "a logits index": _bump("logits_indices", -1, -1),
    "a query start": _bump("query_start_loc", 1, -2),
}


@pytest.fixture(scope="module")
def long_jobs():
    """Six requests that generate 10 tokens each: whatever a step breaks is read again."""
    g = torch.Generator().manual_seed(9)
    return [
        Job(i, tuple(torch.randint(0, 512, (n,), generator=g).tolist()), 10)
        for i, n in enumerate((30, 70, 20, 45, 60, 25))
    ]


@pytest.mark.parametrize(
    "build, graph_tokens",
    [("bufc", None), ("bufc", 0), ("device", 0)],
    ids=["bucketed", "eager", "device-eager"],
)
@pytest.mark.parametrize("what", MUTATIONS)
def test_one_wrong_input_breaks_the_run(engine, model, long_jobs, what, graph_tokens, build):
    """Each input the engine reads matters, on both paths and in both builds: one wrong
    element in one step changes tokens (the fourth step: context chunks beside generation
    rows). The device build runs eagerly here, at the step's own shapes (laid out at its
    bucket, a step's last element is a pad)."""
    clean = serve(engine, feeder(build), long_jobs, graph_tokens=graph_tokens)
    assert first_difference(clean.tokens, reference_tokens(model, long_jobs)) is None
    assert clean.steps[3].context_requests and clean.steps[3].generation_requests
    mutated = Mutated(feeder(build), 3, MUTATIONS[what])
    served = serve(engine, mutated, long_jobs, graph_tokens=graph_tokens)
    assert first_difference(served.tokens, clean.tokens) is not None


def test_endless_churn_keeps_the_batch_full_and_finishes_requests(engine):
    """The benchmark's traffic: the slots stay full, requests finish and arrive every few
    steps, and both preparations serve the same tokens."""
    runs = []
    for name in ("bufc", "plain"):
        server = Server(
            engine,
            feeder(name),
            max_batch_size=SLOTS,
            token_budget=BUDGET,
            chunk_size=32,
            tokens_per_block=TPB,
            num_blocks=SLOTS * WINDOW // TPB + 1,
        )
        runs.append(server.run(churn_jobs(SLOTS, 2, 40, 512, seed=3), max_steps=40))
    bufc, plain = runs
    assert bufc.tokens == plain.tokens
    late = bufc.steps[20:]
    assert sum(r.finished for r in late) >= 6 and sum(r.arrived for r in late) >= 6
    assert all(r.context_requests + r.generation_requests == SLOTS for r in late)


def _loop_attention(q, k_cache, v_cache, table, lens, scale):
    """Loop by loop: each row's query heads over its KV positions, one position at a time."""
    rows, heads, dim = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    for i in range(rows):
        n = int(lens[i])
        for h in range(heads):
            kh = h // (heads // kv_heads)
            keys = [k_cache[int(table[i, p // bs]), p % bs, kh] for p in range(n)]
            values = [v_cache[int(table[i, p // bs]), p % bs, kh] for p in range(n)]
            if not n:
                continue
            scores = torch.stack([q[i, h] @ key for key in keys]) * scale
            weights = scores.softmax(0)
            out[i, h] = sum(w * v for w, v in zip(weights, values))
    return out


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    group=st.sampled_from([1, 2, 4]),
    bs=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_decode_attention_reference_equals_a_loop(lens, group, bs, seed):
    g = torch.Generator().manual_seed(seed)
    kv_heads, dim, width = 2, 8, -(-40 // bs)
    blocks = len(lens) * width + 1
    q = torch.randn(len(lens), kv_heads * group, dim, generator=g, dtype=torch.float64)
    k = torch.randn(blocks, bs, kv_heads, dim, generator=g, dtype=torch.float64)
    v = torch.randn(blocks, bs, kv_heads, dim, generator=g, dtype=torch.float64)
    table = torch.randperm(blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    paged_decode_reference(q, k, v, table.int(), seq_lens, out, dim**-0.5)
    torch.testing.assert_close(out, _loop_attention(q, k, v, table, lens, dim**-0.5))


@settings(max_examples=50, deadline=None)
@given(
    queries=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 20)), min_size=1, max_size=5),
    pad_tokens=st.integers(0, 4),
    pad_rows=st.integers(0, 3),
)
def test_token_rows_equal_a_loop_over_the_sequences(queries, pad_tokens, pad_rows):
    """FastLlama.token_rows against a loop: token j of a sequence with q query tokens and
    `past` KV positions before them attends to its first past + j + 1 positions, through its
    sequence's block_table row; padded tokens attend to nothing (the contract's pads)."""
    starts, lens, want_rows, want_lens = [0], [], [], []
    for i, (q, past) in enumerate(queries):
        starts.append(starts[-1] + q)
        lens.append(past + q)
        want_rows += [i] * q
        want_lens += [past + j + 1 for j in range(q)]
    tokens = starts[-1] + pad_tokens
    starts += [starts[-1]] * pad_rows  # repeat_last
    lens += [0] * pad_rows
    table = torch.arange(len(lens) * 3, dtype=torch.int32).view(len(lens), 3)
    inputs = {
        "input_ids": torch.zeros(tokens, dtype=torch.int32),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "block_table": table,
    }
    rows, got_lens = FastLlama.token_rows(inputs)
    assert got_lens.tolist() == want_lens + [0] * pad_tokens
    assert rows[: len(want_rows)].tolist() == table[want_rows].tolist()
    assert rows.shape == (tokens, 3)


def test_the_serving_benchmark_runs_on_the_cpu(tmp_path):
    """bench/serving.py's script check (a tiny model): every case and both preparations run,
    and they serve the same tokens."""
    import json

    sys.path.insert(0, str(BENCH))
    import serving as bench_serving

    out = tmp_path / "serving.json"
    args = ["--device", "cpu", "--tiny", "--batches", "8", "--steps", "4", "--warmup", "2"]
    assert bench_serving.main([*args, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["case"], r["feeder"]) for r in rows} == {
        (c, f) for c in ("steady", "churn") for f in ("bufc", "plain")
    }
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 for r in rows)
