"""Qwen2-VL on the generated ``qwen2_vl`` buffers: M-RoPE and image features as prompt tables.

TensorRT-LLM runs a Qwen2-VL request as a vision engine (image -> features) and an LLM engine
that takes the features as a prompt table. This example skips the vision tower: each request's
image features are random rows of the model dtype. What it proves is the LLM half, through the
buffers: a packed forward of the Hugging Face text model over a paged KV cache
(:class:`PackedQwen2VL`) that reads only the step's engine inputs, driven by an in-flight
batching executor (:class:`VLExecutor`: token budget, chunked prefill, mixed steps), whose
greedy tokens equal ``Qwen2VLForConditionalGeneration.generate`` and whose float64 logits equal
the Hugging Face forward, every logit row of every step (:func:`assert_matches_hf`).

Layouts (docs/spec.md, "Engine contract: Qwen2-VL (M-RoPE and image features)"):

* A prompt with images is, for Hugging Face, text ids with ``vision_start``,
  ``image_token_id`` x n, ``vision_end`` per image; for bufc the image tokens are
  ``vocab_size + 0 .. vocab_size + N - 1`` over all N image tokens of the request, in order
  (TensorRT-LLM's Qwen2-VL input processing), and ``Request.prompt_table`` is the request's
  ``[N, hidden_size]`` features. The engine reads token ``v >= vocab_size`` of a token whose
  task is ``t`` at row ``t * prompt_vocab_size + v - vocab_size`` of ``prompt_embedding_table``.
* ``Request.mrope_rotary_cos_sin`` (context phase): float32, ``max_position_embeddings *
  rotary_embedding_dim`` values laid out ``[max_position_embeddings, rotary_embedding_dim / 2,
  2]``: entry ``[p, j]`` is ``(cos, sin)`` of ``inv_freq[j] * P[s(j)][p]``, where ``P`` is
  ``get_rope_index``'s 3-D position (temporal, height, width) of prompt token ``p`` and ``s(j)``
  the M-RoPE section of frequency ``j`` (``mrope_section`` splits the ``rotary_embedding_dim / 2``
  frequencies); rows ``p >= len(prompt)`` hold position 0. TensorRT-LLM's Qwen2-VL runner builds
  the same (``mrope_position_ids_padding``, ``cos_ori[...]`` split by section, ``concat((cos,
  sin), -1)``); its attention kernel reads context token ``p`` of context sequence ``i`` at
  float2 ``i * max_positions * rotary_dim / 2 + p * rotary_dim / 2 + j``.
* ``Request.mrope_position_deltas`` (generation phase): ``get_rope_index``'s delta, ``max(P) +
  1 - len(prompt)``. A generation token of sequence length ``n`` sits at position ``n - 1 +
  delta`` in all three sections, rotated with the engine's own table (``rotary_cos_sin``,
  ``[max_position_embeddings, rotary_embedding_dim / 2, 2]`` of ``(cos, sin)`` of
  ``inv_freq[j] * p``), as TensorRT-LLM's generation kernel does (``tlength + delta``). The
  step's ``mrope_position_deltas`` holds generation request ``j``'s delta at row ``j``, counting
  generation requests only (TensorRT-LLM's plugin does not offset this pointer by the context
  sequences), then zeros.
* ``position_ids``: each token's index in its sequence; the engine checks they are the KV
  positions (a context token's row of its table; ``n - 1`` for a generation token).

Rotation is GPT-NeoX style (``rotate_half``: dimension ``j`` and ``j + rotary_dim / 2`` share
frequency ``j``), applied in the model dtype with cos/sin computed in float32, as the Hugging Face
model does.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch

from bufc.generated import qwen2_vl
from bufc.runtime import Request

from .compare import float64_model, threads_option, torch_threads
from .executor import grow_blocks, schedule
from .mrope import mrope_rotary_cos_sin, mrope_sections, rotary_cos_sin, rotate_half, text_config
from .paged_cache import BlockAllocator, PagedKVCache

SPATIAL_MERGE = 2  # Qwen2-VL merges 2 x 2 vision patches into one LLM token


# ----------------------------------------------------------------------------- the model
def tiny_qwen2_vl(
    seed: int = 0,
    *,
    vocab_size: int = 512,
    max_position_embeddings: int = 128,
    init_scale: float = 0.3,
) -> torch.nn.Module:
    """A small random ``Qwen2VLForConditionalGeneration`` in float64: 2 layers, hidden 64, two
    query heads of dimension 32 over one KV head, M-RoPE sections [4, 6, 6] (of the 16 rotary
    frequencies), a one-block vision tower that is never run. The special ids are the last four
    of the vocabulary (image, video, vision start, vision end)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=max_position_embeddings,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 6, 6]),
            initializer_range=init_scale,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
        ),
        vision_config=dict(
            depth=1,
            embed_dim=16,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            spatial_merge_size=SPATIAL_MERGE,
        ),
        image_token_id=vocab_size - 4,
        video_token_id=vocab_size - 3,
        vision_start_token_id=vocab_size - 2,
        vision_end_token_id=vocab_size - 1,
    )
    return float64_model(Qwen2VLForConditionalGeneration, config, seed)


