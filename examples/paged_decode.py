"""Paged decode attention as a Triton kernel: one query token per sequence over its KV history,
read block by block through its ``block_table`` row (the FlashAttention/vLLM contract's
``block_table`` and ``seq_lens``), for a cache laid out ``[blocks, block_size, kv_heads,
head_dim]`` per layer and K/V.

One program per (sequence, KV head) holds the query heads of its group and runs an online
softmax over the sequence's first ``seq_lens`` positions, so K and V are read once, in block
order: the step is bound by memory, which is what the kernel is written for. Grid and shapes are
fixed for a batch bucket and nothing is read on the host, so a decode step that calls it can be
captured in a CUDA graph; a padded row (``seq_lens`` 0) writes zeros.

Importing this module needs Triton (CUDA); ``fast_llama.paged_decode_reference`` is the same
computation in plain torch, for any device, and what the GPU tests check the kernel against.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # KV positions per iteration


def _paged_decode(
    Q,
    K,
    V,
    Out,
    table,
    lens,
    scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_tb,
    stride_kblk,
    stride_kt,
    stride_kh,
    G: tl.constexpr,  # query heads per KV head
    GP: tl.constexpr,  # G padded to a dot's smallest M (16)
    D: tl.constexpr,  # head dim (a power of two)
    BS: tl.constexpr,  # tokens per KV block
    BN: tl.constexpr,  # KV positions per iteration
    IEEE: tl.constexpr,  # float32 data: full-precision dots (tf32 otherwise)
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(lens + b)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    head = h * G + g
    live = g < G
    q = tl.load(
        Q + b * stride_qb + head[:, None] * stride_qh + d[None, :], mask=live[:, None], other=0.0
    ).to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(0, n, BN):
        t = start + tl.arange(0, BN)
        inside = t < n
        block = tl.load(table + b * stride_tb + t // BS, mask=inside, other=0).to(tl.int64)
        row = block * stride_kblk + (t % BS) * stride_kt + h * stride_kh
        k = tl.load(K + row[:, None] + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(inside[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(V + row[:, None] + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    out = tl.where(total[:, None] > 0, acc / tl.maximum(total, 1e-30)[:, None], 0.0)
    tl.store(
        Out + b * stride_ob + head[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=live[:, None],
    )


@functools.cache
def kernel() -> Any:
    """The kernel, compiled on its first launch (one build per constexpr combination)."""
    return triton.jit(_paged_decode)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """out[i] = attention of query q[i] ([heads, head_dim]) over the first seq_lens[i] KV
    positions of sequence i, position p at row p % block_size of block block_table[i, p //
    block_size] of k_cache / v_cache ([blocks, block_size, kv_heads, head_dim], the same
    strides). Returns `out` ([rows, heads, head_dim])."""
    rows, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if heads % kv_heads or dim & (dim - 1) or k_cache.stride() != v_cache.stride():
        raise ValueError("paged_decode: heads a multiple of kv_heads, head_dim a power of two")
    if k_cache.stride(-1) != 1 or q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("paged_decode: the head dimension must be contiguous")
    group = heads // kv_heads
    kernel()[(rows, kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_table,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        G=group,
        GP=max(16, triton.next_power_of_2(group)),
        D=dim,
        BS=block_size,
        BN=BLOCK_N,
        IEEE=q.dtype == torch.float32,
    )
    return out
