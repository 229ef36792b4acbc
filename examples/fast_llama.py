"""A fast Llama engine on the FlashAttention/vLLM contract (``llama_flash``'s inputs).

What it reads, per step: ``input_ids``, ``positions``, ``slot_mapping``, ``block_table``,
``seq_lens``, ``query_start_loc`` and ``logits_indices`` on the device, and four host integers:
the context sequences (they come first), their tokens, and the longest query and sequence
(``Batch``). Weights are Hugging Face ``LlamaForCausalLM``'s, fused once (Q/K/V in one matrix,
gate and up in another) in the model's dtype (bf16 for speed).

- K/V of every token are written into the paged cache (``flash_llama.FlashKVCache``: one pool
  per layer, vLLM's layout) through ``slot_mapping`` (a negative slot, a padded token, lands in
  its trash row).
- Context chunks attend through ``prefill`` over their K/V gathered from the cache in sequence
  order: torch's FlashAttention (``varlen_attn``) on CUDA in float16/bfloat16, the same packed
  computation in plain torch otherwise (``varlen_reference``).
- Generation rows attend through ``paged_decode`` straight from the cache, block by block: the
  Triton kernel of ``paged_decode.py`` on CUDA, ``paged_decode_reference`` otherwise.

``step`` runs any step with fixed shapes and no host read: every query token attends through
``paged_decode`` as a row of its own (its sequence's ``block_table`` row, its KV position plus one
as the length: causal attention over the cache, into which the step's K/V are written first), so
one CUDA graph per token and batch bucket replays it (``StepGraphs``), mixed steps included.
``forward`` runs a step eagerly at its own shapes, context chunks through FlashAttention: for
steps of many prompt tokens, where a query row per token would re-read its sequence's K/V.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .flash_llama import FlashKVCache, _varlen_attn


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step as the engine reads it: the contract's device tensors (`inputs`, by engine
    name) and the host integers that size its attention calls."""

    inputs: dict[str, torch.Tensor]
    num_context: int  # context sequences (rows 0 .. num_context - 1)
    context_tokens: int  # their query tokens (tokens 0 .. context_tokens - 1)
    context_kv: int  # their KV positions after the step, together
    max_query_len: int
    max_seq_len: int


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """paged_decode in plain torch (any device and dtype, fixed shapes): every row reads its
    whole block_table row, masked at seq_lens; a row of length 0 gets zeros."""
    rows, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    width = block_table.shape[1] * block_size
    pos = torch.arange(width, device=q.device)
    slots = block_table.long().repeat_interleave(block_size, dim=1) * block_size + pos % block_size
    keys = k_cache.flatten(0, 1)[slots]  # [rows, width, kv_heads, dim]
    values = v_cache.flatten(0, 1)[slots]
    grouped = q.view(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("bkgd,btkd->bkgt", grouped, keys) * scale
    visible = pos[None, :] < seq_lens.long()[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1), nan=0.0)  # a row of length 0: all masked
    out.copy_(torch.einsum("bkgt,btkd->bkgd", weights, values).reshape(rows, heads, dim))
    return out


def varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: list[int],
    cu_k: list[int],
    scale: float,
) -> torch.Tensor:
    """varlen_attn's computation in plain torch: sequence i's queries q[cu_q[i]:cu_q[i+1]]
    over its keys k[cu_k[i]:cu_k[i+1]], causal with the queries at the end of the keys."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        a, b, c, e = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        keys = k[c:e].repeat_interleave(heads // kv_heads, dim=1)
        values = v[c:e].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b], keys) * scale
        query_pos = torch.arange(e - c - (b - a), e - c, device=q.device)
        causal = query_pos[:, None] >= torch.arange(e - c, device=q.device)[None, :]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def _kernels(device: torch.device, dtype: torch.dtype) -> tuple[Callable, Callable | None]:
    """The decode attention and FlashAttention to run on `device` at `dtype` (None: the
    reference prefill): the fast ones on CUDA, where they can run."""
    if device.type != "cuda":
        return paged_decode_reference, None
    from .paged_decode import paged_decode

    return paged_decode, (_varlen_attn() if dtype in (torch.float16, torch.bfloat16) else None)


class _Layer:
    """One decoder layer's weights, fused."""

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = torch.cat((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)).detach()
        self.o = attn.o_proj.weight.detach()
        self.gate_up = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)).detach()
        self.down = mlp.down_proj.weight.detach()
        self.norm1 = layer.input_layernorm.weight.detach()
        self.norm2 = layer.post_attention_layernorm.weight.detach()


