"""A packed-input Llama forward written against the engine contract.

It reads only the engine inputs of a prepared step (``input_ids``, ``position_ids``,
``host_request_types``, ``host_context_lengths``, ``sequence_length``, ``last_token_ids``,
``kv_cache_block_offsets``, and ``hidden_states_input`` on later pipeline stages) and writes
``step.outputs["logits"]`` (or ``hidden_states_output`` before the last stage). Attention reads
and writes the paged cache through the block offsets. Weights, norms, MLP and rotary embedding
come from a Hugging Face ``LlamaForCausalLM``; the packing, paging, attention and the
pipeline/tensor split (``parallel.py``) are ours.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .paged_cache import PagedKVCache
from .parallel import Parallel, shard_layer, vocab_shard


class PackedLlama:
    def __init__(
        self, hf_model: torch.nn.Module, parallel: Parallel | None = None, vocab_padded: int = 0
    ) -> None:
        """This rank's part of the model: its pipeline stage's layers, each holding its
        tensor-parallel share of the heads and of the MLP, and its share of the vocabulary
        (`vocab_padded` rows in all, the buffers' vocab_size_padded)."""
        cfg = hf_model.config
        par = self.par = parallel or Parallel()
        self.hf = hf_model
        self.model = hf_model.model
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads // par.tp_size
        self.kv_heads = cfg.num_key_value_heads // par.tp_size
        self.num_layers = cfg.num_hidden_layers // par.pp_size
        first = par.pp_rank * self.num_layers
        layers = list(self.model.layers[first : first + self.num_layers])
        if par.tp_size > 1:
            layers = [
                shard_layer(x, cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim, par)
                for x in layers
            ]
        self.layers = layers
        padded = vocab_padded or cfg.vocab_size
        self.lm_weight = vocab_shard(hf_model.lm_head, padded, par) if par.last_stage else None

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
        inp, par = step.inputs, self.par
        positions = inp["position_ids"].long()
        types = inp["host_request_types"].tolist()
        lengths = inp["host_context_lengths"].tolist()
        # each sequence's KV length after the step, from host inputs (no wait on the device):
        # a context row's past length already counts its chunk, a generation row's does not
        past = inp["host_past_key_value_lengths"].tolist()
        seq_len = [p if t == 0 else p + 1 for p, t in zip(past, types)]
        offsets = inp["kv_cache_block_offsets"][0]
        tokens = step.sizes.num_tokens
        # tokens of each sequence this step: its context length for a context row, one for a
        # generation row (this example runs no draft tokens)
        new = [n if t == 0 else 1 for t, n in zip(types, lengths)]
        if sum(new) != tokens:
            raise ValueError(f"context lengths cover {sum(new)} tokens, the step packs {tokens}")
        starts = [0]
        for n in new:
            starts.append(starts[-1] + n)
        device = positions.device
        kv_pos = [
            torch.arange(seq_len[i] - new[i], seq_len[i], device=device) for i in range(len(new))
        ]
        slots = [cache.slots(offsets[i], kv_pos[i]) for i in range(len(new))]
        histories = [
            cache.slots(offsets[i], torch.arange(seq_len[i], device=device))
            for i in range(len(new))
        ]

        if par.first_stage:
            x = self.model.embed_tokens(inp["input_ids"].long())
        else:  # the previous stage's hidden states, received into the buffers' input
            par.recv_hidden(inp["hidden_states_input"])
            x = inp["hidden_states_input"]
        cos, sin = self.model.rotary_emb(x[None], positions[None])
        group = self.num_heads // self.kv_heads
        for layer_idx, layer in enumerate(self.layers):
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
            x = x + par.all_reduce(attn.o_proj(out.reshape(tokens, -1)))
            x = x + par.all_reduce(layer.mlp(layer.post_attention_layernorm(x)))
        if not par.last_stage:
            step.outputs["hidden_states_output"].copy_(x)
            par.send_hidden(step.outputs["hidden_states_output"])
            return
        x = self.model.norm(x)
        last = inp["last_token_ids"].long() - 1  # 1-based index of each logit row's last token
        par.gather_vocab(x[last] @ self.lm_weight.T, step.outputs["logits"])

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

        if self.par.distributed:
            raise NotImplementedError("the fixed-shape decode runs in one process")
        x = self.model.embed_tokens(ids)
        cos, sin = self.model.rotary_emb(x[None], positions[None])
        for layer_idx, layer in enumerate(self.layers):
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
        outputs["logits"].copy_(x[last] @ self.lm_weight.T)
