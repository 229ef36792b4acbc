"""GPU behaviour: pinned staging, one stream-ordered copy, no per-step allocations, stable
addresses under CUDA graphs. Skipped without CUDA; run by hand on the H200 (see README)."""

from __future__ import annotations

import copy

import pytest
import test_features as F  # imported here: a @given applied inside a running @given is "nested"
import torch
from conftest import batch, make_buffers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bufc.runtime import Request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["gpt", "chatglm", "glm"]).flatmap(
        lambda n: st.tuples(st.just(n), st.lists(batch(n), min_size=1, max_size=3))
    )
)
def test_cuda_steps_equal_cpu_steps(case):
    name, batches = case
    cpu, gpu = make_buffers(name), make_buffers(name, device="cuda")
    for ctx, gen in batches:
        want = cpu.prepare_step(copy.deepcopy(ctx), copy.deepcopy(gen))
        got = gpu.prepare_step(ctx, gen)
        for key, view in got.inputs.items():
            host = key.startswith("host_") or key.endswith("_cpu")  # the row map: row_slots_cpu
            assert view.device.type == ("cpu" if host else "cuda"), key
            assert torch.equal(view.cpu(), want.inputs[key]), key
        assert got.outputs["logits"].shape == want.outputs["logits"].shape


def test_memory_kinds():
    b = make_buffers("gpt", device="cuda")
    assert b.tensors["host_input_ids"].is_pinned() and b.tensors["host_context_lengths"].is_pinned()
    assert b.tensors["input_ids"].is_cuda and b.tensors["logits"].is_cuda
    assert (
        not b.tensors["host_request_types"].is_cuda
        and not b.tensors["host_request_types"].is_pinned()
    )


def test_back_to_back_steps_never_overwrite_a_copy_in_flight():
    b = make_buffers("gpt", device="cuda", max_num_tokens=1 << 16, max_batch_size=8)
    long = [Request(seq_slot=i, prompt=[i + 1] * 8000) for i in range(8)]
    kept = []
    for i in range(6):
        reqs = long if i % 2 == 0 else [Request(seq_slot=0, prompt=[99] * 3)]
        step = b.prepare_step(reqs, [])
        kept.append(step.inputs["input_ids"].clone())  # stream-ordered after the copy
    torch.cuda.synchronize()
    for i, ids in enumerate(kept):
        expected = (
            torch.repeat_interleave(torch.arange(1, 9), 8000)
            if i % 2 == 0
            else torch.full((3,), 99)
        )
        assert torch.equal(ids.cpu(), expected.to(torch.int32)), i


def test_no_device_allocations_per_step():
    b = make_buffers("gpt", device="cuda")
    reqs = (
        [Request(seq_slot=0, prompt=list(range(50)))],
        [Request(seq_slot=1, prompt=[1, 2], generated=[[3]])],
    )
    b.prepare_step(*reqs)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(20):
        b.prepare_step(*reqs)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


