"""The FlashAttention/vLLM contract (llama_flash) on real kernels: torch's FlashAttention
(varlen_attn, bf16) over K/V gathered through block_table, against a float32 forward; and the
fixed-shape decode captured as one CUDA graph per batch bucket, replayed as the batch changes.
Skipped without CUDA; run by hand on the H200 (docs/performance.md gives the command)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from bufc.examples.compare import assert_same_tokens, reference_tokens, tiny_llama, workload  # noqa: E402
from bufc.examples.executor import Executor  # noqa: E402
from bufc.examples.flash_llama import FlashKVCache, FlashLlama  # noqa: E402
from bufc.generated import llama_flash  # noqa: E402
from bufc.runtime import Request  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def model32():
    return tiny_llama(seed=0).to(torch.float32).cuda()


def test_varlen_flash_attention_matches_a_float32_forward():
    """Teacher-forced steps (chunked prompts, mixed steps, decode) through varlen_attn in bf16:
    every logit row, found through the step's own tensors, is within bf16 tolerance of a
    float32 forward of the same (bf16-rounded) weights at its position (the tolerance: what
    the same steps through plain torch attention in bf16 reach, and 5% on average), and its
    greedy token equals the float32 one wherever the float32 top-two margin is clear of bf16
    noise."""
    config = llama_flash.Config(
        max_batch_size=4,
        max_num_tokens=160,
        vocab_size=512,
        num_layers=2,
        max_attention_window=512,
        tokens_per_block=16,
        logits_dtype=torch.float32,
    )
    buffers = llama_flash.RuntimeBuffers(config, device="cuda")
    bf16 = tiny_llama(seed=0).to(torch.bfloat16).cuda()
    rounded = tiny_llama(seed=0).to(torch.bfloat16).to(torch.float32).cuda()
    engines = {name: FlashLlama(bf16, attention=name) for name in ("varlen", "packed")}
    flash = engines["varlen"]
    caches = {
        name: FlashKVCache(64, 2, 16, flash.kv_heads, flash.head_dim, torch.bfloat16, "cuda")
        for name in engines
    }
    g = torch.Generator().manual_seed(5)
    full, want = {}, {}
    for slot, n in enumerate((150, 9, 70, 1)):
        sequence = torch.randint(0, 512, (n + 8,), generator=g).tolist()
        full[slot] = sequence
        with torch.no_grad():
            want[slot] = rounded(torch.tensor([sequence], device="cuda")).logits[0]
        blocks = list(range(1 + 12 * slot, 1 + 12 * slot + 12))
        buffers.add(Request(seq_slot=slot, prompt=sequence[:n], kv_block_ids=[blocks]))
    tokens = torch.zeros(4, dtype=torch.int64)
    rows = agreed = clear = 0
    worst = {name: 0.0 for name in engines}
    total = {name: 0.0 for name in engines}
    schedule = ({0: 64, 1: 9}, {0: 64, 2: 40}, {0: 22, 2: 30, 3: 1}) + ({},) * 5
    for i, chunks in enumerate(schedule):
        step = buffers.step(tokens if i else None, chunks=chunks)
        inp = step.inputs
        positions = inp["positions"][inp["logits_indices"]].tolist()
        slots = buffers.tensors["host_seq_slots"][: step.sizes.num_requests].tolist()
        for name, engine in engines.items():
            engine.forward(step, caches[name])
            logits = step.outputs["logits"].float()
            for row, (slot, position) in enumerate(zip(slots, positions)):
                ref = want[slot][position]
                err = float((logits[row] - ref).norm() / ref.norm())
                worst[name], total[name] = max(worst[name], err), total[name] + err
                top = ref.topk(2).values
                if name == "varlen" and float(top[0] - top[1]) > 0.05 * float(ref.abs().max()):
                    clear += 1
                    agreed += int(logits[row].argmax() == ref.argmax())
                rows += name == "varlen"
        for slot, length in zip(slots, inp["seq_lens_cpu"].tolist()):
            tokens[slot] = full[slot][min(length, len(full[slot]) - 1)]
    for name in engines:
        print(
            f"{name} bf16: {rows} logit rows, relative error mean {total[name] / rows:.4f} "
            f"worst {worst[name]:.4f}"
        )
    print(f"varlen: greedy tokens equal on {agreed} of the {clear} rows with a clear margin")
    assert rows >= 25 and total["varlen"] / rows < 0.05
    assert worst["varlen"] <= 1.5 * worst["packed"] + 0.01
    assert clear >= rows // 2 and agreed == clear


def test_cuda_graph_buckets_replay_the_decode_and_equal_transformers(model32):
    """Prompts through the packed forward, generation-only steps through the fixed-shape
    decode captured once per power-of-two bucket and replayed as the batch shrinks and grows:
    the tokens equal transformers.generate (float32 on the GPU)."""
    jobs = workload(24, seed=2, max_prompt=200)
    reference = reference_tokens(model32, jobs)
    ex = Executor(
        model32,
        max_batch_size=12,
        token_budget=128,
        chunk_size=48,
        tokens_per_block=16,
        max_sequence_length=256,
        device="cuda",
        cuda_graphs=True,
        contract="flash",
    )
    assert_same_tokens(ex.run(jobs), reference)
    assert len(ex.graphs) >= 2, ex.graphs  # several buckets captured and replayed


def test_a_replayed_graph_equals_the_eager_decode(model32):
    """The same decode step, eager and replayed from a graph captured on an earlier, longer
    batch of the same bucket: the logits are equal."""
    config = llama_flash.Config(
        max_batch_size=8,
        max_num_tokens=64,
        vocab_size=512,
        num_layers=2,
        max_attention_window=128,
        tokens_per_block=16,
    )
    buffers = llama_flash.RuntimeBuffers(config, device="cuda")
    flash = FlashLlama(model32)
    cache = FlashKVCache(40, 2, 16, flash.kv_heads, flash.head_dim, torch.float32, "cuda")
    for slot in range(5):
        prompt = list(range(3 + slot, 10 + 3 * slot))
        buffers.add(Request(seq_slot=slot, prompt=prompt, kv_block_ids=[[1 + 4 * slot]]))
    flash.forward(buffers.step(), cache)
    tokens = torch.arange(8, dtype=torch.int64) + 100
    step = buffers.step(tokens)  # five sequences: bucket 8
    inputs, outputs = buffers.views(step.sizes.generation_bucket(8))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash.decode(inputs, outputs, cache)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        flash.decode(inputs, outputs, cache)
    buffers.finish(4)
    buffers.finish(1)
    step = buffers.step(tokens)  # three sequences, rows moved: the same bucket
    graph.replay()
    replayed = outputs["logits"][:3].clone()
    eager = {"logits": torch.empty_like(outputs["logits"])}
    flash.decode(inputs, eager, cache)
    assert torch.equal(replayed, eager["logits"][:3])