class FastLlama:
    """The engine over a Hugging Face Llama's weights (module docstring). `max_positions`
    bounds the rotary table (positions 0 .. max_positions - 1)."""

    def __init__(self, hf_model: torch.nn.Module, max_positions: int = 4096) -> None:
        cfg = hf_model.config
        param = next(hf_model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        model = hf_model.model
        self.embed = model.embed_tokens.weight.detach()
        self.layers = [_Layer(layer) for layer in model.layers]
        self.norm = model.norm.weight.detach()
        self.lm_head = hf_model.lm_head.weight.detach()
        with torch.no_grad():  # the model's own rotary values, once: [positions, head_dim]
            positions = torch.arange(max_positions, device=self.device)[None]
            cos, sin = model.rotary_emb(self.embed[:1][None], positions)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)
        self.decode_attention, self.varlen = _kernels(self.device, self.dtype)

    def weight_bytes(self) -> int:
        """Bytes of the weights a step reads (the embedding rows it reads are left out)."""
        tensors = [self.norm, self.lm_head]
        for w in self.layers:
            tensors += [w.qkv, w.o, w.gate_up, w.down, w.norm1, w.norm2]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers normalises in float32 and casts back before the weight: so do we
        return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.no_grad()
    def forward(self, batch: Batch, cache: FlashKVCache, logits: torch.Tensor) -> torch.Tensor:
        """Any step, eagerly: its logit rows into `logits` ([rows, vocab] or wider); returns
        them."""
        return self._run(batch, cache, logits)

    @torch.no_grad()
    def step(
        self, inputs: dict[str, torch.Tensor], cache: FlashKVCache, logits: torch.Tensor
    ) -> torch.Tensor:
        """Any step at the shapes of `inputs` (a token and batch bucket: padded tokens have
        slot -1 and lie past query_start_loc's last value, padded rows have seq_lens 0), with
        no host read: capturable as a CUDA graph. Each query token is a ``paged_decode`` row
        (``token_rows``)."""
        table, lens = self.token_rows(inputs)
        batch = Batch({**inputs, "block_table": table, "seq_lens": lens}, 0, 0, 0, 1, 0)
        return self._run(batch, cache, logits)

    @staticmethod
    def token_rows(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query token as a decode row of its own: its sequence's block_table row, and
        its KV position plus one (it attends to its sequence's positions up to its own), from
        the contract's query_start_loc and seq_lens alone (token j of sequence s, whose query
        ends at query_start_loc[s + 1], sits at seq_lens[s] - query_start_loc[s + 1] + j). A
        token past the step's (query_start_loc's last value) gets length 0: zeros."""
        starts, seq_lens = inputs["query_start_loc"], inputs["seq_lens"]
        tokens = inputs["input_ids"].shape[0]
        t = torch.arange(tokens, device=starts.device, dtype=starts.dtype)
        seq = torch.searchsorted(starts[1:], t, right=True).clamp_(max=seq_lens.shape[0] - 1)
        lens = seq_lens[seq] - starts[1:][seq] + t + 1
        lens = torch.where(t < starts[-1], lens, torch.zeros_like(lens))
        return inputs["block_table"][seq], lens

    def _run(self, batch: Batch, cache: FlashKVCache, logits: torch.Tensor) -> torch.Tensor:
        inp = batch.inputs
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        n_ctx, n_ctx_tok = batch.num_context, batch.context_tokens
        ids = inp["input_ids"]
        tokens = ids.shape[0]
        x = self.embed[ids.long()]
        positions = inp["positions"].long()
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        rows = cache.rows(inp["slot_mapping"])
        table, seq_lens = inp["block_table"], inp["seq_lens"]
        prefill = self._prefill_index(batch, cache) if n_ctx else None
        out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
        for index, w in enumerate(self.layers):
            qkv = F.linear(self._rms(x, w.norm1), w.qkv).view(tokens, heads + 2 * kv_heads, dim)
            qk = self._rope(qkv[:, : heads + kv_heads], cos, sin)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
            cache.write_rows(index, rows, k, v)
            k_cache, v_cache = cache.pools[index][0], cache.pools[index][1]
            if prefill is not None:
                out[:n_ctx_tok] = self._prefill(q[:n_ctx_tok], k_cache, v_cache, batch, prefill)
            if n_ctx_tok < tokens:
                self.decode_attention(
                    q[n_ctx_tok:],
                    k_cache,
                    v_cache,
                    table[n_ctx:],
                    seq_lens[n_ctx:],
                    out[n_ctx_tok:],
                    self.scale,
                )
            x = x + F.linear(out.view(tokens, heads * dim), w.o)
            gate, up = F.linear(self._rms(x, w.norm2), w.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.down)
        h = self._rms(x[inp["logits_indices"].long()], self.norm)
        rows = logits[: h.shape[0], : self.vocab_size]
        if rows.is_contiguous():
            torch.mm(h, self.lm_head.t(), out=rows)
        else:  # a vocabulary padded past the model's
            rows.copy_(h @ self.lm_head.t())
        return rows

    def _prefill_index(self, batch: Batch, cache: FlashKVCache) -> dict[str, Any]:
        """Once per step: the cache rows of the context sequences' K/V positions, sequence
        after sequence, and their cumulative lengths (what varlen attention reads)."""
        inp, n = batch.inputs, batch.num_context
        seq_lens = inp["seq_lens"][:n].long()
        cu_k = torch.zeros(n + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=cu_k[1:])
        t = torch.arange(batch.context_kv, device=seq_lens.device)
        seq = torch.searchsorted(cu_k[1:].long(), t, right=True)
        pos = t - cu_k[seq].long()
        bs = cache.block_size
        kv_rows = inp["block_table"][:n].long()[seq, pos // bs] * bs + pos % bs
        index: dict[str, Any] = {"rows": kv_rows, "cu_q": inp["query_start_loc"][: n + 1]}
        index["cu_k"] = cu_k
        if self.varlen is None:  # the reference loops on the host
            index["cu_q_host"] = index["cu_q"].tolist()
            index["cu_k_host"] = cu_k.tolist()
        return index

    def _prefill(self, q, k_cache, v_cache, batch: Batch, index: dict[str, Any]) -> torch.Tensor:
        group = self.heads // self.kv_heads
        keys = k_cache.flatten(0, 1)[index["rows"]]
        values = v_cache.flatten(0, 1)[index["rows"]]
        if self.varlen is None:
            return varlen_reference(
                q, keys, values, index["cu_q_host"], index["cu_k_host"], self.scale
            )
        return self.varlen(
            q.contiguous(),
            keys.repeat_interleave(group, dim=1),
            values.repeat_interleave(group, dim=1),
            index["cu_q"],
            index["cu_k"],
            batch.max_query_len,
            batch.max_seq_len,
        )


class StepGraphs:
    """One CUDA graph per (tokens, rows) bucket of ``FastLlama.step``, captured on a bucket's
    first step (after one eager warm-up run off the capture stream) and replayed after: the
    inputs and logits of a bucket must keep their addresses (bufc's bucket views do). Off CUDA,
    or with `enabled` False, every step runs eagerly at the same shapes."""

    def __init__(self, engine: FastLlama, cache: FlashKVCache, enabled: bool = True) -> None:
        self.engine, self.cache = engine, cache
        self.enabled = enabled and engine.device.type == "cuda"
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None

    def run(
        self, bucket: tuple[int, int], inputs: dict[str, torch.Tensor], logits: torch.Tensor
    ) -> torch.Tensor:
        """The step over `inputs` (views at `bucket`'s shapes: tokens, rows)."""
        if not self.enabled:
            return self.engine.step(inputs, self.cache, logits)
        held = self.graphs.get(bucket)
        if held is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up off the capture stream, as torch asks
                self.engine.step(inputs, self.cache, logits)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.engine.step(inputs, self.cache, logits)
            held = self.graphs[bucket] = (graph, out)
        held[0].replay()
        return held[1]
