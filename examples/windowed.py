"""Qwen2 with sliding- and full-attention layers on TensorRT-LLM's KV pools, served in flight.

The engine reads only the engine inputs of a prepared step of the llama family built with
per-layer ``attention_windows``: ``input_ids``, ``position_ids``, ``host_request_types``,
``host_context_lengths``, ``host_past_key_value_lengths``, ``last_token_ids``,
``kv_cache_block_offsets`` (one row set per pool), and the static ``host_kv_cache_pool_mapping``
and ``host_max_attention_window_sizes``. Each pool is its own storage of ``layers in the pool *
2`` slabs per block; layer ``l`` finds its pool and its index in it in the mapping, its blocks in
that pool's rows of the offsets (K through the K row, V through the V row), and masks its keys by
its own window. The driver allocates blocks per window (one allocator each, as TensorRT-LLM keeps
one block manager per window), frees the blocks that left a sliding window while the request
runs (their ids stay in its list, as TensorRT-LLM's detached front blocks do), and drives the
buffers with add / finish / step, chunked prefill and slot reuse.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable

import torch
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from bufc.generated import llama, llama_flash
from bufc.runtime import Request

from .compare import float64_model
from .executor import Job, split_budget
from .flash_llama import FlashKVCache
from .paged_cache import BlockAllocator


def tiny_qwen2(
    seed: int = 0, *, window: int = 12, layers: int = 4, vocab_size: int = 256
) -> torch.nn.Module:
    """A small random Qwen2 in float64 whose layers alternate sliding (a `window`-token
    sliding window) and full attention (``layer_types``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.3,
        use_sliding_window=True,
        sliding_window=window,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        attn_implementation="sdpa",
    )
    return float64_model(Qwen2ForCausalLM, config, seed)


def layer_windows(model: torch.nn.Module, max_sequence_length: int) -> list[int]:
    """Each layer's attention window as TensorRT-LLM takes it (max_attention_window_vec)."""
    cfg = model.config
    return [
        cfg.sliding_window if kind == "sliding_attention" else max_sequence_length
        for kind in cfg.layer_types
    ]