def test_a_captured_graph_reads_each_new_step_through_the_same_buffers():
    b = make_buffers("gpt", device="cuda")

    def decode_batch(base: int):
        return [
            Request(seq_slot=i, prompt=[1] * (10 + i), generated=[[base + i]]) for i in range(4)
        ]

    step = b.prepare_step([], decode_batch(100))
    ids, pos = step.inputs["input_ids"], step.inputs["position_ids"]
    out = torch.empty(4, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(ids.to(torch.int64) * 1000 + pos)
    for base in (200, 300):
        step = b.prepare_step([], decode_batch(base))
        assert step.inputs["input_ids"].data_ptr() == ids.data_ptr()
        graph.replay()
        torch.cuda.synchronize()
        assert out.tolist() == [(base + i) * 1000 + 10 + i for i in range(4)]


def feature_families():
    """family -> (batch strategy of test_features, its config there)."""
    return {
        "enc_dec": (F.enc_dec_batch, F.ENC),
        "gpt_lora": (F.lora_batch, {"lora_modules": F.MODULES}),
        "gpt_prompt_tuning": (F.prompt_batch, F.PROMPT),
        # the adapter batch sets both families' fields: each refuses the other's
        "qwen2_vl": (_dropping(F.adapter_batch, "language_adapter_uid"), F.MROPE),
        "gpt_language_adapter": (
            _dropping(F.adapter_batch, "mrope_rotary_cos_sin", "mrope_position_deltas"),
            {"num_languages": 4},
        ),
    }


def _dropping(strategy, *fields: str):
    """`strategy` with `fields` of its requests at their defaults."""
    return lambda: strategy().map(lambda case: F.without(case, *fields))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_feature_families_on_cuda_equal_cpu(data):
    families = feature_families()
    name = data.draw(st.sampled_from(sorted(families)))
    strategy, config = families[name]
    cpu, gpu = make_buffers(name, **config), make_buffers(name, device="cuda", **config)
    for _ in range(2):
        ctx, gen = data.draw(strategy())
        want = cpu.prepare_step(copy.deepcopy(ctx), copy.deepcopy(gen))
        got = gpu.prepare_step(ctx, gen)
        torch.cuda.synchronize()
        for key, view in got.inputs.items():
            if key == "prompt_embedding_table":  # rows of requests without a table are unset
                continue
            assert torch.equal(view.cpu(), want.inputs[key]), (name, key)


@pytest.mark.parametrize("name", ["llama", "medusa", "gpt_lora"])
def test_cuda_requests_in_flight_equal_cpu_steps(name):
    """add/finish/step on CUDA, the sampled tokens a CUDA tensor, against the stateless CPU
    path on the same traffic (every tensor, every step)."""
    from test_in_flight import run_traffic

    for seed in range(4):
        assert run_traffic(name, seed, steps=40, device="cuda")["steps"] > 10


def test_tokens_on_the_device_are_not_waited_for_and_allocate_nothing():
    """Steady decode with the sampled tokens a CUDA tensor: step() returns while the kernel
    before the tokens still runs (the host never reads them), replays one CUDA graph,
    allocates no device memory and keeps every address; the rows and the host tensor then
    hold the tokens."""
    from fuzz_configs import make_buffers as buffers
    from fuzz_configs import make_config

    c = make_config("llama", max_beam_width=1)
    b = buffers("llama", device="cuda", max_beam_width=1)
    n = c.max_batch_size
    for s in range(n):  # 3 blocks each: the 8 tokens these steps reach
        b.add(Request(seq_slot=s, prompt=[1, 2], kv_block_ids=[[3 * s + 1, 3 * s + 2, 3 * s + 3]]))
    b.step()
    tokens = torch.zeros(n, dtype=torch.int64, device="cuda")
    ids = b.step(tokens).inputs["input_ids"].data_ptr()
    for _ in range(4):  # per half, a steady step run eagerly, then one captured as a graph
        b.step(tokens)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
    copied, replayed = b.bytes_to_device, b._replays.replayed
    for i in range(4):
        torch.cuda._sleep(20_000_000)  # some milliseconds of GPU time before the tokens
        tokens.fill_(i + 7)
        step = b.step(tokens)
        assert not torch.cuda.current_stream().query()  # still sleeping: step() did not wait
        assert step.inputs["input_ids"].data_ptr() == ids
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocated
    assert b._replays.replayed == replayed + 4  # each step one graph launch
    kv = b.tensors["host_kv_cache_block_offsets"]
    # per step only the block table's used rows go up: no token, position or length
    assert (b.bytes_to_device - copied) // 4 == n * 2 * kv.shape[-1] * kv.element_size()
    torch.cuda.synchronize()
    assert step.inputs["input_ids"].tolist() == [10] * n
    assert b.tensors["host_input_ids"][:n].tolist() == [10] * n


@pytest.mark.parametrize("name", ["llama", "glm"])
def test_steady_device_steps_replay_graphs_and_equal_host_tokens(name):
    """A long steady run with the tokens on the device is replayed as CUDA graphs (one per
    half, after a key's first step and its capture), each step equal, tensor for tensor, to
    buffers given the same tokens on the host; a new batch size captures its own graphs."""
    from fuzz_configs import make_buffers as buffers

    b = buffers(name, device="cuda", device_tokens=True, max_beam_width=1)
    host = buffers(name, device="cuda", device_tokens=False, max_beam_width=1)
    n = b.config.max_batch_size
    paged = "host_kv_cache_block_offsets" in b.decls
    for x in (b, host):
        for s in range(n):
            blocks = {"kv_block_ids": [[5 * s + k for k in range(5)]]} if paged else {}
            x.add(Request(seq_slot=s, prompt=[1, 2, 3], **blocks))
        x.step()
    tokens = torch.zeros(n, dtype=torch.int32, device="cuda")
    for i in range(14):
        if i == 8:
            for x in (b, host):
                x.finish(n - 1)  # one row fewer: a full step, then new keys
        tokens.copy_(torch.arange(n, dtype=torch.int32) * 3 + i)
        b.step(tokens)
        host.step(tokens.cpu().numpy())
        got, want = b.tensors, host.tensors
        assert [k for k in got if not torch.equal(got[k], want[k])] == [], i
    # per batch size, a key per half: its first step eager, its second captured, then replayed
    assert b._replays.replayed == 3 + 1  # steps 5-7, and 13 after the finish
