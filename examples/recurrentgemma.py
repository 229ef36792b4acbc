"""A real RecurrentGemma driven by the generated ``recurrentgemma`` buffers: a packed-input
engine over a paged, cyclic KV pool and per-slot recurrent state, and an in-flight driver,
checked against Hugging Face ``RecurrentGemmaForCausalLM``.

The engine (`PackedRecurrentGemma`) reads only the bound tensors of a step, as TensorRT-LLM's
RecurrentGemma does: ``input_ids``, ``position_ids``, ``host_request_types``,
``host_context_lengths``, ``host_past_key_value_lengths``, ``sequence_length``,
``last_token_ids``, ``kv_cache_block_offsets``, ``host_max_attention_window_sizes`` and
``slot_mapping``, plus the statics bound once (``buffers.static_inputs``):
``host_kv_cache_pool_pointers``, ``host_kv_cache_pool_mapping`` and the ``conv_state_ptr_<l>`` /
``rnn_state_ptr_<l>`` of each recurrent layer. It writes ``logits``. Storage is found by the
address it is bound with (a map from ``data_ptr()`` to tensor, as a device allocator would); an
unknown address, or a block index outside its pool, is refused.

- Attention layers (the GPT attention plugin): the pool holds the ATTENTION layers only, ``L``
  of them, as ``[blocks * L * 2, tokens_per_block, kv_heads, head_dim]`` slabs; an offset is
  TensorRT-LLM's KVCacheIndex ``block * L * 2 + (0 K, 1 V)`` and attention layer ``a`` adds
  ``2 * index`` from its row ``(pool, index)`` of ``host_kv_cache_pool_mapping``. The cache is
  cyclic: a sequence's KV position ``p`` lives at ``p % window`` (its window from
  ``host_max_attention_window_sizes``; the block table covers ``window`` tokens), so a query
  at ``p`` sees the keys ``p - window + 1 .. p``, HF's sliding window. A context row (a whole
  prompt, which may be longer than the window) attends over its own fresh K/V and leaves its
  last ``window`` tokens in the cache; a generation row writes its token, then reads the
  window from the cache.
- Recurrent layers: the convolution state ``[rows, conv1d_width - 1, lru_width]`` and the RG-LRU
  state ``[rows, lru_width]`` (float32, as HF keeps it) of row ``slot_mapping[i]``. A context
  row restarts its slot's states from zero with the whole prompt (docs/contract.md; HF resets
  the RG-LRU at position 0 and pads the convolution with zeros), so a reused slot's stale
  state is overwritten; a generation row advances both by one token. The arithmetic is HF's
  (its norms, MLPs, projections and gates, its float32 recurrence), so float64 logits agree to
  ~1e-14.

The driver (`RecurrentGemmaDriver`) serves requests that arrive over time through the in-flight
API only (``add``, ``step``, ``finish``) under the family's contract: whole prompts, context and
generation in separate steps (``generation=False`` for a context step), beam width 1. A context
step admits waiting requests in arrival order while slots are free and their prompts fit
``max_num_tokens``, each with the blocks of its prompt (its slot may hold an earlier request's
state: its context step restarts it); a generation step runs every request in flight and grows
its blocks (at most the window's) with ``blocks={slot: [...]}`` from an allocator; a request
with its tokens is finished, its blocks and slot freed for a later arrival.

``python -m bufc.examples.recurrentgemma`` runs a workload and checks every token against
``model.generate`` and every logit row against HF's forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.recurrent_gemma.modeling_recurrent_gemma import apply_rotary_pos_emb

from bufc.generated import recurrentgemma
from bufc.runtime import Request

from . import compare
from .compare import (
    assert_row_logits,
    assert_same_tokens,
    float64_model,
    random_jobs,
    threads_option,
    torch_threads,
)
from .executor import Job, admit_whole_prompts, whole_prompt_queue
from .paged_cache import BlockAllocator

CONTEXT, GENERATION = 0, 1


def tiny_recurrentgemma(
    seed: int = 0,
    *,
    vocab_size: int = 256,
    window: int = 10,
    num_layers: int = 6,
    init_scale: float = 1.0,
) -> torch.nn.Module:
    """A small random ``RecurrentGemmaForCausalLM`` in float64 (nothing downloaded): blocks
    recurrent, recurrent, attention, so layers 2 and 5 attend over a `window`-token sliding
    window. `init_scale` is HF's ``w_init_variance_scale`` (1.0: gates and attention far from
    uniform). eos is disabled, so ``generate`` gives exactly ``max_new_tokens`` tokens."""
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    config = RecurrentGemmaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=num_layers,
        attention_window_size=window,
        block_types=["recurrent", "recurrent", "attention"],
        w_init_variance_scale=init_scale,
    )
    return float64_model(RecurrentGemmaForCausalLM, config, seed)


def attention_layers(hf_config) -> list[int]:
    """The model's attention layers, in order (HF's ``layers_block_type``)."""
    kinds = hf_config.layers_block_type
    return [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]


# -------------------------------------------------------------------------------- storage
class Storage:
    """The engine's memory, allocated by the driver: one KV pool of the attention layers
    (``kv_blocks`` blocks of ``tokens_per_block`` tokens, the layers counted from the model,
    not from bufc), and per recurrent layer a convolution and an RG-LRU state pool of ``rows``
    rows. ``memory`` maps each address to its tensor (what the engine resolves pointers with)."""

    def __init__(self, hf_model, rows: int, kv_blocks: int, tokens_per_block: int) -> None:
        cfg = hf_model.config
        dtype = next(hf_model.parameters()).dtype
        self.attention = attention_layers(cfg)
        self.recurrent = [i for i in range(cfg.num_hidden_layers) if i not in self.attention]
        self.kv_layers = len(self.attention)
        shape = (tokens_per_block, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = torch.zeros(kv_blocks * self.kv_layers * 2, *shape, dtype=dtype)
        width = cfg.conv1d_width - 1
        self.conv = {
            i: torch.zeros(rows, width, cfg.lru_width, dtype=dtype) for i in self.recurrent
        }
        self.rnn = {
            i: torch.zeros(rows, cfg.lru_width, dtype=torch.float32) for i in self.recurrent
        }
        tensors = (self.kv, *self.conv.values(), *self.rnn.values())
        self.memory: dict[int, torch.Tensor] = {t.data_ptr(): t for t in tensors}

    def static_inputs(self, num_layers: int) -> dict[str, list[list[int]]]:
        """The family's static pointer tensors: the pool's address (no secondary pool), and
        each recurrent layer's state pools ([num_local_layers, 1]; 0 for attention layers)."""
        conv = [[self.conv[i].data_ptr() if i in self.conv else 0] for i in range(num_layers)]
        rnn = [[self.rnn[i].data_ptr() if i in self.rnn else 0] for i in range(num_layers)]
        return {
            "host_kv_cache_pool_pointers": [[self.kv.data_ptr(), 0]],
            "host_conv_state_pointers": conv,
            "host_rnn_state_pointers": rnn,
        }