class PooledKVCache:
    """The pools, one after another in one storage of ``[tokens_per_block, kv_heads,
    head_dim]`` slabs, as the KV manager allocates them: pool p is ``blocks * layers in p * 2``
    slabs from ``base[p]`` on; the offsets' K entry of a block is its first slab in its pool,
    and the layer's index in the pool adds ``2 * index``. An index past its pool lands in the
    next pool's memory, as it would on the device."""

    def __init__(
        self,
        blocks: int,
        pool_layers: tuple[int, ...],
        tokens_per_block: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.tokens_per_block = tokens_per_block
        sizes = [blocks * layers * 2 for layers in pool_layers]
        self.base = [sum(sizes[:p]) for p in range(len(sizes))]
        self.slabs = torch.zeros(sum(sizes), tokens_per_block, kv_heads, head_dim, dtype=dtype)


class PooledQwen2:
    def __init__(self, hf_model: torch.nn.Module) -> None:
        cfg = hf_model.config
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads

    @torch.no_grad()
    def forward(
        self, inputs: dict, mapping: torch.Tensor, windows: torch.Tensor, cache: PooledKVCache
    ) -> torch.Tensor:
        """The logits of the step's logit rows."""
        positions = inputs["position_ids"].long()
        types = inputs["host_request_types"].tolist()
        lengths = inputs["host_context_lengths"].tolist()
        past = inputs["host_past_key_value_lengths"].tolist()
        seq_len = [p if t == 0 else p + 1 for p, t in zip(past, types)]
        new = [n if t == 0 else 1 for t, n in zip(types, lengths)]
        starts = [0]
        for n in new:
            starts.append(starts[-1] + n)
        offsets = inputs["kv_cache_block_offsets"].long()  # [pools, sequences, 2, width]
        tpb = cache.tokens_per_block
        x = self.model.embed_tokens(inputs["input_ids"].long())
        cos, sin = self.model.rotary_emb(x[None], positions[None])
        group = self.num_heads // self.kv_heads
        for n, layer in enumerate(self.model.layers):
            pool, index = mapping[n].tolist()
            window = int(windows[n])
            slabs, base = cache.slabs, cache.base[pool] + 2 * index
            attn, tokens = layer.self_attn, x.shape[0]
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, tokens, self.num_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(tokens, self.kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)
            out = torch.zeros_like(q)
            for i, (a, b) in enumerate(zip(starts, starts[1:])):
                if a == b:  # a row a CUDA-graph bucket pads with: no tokens
                    continue
                rows = offsets[pool, i]  # [2, width]: K entries, V entries
                query = torch.arange(seq_len[i] - new[i], seq_len[i])
                kslab, vslab = rows[0, query // tpb] + base, rows[1, query // tpb] + base
                slabs[kslab, query % tpb] = k[a:b]
                slabs[vslab, query % tpb] = v[a:b]
                # the keys any of these queries sees: the window before the first, on
                first = max(0, int(query[0]) - window + 1)
                keys_at = torch.arange(first, seq_len[i])
                cols = keys_at // tpb
                keys = slabs[rows[0, cols] + base, keys_at % tpb]
                values = slabs[rows[1, cols] + base, keys_at % tpb]
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
                scores = torch.einsum("qhd,khd->hqk", q[a:b], keys) * self.head_dim**-0.5
                visible = (keys_at[None, :] <= query[:, None]) & (
                    keys_at[None, :] > query[:, None] - window
                )
                scores = scores.masked_fill(~visible, float("-inf"))
                out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
            x = x + attn.o_proj(out.reshape(tokens, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.model.norm(x)
        last = inputs["last_token_ids"].long() - 1
        return self.lm_head(x[last])


class GroupedQwen2:
    """The same model on the FlashAttention contract's KV-cache groups (``llama_flash`` with
    per-layer windows): layer l's K/V sit in its own vLLM-style pool, written through its
    group's row of ``group_slot_mappings`` and read through its group's
    ``group_block_tables``, its group being its window's (``attention_window_sizes``), and
    masked by that window; ``query_start_loc_cpu``, ``seq_lens_cpu``, ``positions`` and
    ``logits_indices`` as FlashLlama reads them."""

    def __init__(self, hf_model: torch.nn.Module, windows: list[int], groups: tuple[int, ...]):
        self.qwen = PooledQwen2(hf_model)
        self.windows = windows
        self.group = [groups.index(w) for w in windows]

    @torch.no_grad()
    def forward(self, inputs: dict, cache: FlashKVCache) -> torch.Tensor:
        q2 = self.qwen
        starts = inputs["query_start_loc_cpu"].tolist()
        lens = inputs["seq_lens_cpu"].tolist()
        tables, slots = inputs["group_block_tables"], inputs["group_slot_mappings"]
        x = q2.model.embed_tokens(inputs["input_ids"].long())
        cos, sin = q2.model.rotary_emb(x[None], inputs["positions"].long()[None])
        heads = q2.num_heads // q2.kv_heads
        for n, layer in enumerate(q2.model.layers):
            g, window = self.group[n], self.windows[n]
            attn, tokens = layer.self_attn, x.shape[0]
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, tokens, q2.num_heads, q2.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(1, tokens, q2.kv_heads, q2.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(tokens, q2.kv_heads, q2.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)
            cache.write(n, slots[g], k, v)
            out = torch.zeros_like(q)
            for i, (a, b) in enumerate(zip(starts, starts[1:])):
                length = lens[i]
                keys, values = cache.read(n, tables[g, i], length)
                keys = keys.repeat_interleave(heads, dim=1)
                values = values.repeat_interleave(heads, dim=1)
                scores = torch.einsum("qhd,khd->hqk", q[a:b], keys) * q2.head_dim**-0.5
                query = torch.arange(length - (b - a), length)[:, None]
                key = torch.arange(length)[None, :]
                scores = scores.masked_fill(~((key <= query) & (key > query - window)), -torch.inf)
                out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
            x = x + attn.o_proj(out.reshape(tokens, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = q2.model.norm(x[inputs["logits_indices"].long()])
        return q2.lm_head(x)


@dataclasses.dataclass(eq=False)
class _Flight:
    job: Job
    slot: int
    blocks: dict[int, list[int]]  # per window: every block of the sequence, from its start
    freed: dict[int, int]  # per window: the front blocks returned to the allocator
    position: int = 0  # prompt tokens computed
    generated: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Served:
    tokens: dict[int, list[int]]
    logits: dict[int, list[torch.Tensor]]  # the logit row each generated token was sampled from
    steps: int
    crossed: int  # chunks that started before a sliding window's span and ended after it
    reused_slots: int


def _grow(
    active: dict[int, _Flight],
    after: dict[int, int],
    allocators: dict[int, BlockAllocator],
    tokens_per_block: int,
) -> dict[int, dict[int, list[int]]]:
    """Every window's blocks cover each scheduled sequence's tokens after the step (`after`,
    per slot): the blocks allocated, per slot and window."""
    blocks: dict[int, dict[int, list[int]]] = {}
    for slot, n in after.items():
        need = -(-n // tokens_per_block)
        for w, allocator in allocators.items():
            held = active[slot].blocks[w]
            if need > len(held):
                new = allocator.allocate(need - len(held))
                held += new
                blocks.setdefault(slot, {})[w] = new
    return blocks


def _release_behind(
    a: _Flight, sliding: Iterable[int], allocators: dict[int, BlockAllocator], tpb: int
) -> None:
    """The blocks that left each sliding window (before the next query's window) go back
    to its allocator; their ids stay in the request's list."""
    nxt = a.position + max(0, len(a.generated) - 1)  # the next query's position
    for w in sliding:
        gone = max(0, (nxt - w + 1) // tpb)
        if gone > a.freed[w]:
            allocators[w].release(a.blocks[w][a.freed[w] : gone])
            a.freed[w] = gone


def _sample(
    active: dict[int, _Flight],
    rows: list[int],
    chunks: dict[int, int],
    logits: torch.Tensor,
    tokens: torch.Tensor,
    served: Served,
) -> list[int]:
    """Each row's greedy token, but a middle chunk's (its prompt position moves on): kept as
    the request's next input (`tokens[slot]`) and in `served`. Returns the slots sampled."""
    producers = []
    for row, slot in enumerate(rows):
        a = active[slot]
        if slot in chunks:
            a.position += chunks[slot]
            if a.position < len(a.job.prompt):
                continue  # a middle chunk: its row is not sampled
        token = int(logits[row].argmax())
        tokens[slot] = token
        producers.append(slot)
        a.generated.append(token)
        served.tokens[a.job.rid].append(token)
        served.logits[a.job.rid].append(logits[row].clone())
    return producers


def serve(
    model: torch.nn.Module,
    jobs: Iterable[Job],
    *,
    max_batch_size: int = 4,
    token_budget: int = 24,
    chunk_size: int = 7,
    tokens_per_block: int = 4,
    max_sequence_length: int = 128,
    blocks_per_window: int = 64,
    contract: str = "trtllm",
    mutate: Callable[[dict, dict], None] | None = None,
    bucket: bool = False,
) -> Served:
    """Serve `jobs` in flight (greedy) with the model's per-layer windows: on the llama
    family's KV pools (`contract` "trtllm") or llama_flash's KV-cache groups ("flash").
    `bucket`: every step is built at a CUDA-graph bucket of max_batch_size rows (and, on
    llama_flash, token_budget tokens; TensorRT-LLM's positions are per sequence, so there one
    token per padded row), and the model reads the padded views (padded rows have no tokens,
    padded tokens write no K/V).
    `mutate(inputs, statics)` may alter a step's inputs (copies of the static mapping and
    window sizes included) before the model runs."""
    windows = layer_windows(model, max_sequence_length)
    family = {"trtllm": llama, "flash": llama_flash}[contract]
    config = family.Config(
        max_batch_size=max_batch_size,
        max_num_tokens=token_budget,
        vocab_size=model.config.vocab_size,
        num_layers=len(windows),
        max_attention_window=max_sequence_length,
        tokens_per_block=tokens_per_block,
        attention_windows=windows,
        num_kv_blocks=blocks_per_window,
        logits_dtype=torch.float64,
    )
    buffers = family.RuntimeBuffers(config)
    sizes = config.attention_window_sizes
    allocators = {w: BlockAllocator(blocks_per_window) for w in sizes}
    engine = PooledQwen2(model)
    flash = GroupedQwen2(model, windows, sizes) if contract == "flash" else None
    per_block = (tokens_per_block, engine.kv_heads, engine.head_dim, torch.float64)
    cache: PooledKVCache | FlashKVCache
    if flash is None:  # TensorRT-LLM's pools: one per window and head count
        cache = PooledKVCache(blocks_per_window, config.kv_pool_layers, *per_block)
        statics = buffers.static_inputs
        windows_now = buffers.tensors["host_max_attention_window_sizes"]
    else:  # one FlashAttention cache of every layer
        cache = FlashKVCache(blocks_per_window, config.num_layers, *per_block, "cpu")
    pending = deque(sorted(jobs, key=lambda j: (j.arrival_step, j.rid)))
    waiting: deque[Job] = deque()
    active: dict[int, _Flight] = {}
    free_slots = list(range(max_batch_size - 1, -1, -1))
    used_slots: set[int] = set()
    served = Served({j.rid: [] for j in pending}, {j.rid: [] for j in pending}, 0, 0, 0)
    tokens = torch.zeros(max_batch_size, dtype=torch.int64)
    produced = False
    step_index = 0
    while pending or waiting or active:
        while pending and pending[0].arrival_step <= step_index:
            waiting.append(pending.popleft())
        while waiting and free_slots:
            job, slot = waiting.popleft(), free_slots.pop()
            served.reused_slots += slot in used_slots
            used_slots.add(slot)
            active[slot] = _Flight(job, slot, {w: [] for w in sizes}, dict.fromkeys(sizes, 0))
            buffers.add(Request(slot, list(job.prompt), kv_block_ids={w: [[]] for w in sizes}))
        generation = [a for a in active.values() if a.position == len(a.job.prompt)]
        left = [len(a.job.prompt) - a.position for a in active.values()]
        _, chunk_sizes = split_budget(token_budget, chunk_size, len(generation), left)
        chunks = {a.slot: n for a, n in zip(active.values(), chunk_sizes) if n}
        if not generation and not chunks:
            step_index += 1
            produced = False
            continue
        after = {a.slot: len(a.job.prompt) + len(a.generated) for a in generation}
        after.update((s, active[s].position + n) for s, n in chunks.items())
        blocks = _grow(active, after, allocators, tokens_per_block)
        for slot, n in chunks.items():
            begin = active[slot].position
            served.crossed += any(begin < w < begin + n for w in sizes[:-1])
        at = None
        if bucket:  # TensorRT-LLM's positions are per sequence: a token per padded row there
            rows, n = len(chunks) + len(generation), sum(chunks.values()) + len(generation)
            at = (token_budget if flash else n + max_batch_size - rows, max_batch_size)
        step = buffers.step(tokens if produced else None, chunks=chunks, blocks=blocks, bucket=at)
        inputs = dict(step.inputs)
        if mutate is not None:
            inputs = {k: v.clone() for k, v in inputs.items()}
        if flash is not None:
            if mutate is not None:
                mutate(inputs, {})
            logits = flash.forward(inputs, cache)  # type: ignore[arg-type]
        else:
            fixed = {"mapping": statics["host_kv_cache_pool_mapping"], "windows": windows_now}
            if mutate is not None:
                fixed = {k: v.clone() for k, v in fixed.items()}
                mutate(inputs, fixed)
            logits = engine.forward(
                inputs,
                fixed["mapping"],
                fixed["windows"],
                cache,  # type: ignore[arg-type]
            )
        rows = buffers.tensors["host_seq_slots"][: step.sizes.num_requests].tolist()
        producers = _sample(active, rows, chunks, logits, tokens, served)
        for slot in rows:
            _release_behind(active[slot], sizes[:-1], allocators, tokens_per_block)
        for slot in rows:
            a = active[slot]
            if len(a.generated) == a.job.max_new_tokens:
                buffers.finish(slot)
                for w in sizes:
                    allocators[w].release(a.blocks[w][a.freed[w] :])
                del active[slot]
                free_slots.append(slot)
        produced = any(slot in active for slot in producers)
        step_index += 1
    served.steps = step_index
    return served