def _head_dim(model: torch.nn.Module) -> int:
    cfg = text_config(model)
    return cfg.hidden_size // cfg.num_attention_heads


# ------------------------------------------------------------------------------ the requests
@dataclasses.dataclass(frozen=True, eq=False)
class VLJob:
    """One request: a prompt with images (Hugging Face ids, image placeholders included), the
    LLM grid (height, width, in merged tokens) of each image, and its features."""

    rid: int
    hf_ids: tuple[int, ...]
    grids: tuple[tuple[int, int], ...]
    features: torch.Tensor | None  # [image tokens, hidden_size], model dtype; None: no image
    max_new_tokens: int
    arrival_step: int = 0

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        """The vision grids in patches (temporal 1), as the processor gives them."""
        if not self.grids:
            return None
        return torch.tensor([[1, SPATIAL_MERGE * h, SPATIAL_MERGE * w] for h, w in self.grids])


def image_token_mask(model: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor(ids) == model.config.image_token_id


def bufc_prompt(model: torch.nn.Module, job: VLJob) -> list[int]:
    """The prompt bufc sees: image token k of the request (counting over all its images) is
    vocab_size + k, the row of its prompt table."""
    vocab, image = text_config(model).vocab_size, model.config.image_token_id
    out, k = [], 0
    for t in job.hf_ids:
        if t == image:
            out.append(vocab + k)
            k += 1
        else:
            out.append(t)
    return out


def rope_index(model: torch.nn.Module, job: VLJob) -> tuple[torch.Tensor, int]:
    """Hugging Face's M-RoPE positions ([3, prompt length]: temporal, height, width) and delta."""
    ids = torch.tensor([job.hf_ids])
    positions, deltas = model.model.get_rope_index(
        ids,
        mm_token_type_ids=image_token_mask(model, job.hf_ids)[None].int(),
        image_grid_thw=job.image_grid_thw,
    )
    return positions[:, 0], int(deltas[0, 0])


def vl_workload(
    model: torch.nn.Module,
    n: int = 8,
    *,
    seed: int = 0,
    max_images: int = 2,
    max_grid: int = 4,
    max_text: int = 12,
    max_new_tokens: int = 8,
    arrivals: int = 6,
) -> list[VLJob]:
    """`n` requests: text runs around 0 to `max_images` images (request 0 always has two, the
    last none), each an LLM grid of 1..`max_grid` x 1..`max_grid` tokens, random features
    (scale 1) and a random number of new tokens, arriving over the first `arrivals` steps."""
    cfg = model.config
    vocab, hidden = cfg.text_config.vocab_size, cfg.text_config.hidden_size
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    text_vocab = min(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id)

    def text(lo: int) -> list[int]:
        return [rng.randrange(1, text_vocab) for _ in range(rng.randint(lo, max_text))]

    jobs = []
    for rid in range(n):
        images = 2 if rid == 0 else 0 if rid == n - 1 else rng.randint(1, max_images)
        ids, grids = text(1), []
        for _ in range(images):
            h, w = rng.randint(1, max_grid), rng.randint(1, max_grid)
            if h * w == 1:
                w = 2
            grids.append((h, w))
            ids += [cfg.vision_start_token_id, *[cfg.image_token_id] * (h * w)]
            ids += [cfg.vision_end_token_id, *text(0)]
        tokens = sum(h * w for h, w in grids)
        features = (
            torch.randn(tokens, hidden, generator=gen, dtype=torch.float64) if grids else None
        )
        assert vocab > max(ids)
        jobs.append(
            VLJob(
                rid=rid,
                hf_ids=tuple(ids),
                grids=tuple(grids),
                features=features,
                max_new_tokens=rng.randint(1, max_new_tokens),
                arrival_step=0 if rid < 2 else rng.randint(0, arrivals),
            )
        )
    return jobs


# ------------------------------------------------------------------------------ the engine
class PackedQwen2VL:
    """The Qwen2-VL text model over packed tokens and a paged KV cache, reading only the step's
    engine inputs: input_ids, position_ids, host_request_types, host_context_lengths,
    sequence_length, host_past_key_value_lengths, last_token_ids, kv_cache_block_offsets,
    prompt_embedding_table, tasks, prompt_vocab_size, mrope_rotary_cos_sin and
    mrope_position_deltas; it writes step.outputs["logits"]. Weights, norms and MLP are the
    Hugging Face model's; embedding lookup, rotary, paging and attention are ours."""

    def __init__(self, hf_model: torch.nn.Module, max_position_embeddings: int) -> None:
        cfg = text_config(hf_model)
        self.text = hf_model.model.language_model
        self.layers = list(self.text.layers)
        self.lm_weight = hf_model.lm_head.weight
        self.vocab_size = cfg.vocab_size
        self.head_dim = _head_dim(hf_model)
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.num_layers = cfg.num_hidden_layers
        self.max_positions = max_position_embeddings
        # the engine's constant (TensorRT-LLM: rotary_inv_freq / the rotary cos-sin table)
        self.rotary_cos_sin = rotary_cos_sin(hf_model, max_position_embeddings)

    def _cos_sin(self, inp, types, starts, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [tokens, rotary_dim / 2] cos and sin of every packed token, indexed as
        TensorRT-LLM's attention plugin indexes them (neither pointer is offset by the context
        sequences): a context token at position p of context sequence i reads row p of
        mrope_rotary_cos_sin[i]; a generation token at position p of generation request j
        (counting generation requests only, from 0) reads row p + mrope_position_deltas[j] of
        the engine's table. This engine runs one beam per request."""
        half = self.head_dim // 2
        tables = inp["mrope_rotary_cos_sin"].view(-1, self.max_positions, half, 2)
        deltas = inp["mrope_position_deltas"][:, 0].long()
        num_context = types.count(0)
        tokens = positions.numel()
        cos_sin = torch.empty(tokens, half, 2, dtype=torch.float32, device=positions.device)
        for i, (a, b) in enumerate(zip(starts, starts[1:])):
            if a == b:
                continue
            if types[i] == 0:
                rows, table = positions[a:b], tables[i]
            else:
                delta = deltas[i - num_context]
                rows, table = positions[a:b] + delta, self.rotary_cos_sin
            if int(rows.min()) < 0 or int(rows.max()) >= self.max_positions:
                raise ValueError(
                    f"sequence {i}: rotary positions {rows.tolist()} outside "
                    f"[0, {self.max_positions})"
                )
            cos_sin[a:b] = table[rows]
        return cos_sin[..., 0], cos_sin[..., 1]

    def _embed(self, inp, dtype: torch.dtype) -> torch.Tensor:
        """Token v < vocab_size: the embedding row; v >= vocab_size: row tasks * prompt_vocab_size
        + v - vocab_size of the prompt embedding table."""
        ids = inp["input_ids"].long()
        image = ids >= self.vocab_size
        x = self.text.embed_tokens(ids.masked_fill(image, 0)).to(dtype)
        if bool(image.any()):
            rows = inp["tasks"].long()[image] * inp["prompt_vocab_size"].long()[0]
            rows = rows + ids[image] - self.vocab_size
            x[image] = inp["prompt_embedding_table"][rows].to(dtype)
        return x

    @torch.no_grad()
    def forward(self, step, cache: PagedKVCache) -> None:
        inp = step.inputs
        types = inp["host_request_types"].tolist()
        lengths = inp["host_context_lengths"].tolist()
        past = inp["host_past_key_value_lengths"].tolist()
        seq_len = inp["sequence_length"].cpu().tolist()
        positions = inp["position_ids"].long()
        offsets = inp["kv_cache_block_offsets"][0]
        tokens = step.sizes.num_tokens
        # tokens of each sequence this step: a context row's chunk, one per generation row
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
        for i, (a, b) in enumerate(zip(starts, starts[1:])):
            want_past = seq_len[i] if types[i] == 0 else seq_len[i] - 1
            if past[i] != want_past:
                raise ValueError(
                    f"sequence {i}: host_past_key_value_lengths {past[i]}, sequence_length "
                    f"{seq_len[i]}"
                )
            if not torch.equal(positions[a:b], kv_pos[i]):
                raise ValueError(
                    f"sequence {i}: position_ids {positions[a:b].tolist()} are not its KV "
                    f"positions {kv_pos[i].tolist()}"
                )
        slots = [cache.slots(offsets[i], kv_pos[i]) for i in range(len(new))]
        histories = [
            cache.slots(offsets[i], torch.arange(seq_len[i], device=device))
            for i in range(len(new))
        ]

        dtype = self.lm_weight.dtype
        x = self._embed(inp, dtype)
        cos, sin = self._cos_sin(inp, types, starts, positions)
        cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]  # [tokens, 1, head_dim]
        sin = torch.cat((sin, sin), dim=-1).to(dtype)[:, None, :]
        group = self.num_heads // self.kv_heads
        for layer_idx, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(tokens, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(tokens, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(tokens, self.kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
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
        x = self.text.norm(x)
        last = inp["last_token_ids"].long() - 1  # 1-based index of each logit row's last token
        logits = step.outputs["logits"]
        logits[:, : self.vocab_size] = x[last] @ self.lm_weight.T
        logits[:, self.vocab_size :] = 0


# ---------------------------------------------------------------------------- the executor
@dataclasses.dataclass(frozen=True)
class LogitRow:
    """One logit row of one step: request `rid`'s logits at sequence position `position`."""

    step: int
    rid: int
    kind: str  # "context" (a chunk's last token) or "generation"
    position: int
    logits: torch.Tensor


@dataclasses.dataclass
class VLStep:
    step: int
    context: list[tuple[int, int, int]]  # (rid, first prompt position, chunk) per context row
    generation: list[int]  # rid per generation row
    deltas: list[int]  # mrope delta per generation row
    image_tokens: list[int]  # image tokens in each context row's chunk
    chunks_ending_in_image: int  # context rows whose chunk ends between two image tokens


@dataclasses.dataclass
class VLResult:
    tokens: dict[int, list[int]]
    token_steps: dict[int, list[int]]
    logits: list[LogitRow]
    steps: list[VLStep]


@dataclasses.dataclass(eq=False)
class _Active:
    job: VLJob
    request: Request
    blocks: list[int]


class VLExecutor:
    """In-flight batching of VLJobs over the qwen2_vl buffers: each step every generation
    request takes one token of the budget, the rest goes to pending prompts in arrival order
    in chunks of at most `chunk_size` (chunks end wherever the budget falls, inside an image
    too); greedy sampling. Every step goes through prepare_step (the family has no advance
    form)."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        *,
        max_batch_size: int = 4,
        token_budget: int = 32,
        chunk_size: int | None = None,
        tokens_per_block: int = 4,
        max_sequence_length: int = 128,
        max_image_tokens: int = 32,
        device: str = "cpu",
    ) -> None:
        cfg = text_config(hf_model)
        dtype = next(hf_model.parameters()).dtype
        self.hf = hf_model
        max_positions = cfg.max_position_embeddings
        self.config = qwen2_vl.Config(
            max_batch_size=max_batch_size,
            max_num_tokens=token_budget,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            max_attention_window=max_sequence_length,
            tokens_per_block=tokens_per_block,
            model_dtype=dtype,
            logits_dtype=dtype,
            max_prompt_embedding_table_size=max_batch_size * max_image_tokens,
            max_position_embeddings=max_positions,
            rotary_embedding_dim=_head_dim(hf_model),
        )
        self.buffers = qwen2_vl.RuntimeBuffers(self.config, device=device)
        self.model = PackedQwen2VL(hf_model, max_positions)
        self.table = self.model.rotary_cos_sin
        self.sections = mrope_sections(hf_model)
        blocks = max_batch_size * self.config.max_blocks_per_seq + BlockAllocator.RESERVED
        self.allocator = BlockAllocator(blocks)
        self.cache = PagedKVCache.for_model(self.model, blocks, tokens_per_block, dtype, device)
        self.device = device
        self.chunk_size = chunk_size or token_budget
        self.token_budget = token_budget

    def request(self, job: VLJob, seq_slot: int) -> Request:
        """The bufc request of a job: prompt with image tokens vocab_size + k, its features as
        the prompt table, its M-RoPE table and delta from get_rope_index."""
        positions, delta = rope_index(self.hf, job)
        table = mrope_rotary_cos_sin(self.table, positions, self.sections).to(self.device)
        features = None if job.features is None else job.features.to(self.device)
        return Request(
            seq_slot=seq_slot,
            prompt=bufc_prompt(self.hf, job),
            generated=[[]],
            kv_block_ids=[[]],
            prompt_table=features,
            mrope_rotary_cos_sin=table,
            mrope_position_deltas=delta,
        )

    def run(
        self, jobs: Iterable[VLJob], *, mutate: Callable[[int, object], None] | None = None
    ) -> VLResult:
        """Serve `jobs` to completion. `mutate(step_index, step)` may alter a prepared step
        before the model runs (the tests use it to prove the comparison can fail)."""
        pending = deque(sorted(jobs, key=lambda j: (j.arrival_step, j.rid)))
        waiting: deque[VLJob] = deque()
        active: list[_Active] = []
        free_slots = list(range(self.config.max_batch_size - 1, -1, -1))
        result = VLResult({j.rid: [] for j in pending}, {j.rid: [] for j in pending}, [], [])
        vocab = self.config.vocab_size
        step_index = 0
        while pending or waiting or active:
            while pending and pending[0].arrival_step <= step_index:
                waiting.append(pending.popleft())
            while waiting and free_slots:
                job = waiting.popleft()
                req = self.request(job, free_slots.pop())
                active.append(_Active(job, req, req.kv_block_ids[0]))
            context, generation = self._schedule(active)
            if not context and not generation:
                step_index += 1
                continue
            step = self.buffers.prepare_step(
                [a.request for a in context], [a.request for a in generation]
            )
            info = VLStep(step_index, [], [a.job.rid for a in generation], [], [], 0)
            for a in context:
                r = a.request
                begin, end = r.context_position, r.context_position + r.context_chunk_size
                info.context.append((a.job.rid, begin, r.context_chunk_size))
                info.image_tokens.append(sum(t >= vocab for t in r.prompt[begin:end]))
                if end < len(r.prompt) and min(r.prompt[end - 1], r.prompt[end]) >= vocab:
                    info.chunks_ending_in_image += 1
            info.deltas = [a.request.mrope_position_deltas for a in generation]
            if mutate is not None:
                mutate(step_index, step)
            self.model.forward(step, self.cache)
            logits = step.outputs["logits"][:, :vocab]
            sampled = logits.argmax(dim=-1).tolist()
            for row, a in enumerate([*context, *generation]):
                req = a.request
                if row < len(context):
                    position = req.context_position + req.context_chunk_size - 1
                    kind = "context"
                else:
                    position = len(req.prompt) + len(req.generated[0]) - 1
                    kind = "generation"
                result.logits.append(
                    LogitRow(
                        step_index, a.job.rid, kind, position, logits[row].detach().cpu().clone()
                    )
                )
                if row < len(context):
                    req.context_position += req.context_chunk_size
                    req.context_chunk_size = None
                    if req.context_position < len(req.prompt):
                        continue  # a middle chunk: its logit row is not sampled
                req.generated[0].append(sampled[row])
                result.tokens[a.job.rid].append(sampled[row])
                result.token_steps[a.job.rid].append(step_index)
                if len(req.generated[0]) == a.job.max_new_tokens:
                    active.remove(a)
                    self.allocator.release(a.blocks)
                    free_slots.append(req.seq_slot)
            result.steps.append(info)
            step_index += 1
        return result

    def _schedule(self, active: list[_Active]) -> tuple[list[_Active], list[_Active]]:
        return schedule(active, self.token_budget, self.chunk_size, self._grow)

    def _grow(self, a: _Active, tokens: int) -> None:
        grow_blocks(a.blocks, tokens, self.config.tokens_per_block, self.allocator)


# ---------------------------------------------------------------------- the ground truth
def hf_generate(model: torch.nn.Module, job: VLJob) -> list[int]:
    """Hugging Face greedy generation of one request alone: ``generate`` with the image
    placeholders, image_grid_thw and the features as pre-encoded image outputs (the vision
    tower is not run; generate computes the M-RoPE positions and delta itself)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    ids = torch.tensor([job.hf_ids], device=model.device)
    kwargs = {}
    if job.grids:
        sizes = [h * w for h, w in job.grids]
        kwargs = dict(
            mm_token_type_ids=image_token_mask(model, job.hf_ids)[None].int().to(model.device),
            image_grid_thw=job.image_grid_thw.to(model.device),
            mm_encoder_outputs={
                "image": BaseModelOutputWithPooling(
                    pooler_output=list(job.features.to(model.device).split(sizes))
                )
            },
        )
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=job.max_new_tokens,
        **kwargs,
    )
    return out[0, len(job.hf_ids) :].tolist()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, job: VLJob, generated: Sequence[int]) -> torch.Tensor:
    """float64 logits [prompt + generated, vocab] of one Hugging Face forward over the request's
    prompt and `generated`: inputs_embeds with the image placeholders replaced by the features,
    position_ids from get_rope_index for the prompt and position + delta (all three sections)
    for the generated tokens."""
    ids = list(job.hf_ids) + list(generated)
    embeds = model.model.language_model.embed_tokens(torch.tensor([ids], device=model.device))
    mask = image_token_mask(model, ids).to(model.device)
    mask[len(job.hf_ids) :] = False  # a generated image_token_id is only a token
    if job.features is not None:
        embeds[0, mask] = job.features.to(model.device, embeds.dtype)
    positions, delta = rope_index(model, job)
    after = torch.arange(len(job.hf_ids), len(ids)) + delta
    position_ids = torch.cat((positions, after[None].expand(3, -1)), dim=1)[:, None, :]
    out = model(inputs_embeds=embeds, position_ids=position_ids.to(model.device))
    return out.logits[0].double().cpu()


class Mismatch(AssertionError):
    pass


def assert_matches_hf(
    result: VLResult,
    jobs: Sequence[VLJob],
    reference_tokens: dict[int, list[int]],
    reference_logits: dict[int, torch.Tensor],
    tol: float = 1e-9,
) -> float:
    """Every logit row of every step within `tol` of the Hugging Face forward's logits at that
    request and position, and every request's tokens equal to Hugging Face greedy generation.
    Raises on the earliest failing step (logits first), naming the request and the step;
    returns the largest difference."""
    worst = 0.0
    for row in sorted(result.logits, key=lambda r: r.step):
        want = reference_logits[row.rid]
        if row.position >= want.shape[0]:
            raise Mismatch(f"request {row.rid}: step {row.step} has a logit row past its tokens")
        diff = float((row.logits - want[row.position]).abs().max())
        if not diff <= tol:  # NaN fails too
            raise Mismatch(
                f"request {row.rid}, step {row.step} ({row.kind} row, position {row.position}): "
                f"max |logit - HF| = {diff:.3g} > {tol:g}"
            )
        worst = max(worst, diff)
    for job in jobs:
        got, want = result.tokens[job.rid], reference_tokens[job.rid]
        if got != want:
            k = next(
                (i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))
            )
            step = result.token_steps[job.rid][k] if k < len(got) else None
            raise Mismatch(
                f"request {job.rid} diverges at generated token {k} (step {step}): bufc gave "
                f"{got[k] if k < len(got) else None}, generate gave "
                f"{want[k] if k < len(want) else None}"
            )
    return worst


