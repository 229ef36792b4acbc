"""A packed-input Llama forward written against the engine contract.

It reads only the engine inputs of a prepared step (``input_ids``, ``position_ids``,
``host_request_types``, ``host_context_lengths``, ``sequence_length``, ``last_token_ids``,
``kv_cache_block_offsets``) and writes ``step.outputs["logits"]``. Attention reads and writes
the paged cache through the block offsets. Weights, norms, MLP and rotary embedding come from
a Hugging Face ``LlamaForCausalLM``; the packing, paging and attention are ours.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .paged_cache import PagedKVCache


class PackedLlama:
    def __init__(self, hf_model: torch.nn.Module) -> None:
        cfg = hf_model.config
        self.hf = hf_model
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
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
    def forward(self, step, cache: PagedKVCache) -> None:
        inp = step.inputs
        ids = inp["input_ids"].long()
        positions = inp["position_ids"].long()
        types = inp["host_request_types"].tolist()
        lengths = inp["host_context_lengths"].tolist()
        seq_len = inp["sequence_length"].cpu().tolist()
        offsets = inp["kv_cache_block_offsets"][0]
        tokens = ids.numel()
        # tokens of each sequence this step: its context length for a context row, one for a
        # generation row (this example runs no draft tokens)
        new = [n if t == 0 else 1 for t, n in zip(types, lengths)]
        if sum(new) != tokens:
            raise ValueError(f"context lengths cover {sum(new)} tokens, the step packs {tokens}")
        starts = [0]
        for n in new:
            starts.append(starts[-1] + n)
        device = ids.device
        kv_pos = [
            torch.arange(seq_len[i] - new[i], seq_len[i], device=device) for i in range(len(new))
        ]
        slots = [cache.slots(offsets[i], kv_pos[i]) for i in range(len(new))]
        histories = [
            cache.slots(offsets[i], torch.arange(seq_len[i], device=device))
            for i in range(len(new))
        ]

        x = self.model.embed_tokens(ids)
        cos, sin = self.model.rotary_emb(x[None], positions[None])
        group = self.num_heads // self.kv_heads
        for layer_idx, layer in enumerate(self.model.layers[: self.num_layers]):
            attn = layer.self_attn
            q, k, v = self._qkv(layer, x, cos, sin)
            out = torch.empty_like(q)
            for i, (a, b) in enumerate(zip(starts, starts[1:])):
                if a == b:
                    continue
                cache.write(layer_idx, *slots[i], k[a:b], v[a:b])
                keys, values = cache.read(layer_idx, *histories[i])  # [kv_len, kv_heads, dim]
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
                scores = torch.einsum("qhd,khd->hqk", q[a:b], keys) * self.head_dim**-0.5
                causal = kv_pos[i][:, None] >= torch.arange(seq_len[i], device=device)[None, :]
                scores = scores.masked_fill(~causal, float("-inf"))
                out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
            x = x + attn.o_proj(out.reshape(tokens, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.model.norm(x)
        last = inp["last_token_ids"].long() - 1  # 1-based index of each logit row's last token
        step.outputs["logits"].copy_(self.lm_head(x[last]))

    @torch.no_grad()
    def decode(self, inputs: dict, outputs: dict, cache: PagedKVCache) -> None:
        """A generation-only step with fixed shapes and no host reads, so it can be captured
        in a CUDA graph: every sequence attends over its whole window, masked by
        sequence_length. Padding rows (sequence_length 0, offsets 0) use the reserved block 0."""
        ids = inputs["input_ids"].long()
        positions = inputs["position_ids"].long()
        seq_len = inputs["sequence_length"].long().clamp(min=1)
        offsets = inputs["kv_cache_block_offsets"][0].long()  # [B, 2, max_blocks]
        rows = ids.numel()
        tpb = cache.tokens_per_block
        window = offsets.shape[-1] * tpb
        kv_pos = torch.arange(window, device=ids.device)
        new_pos = seq_len - 1
        new_slab = offsets[:, 0].gather(1, (new_pos // tpb)[:, None])[:, 0]
        new_slot = new_pos % tpb
        hist_slab = offsets[:, 0].repeat_interleave(tpb, dim=1)  # [B, window]
        hist_slot = (kv_pos % tpb).expand(rows, window)
        visible = kv_pos[None, :] < seq_len[:, None]  # [B, window]
        group = self.num_heads // self.kv_heads

        x = self.model.embed_tokens(ids)
        cos, sin = self.model.rotary_emb(x[None], positions[None])
        for layer_idx, layer in enumerate(self.model.layers[: self.num_layers]):
            attn = layer.self_attn
            q, k, v = self._qkv(layer, x, cos, sin)
            cache.write(layer_idx, new_slab, new_slot, k, v)
            keys, values = cache.read(layer_idx, hist_slab, hist_slot)  # [B, window, kvh, dim]
            keys = keys.repeat_interleave(group, dim=2)
            values = values.repeat_interleave(group, dim=2)
            scores = torch.einsum("bhd,bkhd->bhk", q, keys) * self.head_dim**-0.5
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            out = torch.einsum("bhk,bkhd->bhd", scores.softmax(-1), values)
            x = x + attn.o_proj(out.reshape(rows, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.model.norm(x)
        last = (inputs["last_token_ids"].long() - 1).clamp(min=0)
        outputs["logits"].copy_(self.lm_head(x[last]))
