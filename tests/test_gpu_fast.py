"""The fast engine on real kernels: the Triton paged decode kernel against the plain-torch
reference, FlashAttention's varlen prefill against the packed reference, and the engine served
in flight on CUDA (every step, mixed ones included, replayed from a CUDA graph per token and batch
bucket; tokens on the device) equal to transformers.generate at float32; in bf16 the graph
replays equal the eager run at the same shapes, and bufc's and the plain preparation's tokens are
the same. Skipped without CUDA; run by hand on the H200
(docs/performance.md gives the command)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("triton")

from bufc.examples.compare import reference_tokens, tiny_llama, workload  # noqa: E402
from bufc.examples.fast_llama import FastLlama, paged_decode_reference  # noqa: E402
from bufc.examples.serving import BufcFeeder, Server  # noqa: E402
from bufc.generated import llama_flash  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from plain_flash import PlainFeeder  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLOTS, BUDGET, TPB, WINDOW = 8, 96, 16, 512


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,block_size", [(1, 16), (4, 64), (8, 1)])
def test_triton_decode_kernel_equals_the_reference(dtype, group, block_size):
    from bufc.examples.paged_decode import paged_decode

    g = torch.Generator(device="cuda").manual_seed(group * 100 + block_size)
    kv_heads, dim = 4, 64
    lens = torch.tensor([0, 1, 63, 64, 65, 300, 1000, 7], dtype=torch.int32, device="cuda")
    width = -(-1000 // block_size)
    blocks = len(lens) * width + 1
    q = torch.randn(len(lens), kv_heads * group, dim, generator=g, device="cuda").to(dtype)
    k = torch.randn(blocks, block_size, kv_heads, dim, generator=g, device="cuda").to(dtype)
    v = torch.randn(blocks, block_size, kv_heads, dim, generator=g, device="cuda").to(dtype)
    table = torch.randperm(blocks, generator=g, device="cuda")[: len(lens) * width]
    table = table.view(len(lens), width).int()
    got = paged_decode(q, k, v, table, lens, torch.full_like(q, 7.0), dim**-0.5)
    want = paged_decode_reference(
        q.double(),
        k.double(),
        v.double(),
        table,
        lens,
        torch.empty_like(q, dtype=torch.float64),
        dim**-0.5,
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert (got[0] == 0).all()  # a padded row (length 0)


def _feeder(name: str, dtype: torch.dtype):
    config = llama_flash.Config(
        max_batch_size=SLOTS,
        max_num_tokens=BUDGET,
        vocab_size=512,
        num_layers=2,
        max_attention_window=WINDOW,
        tokens_per_block=TPB,
        logits_dtype=dtype,
    )
    return (BufcFeeder if name == "bufc" else PlainFeeder)(config, "cuda")


def _serve(model, name: str, jobs, graphs: bool = True, graph_tokens: int | None = None):
    engine = FastLlama(model, max_positions=WINDOW)
    server = Server(
        engine,
        _feeder(name, engine.dtype),
        max_batch_size=SLOTS,
        token_budget=BUDGET,
        chunk_size=40,
        tokens_per_block=TPB,
        num_blocks=SLOTS * WINDOW // TPB + 1,
        graphs=graphs,
        graph_tokens=graph_tokens,
    )
    return server, server.run(jobs)


@pytest.mark.parametrize("graph_tokens", [None, 0], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", ["bufc", "plain"])
def test_served_on_cuda_equals_transformers_generate(name, graph_tokens):
    """float32 (the Triton kernel at full precision; the eager run's prefill is the reference,
    FlashAttention taking half types only), tokens left on the device: every step replayed from
    its bucket's CUDA graph, or every step eager."""
    model = tiny_llama(seed=0).to(torch.float32).cuda()
    jobs = workload(32, seed=1, max_prompt=200)
    server, served = _serve(model, name, jobs, graph_tokens=graph_tokens)
    if graph_tokens is None:
        assert len(server.graphs.graphs) >= 2  # several buckets captured and replayed
        assert all(r.graph for r in served.steps)
        assert any(r.context_requests and r.generation_requests for r in served.steps)
    else:
        assert not server.graphs.graphs
    want = reference_tokens(model, jobs)
    bad = [rid for rid in want if served.tokens[rid] != want[rid]]
    assert not bad, (bad, served.tokens[bad[0]], want[bad[0]])


def test_graph_replays_equal_the_eager_run_in_bf16():
    """bf16: the same requests served with every step replayed from CUDA graphs and run eagerly
    at the same shapes give the same tokens; bufc's and the plain preparation give the same
    tokens."""
    model = tiny_llama(seed=0).to(torch.bfloat16).cuda()
    jobs = workload(32, seed=2, max_prompt=200)
    engine = FastLlama(model, max_positions=WINDOW)
    assert engine.varlen is not None
    runs = [
        _serve(model, name, jobs, graphs)[1]
        for name, graphs in (("bufc", True), ("bufc", False), ("plain", True))
    ]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens


def test_flash_attention_prefill_equals_the_reference_in_bf16():
    """The eager path's prompt chunks: torch's varlen_attn over K/V gathered in sequence order
    equals varlen_reference (causal, queries at the end of their keys), grouped heads."""
    from bufc.examples.fast_llama import varlen_reference
    from bufc.examples.flash_llama import _varlen_attn

    g = torch.Generator(device="cuda").manual_seed(5)
    heads, kv_heads, dim = 8, 2, 64
    cu_q, cu_k = [0, 5, 5 + 130, 5 + 130 + 1], [0, 40, 40 + 130, 40 + 130 + 300]
    q = torch.randn(cu_q[-1], heads, dim, generator=g, device="cuda").bfloat16()
    k = torch.randn(cu_k[-1], kv_heads, dim, generator=g, device="cuda").bfloat16()
    v = torch.randn(cu_k[-1], kv_heads, dim, generator=g, device="cuda").bfloat16()
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    got = _varlen_attn()(
        q,
        k.repeat_interleave(heads // kv_heads, dim=1),
        v.repeat_interleave(heads // kv_heads, dim=1),
        as_tensor(cu_q),
        as_tensor(cu_k),
        130,
        300,
    )
    want = varlen_reference(q.double(), k.double(), v.double(), cu_q, cu_k, dim**-0.5)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