# ---------------------------------------------------------------------------------- engine
@dataclasses.dataclass
class _Layout:
    """A step's sequences as the engine reads them from the bound tensors."""

    types: list[int]
    new: list[int]  # input tokens of each sequence this step
    kv_len: list[int]  # KV tokens of each sequence once this step's are written
    starts: list[int]  # each sequence's first packed token (and the end, last)
    slots: torch.Tensor
    positions: torch.Tensor


class PackedRecurrentGemma:
    """A packed-input RecurrentGemma forward over bufc's step tensors, with HF weights."""

    def __init__(self, hf_model: torch.nn.Module, memory: dict[int, torch.Tensor]) -> None:
        cfg = hf_model.config
        self.hf = hf_model
        self.model = hf_model.model
        self.layers = list(self.model.layers)
        self.attention = attention_layers(cfg)
        self.memory = memory
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.kernel, self.lru_width = cfg.conv1d_width, cfg.lru_width
        self.vocab_size, self.soft_cap = cfg.vocab_size, cfg.logits_soft_cap
        self.static: dict[str, torch.Tensor] | None = None

    def bind(self, static_inputs: Mapping[str, torch.Tensor]) -> None:
        """Bind the static engine inputs once (``buffers.static_inputs``)."""
        names = ["host_kv_cache_pool_pointers", "host_kv_cache_pool_mapping"]
        names += [
            f"{kind}_state_ptr_{i}"
            for i in range(len(self.layers))
            if i not in self.attention
            for kind in ("conv", "rnn")
        ]
        missing = [n for n in names if n not in static_inputs]
        if missing:
            raise ValueError(f"static inputs lack {', '.join(missing)}")
        self.static = dict(static_inputs)

    def _resolve(self, name: str, address: int) -> torch.Tensor:
        found = self.memory.get(address)
        if found is None:
            raise ValueError(f"{name} = {address:#x} is not the address of a pool")
        return found

    @torch.no_grad()
    def forward(
        self,
        inputs: Mapping[str, torch.Tensor],
        logits: torch.Tensor,
        static: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Run one step: `inputs` are ``step.inputs``, `logits` is ``step.outputs["logits"]``;
        `static` replaces the bound statics (a test's corrupted copy)."""
        static = static if static is not None else self.static
        assert static is not None, "bind(buffers.static_inputs) first"
        lay = self._layout(inputs)
        x = self.model.embed_tokens(inputs["input_ids"].long())
        x = x * self.model.normalizer.type(x.dtype)
        for i, layer in enumerate(self.layers):
            h = layer.temporal_pre_norm(x)
            if i in self.attention:
                a = self.attention.index(i)
                h = self._attention(layer.temporal_block, h, a, lay, inputs, static)
            else:
                conv = self._resolve(f"conv_state_ptr_{i}", int(static[f"conv_state_ptr_{i}"][0]))
                rnn = self._resolve(f"rnn_state_ptr_{i}", int(static[f"rnn_state_ptr_{i}"][0]))
                if lay.slots.numel() and int(lay.slots.max()) >= min(len(conv), len(rnn)):
                    raise ValueError(f"slot_mapping {lay.slots.tolist()} is beyond the state pools")
                h = self._recurrent(layer.temporal_block, h, lay, conv, rnn)
            residual = h + x
            x = layer.mlp_block(layer.channel_pre_norm(residual)) + residual
        x = self.model.final_norm(x)
        last = inputs["last_token_ids"].long() - 1  # 1-based index of each row's last token
        out = self.hf.lm_head(x[last])
        out = torch.tanh(out / self.soft_cap) * self.soft_cap
        logits[:, : self.vocab_size].copy_(out)

    def _layout(self, inputs: Mapping[str, torch.Tensor]) -> _Layout:
        types = inputs["host_request_types"].tolist()
        lengths = inputs["host_context_lengths"].tolist()
        past = inputs["host_past_key_value_lengths"].tolist()
        seq = inputs["sequence_length"].tolist()
        if any(t not in (CONTEXT, GENERATION) for t in types):
            raise ValueError(f"request types must be 0 or 1, got {types}")
        new = [n if t == CONTEXT else 1 for t, n in zip(types, lengths)]
        # a context row is a whole prompt: its KV is the prompt (the plugin's past KV length)
        kv_len = [p if t == CONTEXT else s for t, p, s in zip(types, past, seq)]
        if any(t == CONTEXT and p != n for t, p, n in zip(types, past, lengths)):
            raise ValueError(f"context rows must be whole prompts: past {past}, lengths {lengths}")
        starts = [0]
        for n in new:
            starts.append(starts[-1] + n)
        if starts[-1] != inputs["input_ids"].shape[0]:
            raise ValueError(f"the sequences cover {starts[-1]} tokens, the step packs others")
        slots = inputs["slot_mapping"].long()
        if len(set(slots.tolist())) != len(types):
            raise ValueError(f"slot_mapping {slots.tolist()} repeats a slot or lacks a row")
        return _Layout(types, new, kv_len, starts, slots, inputs["position_ids"].long())

    # ---------------------------------------------------------------------- attention
    def _attention(self, attn, h, a, lay: _Layout, inputs, static) -> torch.Tensor:
        """Attention layer `a` (its rank among the attention layers) over the paged pool."""
        pool_id, index = static["host_kv_cache_pool_mapping"][a].tolist()
        pool = self._resolve(
            f"host_kv_cache_pool_pointers[{pool_id}]",
            int(static["host_kv_cache_pool_pointers"][pool_id][0]),
        )
        window = int(inputs["host_max_attention_window_sizes"][a])
        offsets = inputs["kv_cache_block_offsets"][pool_id].long()  # [sequences, 2, blocks]
        tokens = h.shape[0]
        q = attn.q_proj(h).view(1, tokens, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(tokens, self.kv_heads, self.head_dim)
        cos, sin = attn.rotary_emb(v, lay.positions[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # [tokens, heads, head_dim]
        out = torch.empty_like(q)
        for i, (b0, b1) in enumerate(zip(lay.starts, lay.starts[1:])):
            length = lay.kv_len[i]
            kslab, vslab, cell = self._cells(pool, offsets[i], index, window, length)
            if lay.types[i] == CONTEXT:  # the fresh K/V; the cache keeps the last `window`
                keys, values = k[b0:b1], v[b0:b1]
                kept = slice(max(0, length - window), length)
                pool[kslab, cell] = keys[kept]
                pool[vslab, cell] = values[kept]
                query = torch.arange(length)[:, None]
                key = torch.arange(length)[None, :]
                visible = (key <= query) & (key > query - window)
            else:  # write the token at its cyclic cell, read the window back
                pool[kslab[-1], cell[-1]] = k[b0]
                pool[vslab[-1], cell[-1]] = v[b0]
                keys, values = pool[kslab, cell], pool[vslab, cell]
                visible = torch.ones(1, len(cell), dtype=torch.bool)
            group = self.heads // self.kv_heads
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[b0:b1], keys) * attn.scaling
            scores = scores.masked_fill(~visible, float("-inf"))
            out[b0:b1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        return attn.o_proj(out.reshape(tokens, -1))

    def _cells(self, pool, rows, index, window, length):
        """(K slab, V slab, cell) of the KV positions ``length - window .. length - 1`` (those
        still in the window) of one sequence; `rows` is its [2, blocks] offsets row."""
        tpb = pool.shape[1]
        p = torch.arange(max(0, length - window), length)
        where = p % window  # the cyclic KV cache
        column = where // tpb
        if len(p) and int(column.max()) >= rows.shape[1]:
            raise ValueError(f"a window of {window} tokens needs more than {rows.shape[1]} blocks")
        kslab = rows[0, column] + 2 * index
        vslab = rows[1, column] + 2 * index
        if len(p) and (
            min(kslab.min(), vslab.min()) < 0 or max(kslab.max(), vslab.max()) >= len(pool)
        ):
            raise ValueError(f"block offsets {rows.tolist()} (layer {index}) are outside the pool")
        return kslab, vslab, where % tpb

    # ---------------------------------------------------------------------- recurrent
    def _recurrent(self, block, h, lay: _Layout, conv_pool, rnn_pool) -> torch.Tensor:
        """HF's recurrent block over packed tokens: each context row from zero states (its
        slot's are overwritten), the generation rows (one token each) batched from theirs."""
        y = block.act_fn(block.linear_y(h))
        xb = block.linear_x(h)  # [tokens, lru_width]
        out = torch.empty_like(xb)
        weight, bias = block.conv_1d.weight, block.conv_1d.bias  # [lru, 1, kernel], [lru]
        gen = [i for i, t in enumerate(lay.types) if t == GENERATION]
        for i, t in enumerate(lay.types):
            if t != CONTEXT:
                continue
            b0, b1, slot = lay.starts[i], lay.starts[i + 1], int(lay.slots[i])
            zeros = xb.new_zeros(self.kernel - 1, self.lru_width)
            window = torch.cat([zeros, xb[b0:b1]])  # [kernel - 1 + n, lru]
            conv = F.conv1d(window.T[None], weight, bias, groups=self.lru_width)[0].T
            conv_pool[slot] = window[window.shape[0] - (self.kernel - 1) :]
            reset = lay.positions[b0:b1, None] == 0
            zero = rnn_pool.new_zeros(1, self.lru_width)
            o, state = self._rg_lru(block.rg_lru, conv[None], reset[None], zero)
            rnn_pool[slot] = state[0]
            out[b0:b1] = o[0]
        if gen:
            rows = torch.tensor([lay.starts[i] for i in gen])
            slots = lay.slots[gen]
            window = torch.cat([conv_pool[slots], xb[rows][:, None]], dim=1)  # [G, kernel, lru]
            conv = torch.sum(window.transpose(1, 2) * weight[:, 0, :], dim=-1) + bias
            conv_pool[slots] = window[:, 1:]
            reset = lay.positions[rows][:, None, None] == 0
            o, rnn_pool[slots] = self._rg_lru(block.rg_lru, conv[:, None], reset, rnn_pool[slots])
            out[rows] = o[:, 0]
        return block.linear_out(out * y)

    @staticmethod
    def _rg_lru(rg, x, reset, state):
        """HF's RG-LRU over S sequences of n tokens, x [S, n, lru], reset [S, n, 1], from
        `state` [S, lru] (float32); the recurrence in float32 as HF's ``_rnn_scan``. Returns
        the outputs [S, n, lru] and the new state."""
        s, n, width = x.shape
        act = x.reshape(s * n, rg.num_attention_heads, rg.block_width).permute(1, 0, 2)

        def gate(bias, w):
            res = torch.baddbmm(bias[:, None, :], act, w)
            return torch.sigmoid(res.transpose(0, 1).reshape(s, n, width))

        input_gate = gate(rg.input_gate_bias, rg.input_gate_weight)
        log_a = -8.0 * gate(rg.recurrent_gate_bias, rg.recurrent_gate_weight)
        log_a = log_a * F.softplus(rg.recurrent_param)
        a, a_square = torch.exp(log_a), torch.exp(2 * log_a)
        multiplier = torch.sqrt(1 - a_square)
        multiplier = reset + ~reset * multiplier
        normalized = x * input_gate * multiplier.type(x.dtype)
        a = a * ~reset
        out = torch.empty_like(x)
        for t in range(n):
            state = a[:, t].type(torch.float32) * state + normalized[:, t].type(torch.float32)
            out[:, t] = state.type(x.dtype)
        return out, state


# ----------------------------------------------------------------------------------- driver
@dataclasses.dataclass
class StepRecord:
    step: int
    kind: str  # "context" or "generation"
    rids: list[int]  # the request of each logit row
    slots: list[int]
    prompt_lengths: list[int]
    positions: list[int]  # the position whose next-token logits each row holds
    reused_slot: list[bool]  # the row's slot held an earlier request
    waiting: int  # arrived requests still waiting after this step's admissions
    wrapped: int  # generation rows whose KV positions wrapped around the cyclic cache
    logits: torch.Tensor  # [rows, vocab] float64, a copy
    seconds: float


@dataclasses.dataclass
class Served:
    tokens: dict[int, list[int]]
    token_steps: dict[int, list[int]]  # the step that produced each generated token
    prompts: dict[int, tuple[int, ...]]
    steps: list[StepRecord]
    slot_reuses: int = 0  # admissions into a slot an earlier request had used
    blocks_grown: int = 0  # KV blocks appended by generation steps


@dataclasses.dataclass(eq=False)
class _Flight:
    job: Job
    slot: int
    blocks: list[int]
    reused: bool
    generated: list[int] = dataclasses.field(default_factory=list)


# mutate(step index, inputs, statics): corrupts copies of the step's bound tensors
Mutation = Callable[[int, dict, dict], None]


class RecurrentGemmaDriver:
    def __init__(
        self,
        hf_model: torch.nn.Module,
        *,
        max_batch_size: int = 4,
        max_num_tokens: int = 64,
        tokens_per_block: int = 4,
        kv_blocks: int = 64,
    ) -> None:
        cfg = hf_model.config
        period = len(cfg.block_types)
        if cfg.block_types != ["recurrent"] * (period - 1) + ["attention"]:
            raise ValueError(f"blocks {cfg.block_types}: one attention layer per period, last")
        self.window = cfg.attention_window_size
        self.tokens_per_block = tokens_per_block
        self.max_blocks = -(-self.window // tokens_per_block)  # the cyclic cache's blocks
        self.config = recurrentgemma.Config(
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_hidden_layers,
            max_attention_window=self.window,
            tokens_per_block=tokens_per_block,
            num_kv_blocks=kv_blocks,
            attention_layer_period=period,
            logits_dtype=next(hf_model.parameters()).dtype,
        )
        self.storage = Storage(hf_model, max_batch_size, kv_blocks, tokens_per_block)
        self.allocator = BlockAllocator(kv_blocks)
        statics = self.storage.static_inputs(cfg.num_hidden_layers)
        self.buffers = recurrentgemma.RuntimeBuffers(self.config, static_inputs=statics)
        self.engine = PackedRecurrentGemma(hf_model, self.storage.memory)
        self.engine.bind(self.buffers.static_inputs)  # bound once, as an engine binds them

    def _admit(self, waiting: deque[Job], free: list[int], used: set[int], served: Served):
        """Waiting requests in arrival order, while slots are free and whole prompts fit the
        token budget: each `add`ed with the blocks of its prompt."""
        admitted = []
        for job, slot, reused in admit_whole_prompts(
            waiting, free, used, self.config.max_num_tokens
        ):
            served.slot_reuses += reused
            need = min(-(-len(job.prompt) // self.tokens_per_block), self.max_blocks)
            blocks = self.allocator.allocate(need)
            self.buffers.add(Request(seq_slot=slot, prompt=list(job.prompt), kv_block_ids=[blocks]))
            admitted.append(_Flight(job, slot, list(blocks), reused))
        return admitted

    def _grow(self, active: dict[int, _Flight], served: Served) -> dict[int, list[int]]:
        """The blocks each generation row needs for its token (at most the window's)."""
        grown = {}
        for f in active.values():
            after = len(f.job.prompt) + len(f.generated)  # KV tokens once the token is in
            need = min(-(-after // self.tokens_per_block), self.max_blocks)
            if need > len(f.blocks):
                grown[f.slot] = self.allocator.allocate(need - len(f.blocks))
                f.blocks += grown[f.slot]
                served.blocks_grown += len(grown[f.slot])
        return grown

    def run(
        self, jobs: Iterable[Job], *, mutate: Mutation | None = None, stop_after: int | None = None
    ) -> Served:
        """Serve `jobs` to completion (or through step `stop_after`). `mutate` may corrupt
        copies of a step's bound tensors before the engine reads them (the tests use it to
        prove the comparison can fail)."""
        c = self.config
        pending = whole_prompt_queue(jobs, c.max_num_tokens)
        served = Served(
            {j.rid: [] for j in pending},
            {j.rid: [] for j in pending},
            {j.rid: j.prompt for j in pending},
            [],
        )
        waiting: deque[Job] = deque()
        active: dict[int, _Flight] = {}
        free, used = list(range(c.max_batch_size)), set()
        tokens = np.zeros(c.max_batch_size, np.int64)  # what the last step sampled, by slot
        last_kind, index, produced = None, 0, False
        while pending or waiting or active:
            while pending and pending[0].arrival_step <= index:
                waiting.append(pending.popleft())
            admitted = []
            if waiting and free and (last_kind != "context" or not active):
                admitted = self._admit(waiting, free, used, served)
            if not admitted and not active:
                last_kind, index, produced = None, index + 1, False
                continue
            t0 = time.perf_counter()
            last = tokens if produced else None  # the tokens of the requests still in flight
            if admitted:  # whole prompts; the requests in flight sit out
                step = self.buffers.step(last, generation=False)
                active.update((f.slot, f) for f in admitted)
            else:
                step = self.buffers.step(last, blocks=self._grow(active, served))
            inputs, static = dict(step.inputs), self.engine.static
            if mutate is not None:
                inputs = {k: v.clone() for k, v in inputs.items()}
                static = {k: v.clone() for k, v in (static or {}).items()}
                mutate(index, inputs, static)
            self.engine.forward(inputs, step.outputs["logits"], static)
            slots = self.buffers.tensors["host_seq_slots"][: step.sizes.num_requests].tolist()
            rows = [active[s] for s in slots]
            logits = step.outputs["logits"][:, : c.vocab_size].detach().to("cpu", copy=True)
            served.steps.append(self._record(index, admitted, rows, logits, len(waiting)))
            for f, row in zip(rows, logits):
                token = int(row.argmax())
                tokens[f.slot] = token
                f.generated.append(token)
                served.tokens[f.job.rid].append(token)
                served.token_steps[f.job.rid].append(index)
                if len(f.generated) == f.job.max_new_tokens:
                    self.buffers.finish(f.slot)
                    self.allocator.release(f.blocks)
                    free.append(f.slot)
                    del active[f.slot]
            served.steps[-1].seconds = time.perf_counter() - t0
            produced = any(f.slot in active for f in rows)
            last_kind = "context" if admitted else "generation"
            if stop_after is not None and index >= stop_after:
                break
            index += 1
        return served

    def _record(self, index, admitted, rows: list[_Flight], logits, waiting) -> StepRecord:
        positions = [len(f.job.prompt) + len(f.generated) - 1 for f in rows]
        return StepRecord(
            step=index,
            kind="context" if admitted else "generation",
            rids=[f.job.rid for f in rows],
            slots=[f.slot for f in rows],
            prompt_lengths=[len(f.job.prompt) for f in rows],
            positions=positions,
            reused_slot=[f.reused for f in rows],
            waiting=waiting,
            wrapped=0 if admitted else sum(p >= self.window for p in positions),
            logits=logits,
            seconds=0.0,
        )


# ------------------------------------------------------------------------------- reference
def workload(
    n: int = 32, *, seed: int = 0, vocab_size: int = 256, window: int = 10, max_prompt: int = 30
) -> list[Job]:
    """`n` requests arriving over the first steps, prompts of 1 to `max_prompt` tokens (among
    them 1, the window, one past it, and the longest), each stopping after its own number of
    tokens (up to 16: decoding crosses the window); the last one, a 1-token prompt, arrives
    once every slot has been freed."""
    rng = random.Random(seed)
    fixed = [1, 2, window, window + 1, max_prompt]
    lengths = fixed + [rng.randint(1, max_prompt) for _ in range(n - len(fixed) - 1)] + [1]
    jobs = random_jobs(rng, lengths, vocab_size=vocab_size, new_tokens=(1, 16), last_arrival=2 * n)
    jobs[-1] = dataclasses.replace(jobs[-1], arrival_step=8 * n)
    return jobs


def reference_tokens(model: torch.nn.Module, jobs: Iterable[Job]) -> dict[int, list[int]]:
    """Each request alone through ``model.generate`` (greedy), from a fresh HF state.

    HF's recurrent blocks keep their convolution state on the module between ``generate``
    calls and re-create it only when it is None or of another batch size; a 1-token prompt
    takes the decoding path, so it would start from the previous call's state (transformers
    5.x). Clearing the module state first gives each request the zero state it starts from."""
    out = {}
    for job in jobs:
        for layer in model.model.layers:
            block = layer.temporal_block
            if hasattr(block, "conv1d_state"):
                block.conv1d_state = None
                block.rg_lru.recurrent_states = None
        out.update(compare.reference_tokens(model, [job]))
    return out


class Reference:
    """HF's float64 logits at every position of a request's sequence, memoised by request:
    a sequence that is a prefix of one already computed costs nothing (a mutated run repeats
    the clean run up to its mutation). The forward runs with HF's cache, as ``generate``'s
    prefill does (its RG-LRU state in float32 from the first token on)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.memo: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        self.forwards = 0

    @torch.no_grad()
    def logits(self, rid: int, sequence: tuple[int, ...]) -> torch.Tensor:
        hit = self.memo.get(rid)
        if hit is None or hit[0][: len(sequence)] != sequence:
            ids = torch.tensor([sequence])
            hit = (sequence, self.model(ids, use_cache=True).logits[0].to("cpu"))
            self.memo[rid] = hit
            self.forwards += 1
        return hit[1]


def assert_same_logits(served: Served, reference: Reference, tol: float = 1e-9) -> float:
    """Every logit row of every step against HF's logits for that request's sequence so far.
    Raises Mismatch on the earliest step with a row off by more than `tol`; returns the
    largest difference otherwise."""

    def want(rid: int, pos: int) -> torch.Tensor:
        prompt = served.prompts[rid]
        return reference.logits(rid, (*prompt, *served.tokens[rid][: pos + 1 - len(prompt)]))[pos]

    return assert_row_logits(served.steps, want, tol)


def check(
    reference: Reference, served: Served, tokens: dict[int, list[int]], tol: float = 1e-9
) -> float:
    """Logits (earliest failing step first), then tokens against `tokens` (generate's)."""
    worst = assert_same_logits(served, reference, tol)
    assert_same_tokens(served, tokens)  # type: ignore[arg-type]  # tokens, token_steps
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    threads_option(p)
    args = p.parse_args(argv)
    with torch_threads(args.threads):
        model = tiny_recurrentgemma(0)
        jobs = workload(32, seed=1, window=model.config.attention_window_size)
        t = time.perf_counter()
        served = RecurrentGemmaDriver(model).run(jobs)
        seconds = time.perf_counter() - t
        worst = check(Reference(model), served, reference_tokens(model, jobs))
    steps = served.steps
    print(
        f"{len(jobs)} requests, {len(steps)} steps "
        f"({sum(s.kind == 'context' for s in steps)} context), "
        f"{sum(map(len, served.tokens.values()))} tokens in {seconds:.2f} s, "
        f"{served.slot_reuses} slot reuses, {served.blocks_grown} blocks grown, "
        f"{sum(s.wrapped for s in steps)} rows past the window; torch threads {args.threads}"
    )
    print(f"all {len(jobs)} requests match transformers.generate; max logit diff {worst:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
