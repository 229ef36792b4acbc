"""A packed-input Llama forward written against the FlashAttention/vLLM contract (``llama_flash``)
or FlashInfer's (``llama_flashinfer``).

It reads only that family's engine inputs: ``input_ids``, ``positions``, ``query_start_loc_cpu``
and ``seq_lens_cpu`` (host mirrors: the per-sequence loop needs them on the host, as vLLM's
metadata builders do), ``block_table``, ``slot_mapping`` and ``logits_indices``; or, for
FlashInfer, ``qo_indptr_cpu``, ``paged_kv_indptr_cpu``, ``paged_kv_indices`` and
``paged_kv_last_page_len_cpu`` in place of the query starts, lengths and block table. It writes
``step.outputs["logits"]``. K/V are written into a paged pool, one per layer laid out as vLLM's
``[2, num_blocks, block_size, kv_heads, head_dim]``, through ``slot_mapping`` (a negative slot
is skipped), and each sequence attends over its first ``seq_lens`` KV positions, gathered
through its ``block_table`` row. Weights, norms, MLP and rotary embedding come from a Hugging
Face ``LlamaForCausalLM``; the packing, paging and attention are ours.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class FlashKVCache:
    """One paged K/V pool per layer, addressed by slot: slot s is block s // block_size, row
    s % block_size. Block 0 is the null block: the allocator never hands it out (a padded
    block_table row points there). One block more than `num_blocks` holds the writes of
    padded tokens in a fixed-shape step (slot -1 goes to its first row, `trash`)."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        self.block_size = block_size
        self.trash = num_blocks * block_size
        self.pools = [
            torch.zeros(
                2, num_blocks + 1, block_size, kv_heads, head_dim, dtype=dtype, device=device
            )
            for _ in range(num_layers)
        ]

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The pool rows a step's tokens write: their slots, the trash row for a negative one
        (computed once a step, for every layer's write_rows)."""
        return torch.where(slots >= 0, slots, self.trash).long()

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V of each token into its pool row (fixed shapes, no host read: CUDA-graph safe)."""
        pool = self.pools[layer].flatten(1, 2)  # [2, blocks * block_size, heads, dim]
        pool[0].index_copy_(0, rows, k)
        pool[1].index_copy_(0, rows, v)

    def write_fixed(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """write() with fixed shapes and no host read (CUDA-graph safe): a negative slot's
        K/V land in the trash row."""
        self.write_rows(layer, self.rows(slots), k, v)

    def bytes_per_token(self) -> int:
        """Bytes of K and V one token holds, over all layers."""
        pool = self.pools[0]
        return len(self.pools) * 2 * pool[0, 0, 0].numel() * pool.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V of each token into its slot; a negative slot (a padded token) writes nothing."""
        keep = slots >= 0
        pool = self.pools[layer].flatten(1, 2)  # [2, blocks * block_size, heads, dim]
        pool[0, slots[keep]] = k[keep]
        pool[1, slots[keep]] = v[keep]

    def read(
        self, layer: int, blocks: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` KV positions of a sequence whose block_table row is `blocks`."""
        bs = self.block_size
        used = blocks[: -(-length // bs)].long()
        slots = (used[:, None] * bs + torch.arange(bs, device=used.device)).reshape(-1)[:length]
        pool = self.pools[layer].flatten(1, 2)
        return pool[0, slots], pool[1, slots]


def _varlen_attn() -> Any:
    """torch's FlashAttention for packed variable-length sequences, called causally (its
    keyword for that changed between torch releases)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return lambda *args: varlen_attn(*args, **causal)


class FlashLlama:
    """`attention`: "packed" attends per sequence with plain torch (any dtype, any device);
    "varlen" gathers each sequence's K/V through its block_table row into packed tensors and
    runs torch's FlashAttention (``varlen_attn``: CUDA, float16 or bfloat16) over the whole
    step with cu_seqlens from query_start_loc and seq_lens."""

    def __init__(self, hf_model: torch.nn.Module, attention: str = "packed") -> None:
        if attention not in ("packed", "varlen"):
            raise ValueError(f"attention is 'packed' or 'varlen', got {attention!r}")
        self.attend = self._packed if attention == "packed" else self._varlen
        self.varlen = _varlen_attn() if attention == "varlen" else None
        cfg = hf_model.config
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.num_layers = cfg.num_hidden_layers

    def _qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries, keys (rotated) and values of packed tokens: [tokens, heads, head_dim]."""
        attn, tokens = layer.self_attn, x.shape[0]
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, tokens, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(tokens, self.kv_heads, self.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1), v

    @torch.no_grad()
    def forward(self, step, cache: FlashKVCache) -> None:
        inp = step.inputs
        x = self.model.embed_tokens(inp["input_ids"].long())
        cos, sin = self.model.rotary_emb(x[None], inp["positions"][None])
        context = self._context(step, cache)
        tokens = x.shape[0]
        for layer_idx, layer in enumerate(self.model.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            cache.write(layer_idx, inp["slot_mapping"], k, v)
            out = self.attend(q, layer_idx, cache, context)
            x = x + layer.self_attn.o_proj(out.reshape(tokens, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.model.norm(x[inp["logits_indices"]])
        step.outputs["logits"].copy_(self.lm_head(x))

    def _context(self, step, cache: FlashKVCache) -> dict:
        """What the attention of every layer reads, once per step: each sequence's query rows
        (`starts`), KV length (`lens`) and block ids (`rows`), from llama_flash's
        query_start_loc, seq_lens and block_table, or from llama_flashinfer's qo_indptr and
        paged KV arrays."""
        inp = step.inputs
        if "paged_kv_indptr" in inp:  # FlashInfer: lengths from the pages and the last one
            if self.varlen is not None:
                raise ValueError("varlen attention reads llama_flash's block_table and seq_lens")
            indptr = inp["paged_kv_indptr_cpu"].tolist()
            last = inp["paged_kv_last_page_len_cpu"].tolist()
            indices, bs = inp["paged_kv_indices"], cache.block_size
            spans = list(zip(indptr, indptr[1:]))
            return {
                "starts": inp["qo_indptr_cpu"].tolist(),
                "lens": [(b - a - 1) * bs + n for (a, b), n in zip(spans, last)],
                "rows": [indices[a:b] for a, b in spans],
            }
        starts, lens = inp["query_start_loc_cpu"].tolist(), inp["seq_lens_cpu"].tolist()
        ctx = {"starts": starts, "lens": lens, "rows": inp["block_table"]}
        if self.varlen is not None:  # the packed K/V's slots: sequence after sequence
            seq_lens = inp["seq_lens"].long()
            cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32, device=seq_lens.device)
            torch.cumsum(seq_lens, 0, out=cu_k[1:])
            t = torch.arange(sum(lens), device=seq_lens.device)
            seq = torch.searchsorted(cu_k[1:].long(), t, right=True)
            pos = t - cu_k[seq].long()
            bs = cache.block_size
            ctx["kv_slots"] = inp["block_table"].long()[seq, pos // bs] * bs + pos % bs
            ctx["cu_q"], ctx["cu_k"] = inp["query_start_loc"], cu_k
            ctx["max_q"], ctx["max_k"] = step.scalars["max_query_len"], step.scalars["max_seq_len"]
        return ctx

    def _packed(self, q, layer_idx: int, cache: FlashKVCache, ctx: dict) -> torch.Tensor:
        """Each sequence's queries over its KV, one sequence at a time."""
        group = self.num_heads // self.kv_heads
        out = torch.zeros_like(q)
        starts = ctx["starts"]
        for i, (a, b) in enumerate(zip(starts, starts[1:])):
            if a == b:
                continue
            length = ctx["lens"][i]
            keys, values = cache.read(layer_idx, ctx["rows"][i], length)
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[a:b], keys) * self.head_dim**-0.5
            # query j sits at KV position length - (b - a) + j and sees positions up to it
            query_pos = torch.arange(length - (b - a), length, device=q.device)
            causal = query_pos[:, None] >= torch.arange(length, device=q.device)[None, :]
            scores = scores.masked_fill(~causal, float("-inf"))
            out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        return out

    def _varlen(self, q, layer_idx: int, cache: FlashKVCache, ctx: dict) -> torch.Tensor:
        """The whole step in one FlashAttention call: the queries packed as they come, each
        sequence's K/V gathered through its block_table row (bottom-right causal)."""
        pool = cache.pools[layer_idx].flatten(1, 2)
        group = self.num_heads // self.kv_heads
        keys = pool[0, ctx["kv_slots"]].repeat_interleave(group, dim=1)
        values = pool[1, ctx["kv_slots"]].repeat_interleave(group, dim=1)
        assert self.varlen is not None
        return self.varlen(
            q.contiguous(), keys, values, ctx["cu_q"], ctx["cu_k"], ctx["max_q"], ctx["max_k"]
        )

    @torch.no_grad()
    def decode(self, inputs: dict, outputs: dict, cache: FlashKVCache) -> None:
        """A generation-only step with fixed shapes and no host reads, so it can be captured in
        a CUDA graph at a batch bucket: every sequence attends over its whole block_table row,
        masked by seq_lens (a padded row, seq_lens 0, reads the null block's first position;
        its slot -1 writes to the trash row)."""
        ids = inputs["input_ids"].long()
        seq_lens = inputs["seq_lens"].long().clamp(min=1)
        table = inputs["block_table"].long()  # [B, max_blocks]
        slots = inputs["slot_mapping"]
        rows, bs = ids.numel(), cache.block_size
        window = table.shape[1] * bs
        kv_pos = torch.arange(window, device=ids.device)
        history = table.repeat_interleave(bs, dim=1) * bs + kv_pos % bs  # [B, window] slots
        visible = kv_pos[None, :] < seq_lens[:, None]
        group = self.num_heads // self.kv_heads
        x = self.model.embed_tokens(ids)
        cos, sin = self.model.rotary_emb(x[None], inputs["positions"][None])
        for layer_idx, layer in enumerate(self.model.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            cache.write_fixed(layer_idx, slots, k, v)
            pool = cache.pools[layer_idx].flatten(1, 2)
            keys = pool[0, history].repeat_interleave(group, dim=2)  # [B, window, heads, dim]
            values = pool[1, history].repeat_interleave(group, dim=2)
            scores = torch.einsum("bhd,bkhd->bhk", q, keys) * self.head_dim**-0.5
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            out = torch.einsum("bhk,bkhd->bhd", scores.softmax(-1), values)
            x = x + layer.self_attn.o_proj(out.reshape(rows, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.model.norm(x[inputs["logits_indices"]])
        outputs["logits"].copy_(self.lm_head(x))