def reference(
    model: torch.nn.Module, jobs: Sequence[VLJob]
) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
    """Hugging Face greedy tokens of every job, and the float64 logits of its whole sequence."""
    tokens = {j.rid: hf_generate(model, j) for j in jobs}
    logits = {j.rid: hf_logits(model, j, tokens[j.rid]) for j in jobs}
    return tokens, logits


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - a manual demo
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    threads_option(p)
    args = p.parse_args(argv)
    with torch_threads(args.threads):
        _main(args.threads)


def _main(threads: int) -> None:  # pragma: no cover - a manual demo
    model = tiny_qwen2_vl()
    jobs = vl_workload(model, 8, seed=1)
    result = VLExecutor(model, token_budget=24, chunk_size=7).run(jobs)
    tokens, logits = reference(model, jobs)
    worst = assert_matches_hf(result, jobs, tokens, logits)
    mixed = sum(1 for s in result.steps if s.context and s.generation)
    inside = sum(s.chunks_ending_in_image for s in result.steps)
    print(
        f"{len(jobs)} requests, {len(result.steps)} steps ({mixed} mixed), {inside} chunks ending "
        f"inside an image; tokens equal generate, max |logit - HF| = {worst:.2e}; torch "
        f"intra-op threads {threads}"
    )


if __name__ == "__main__":  # pragma: no cover
    main()
