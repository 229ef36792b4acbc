"""An in-flight batching executor that takes every per-step tensor from ``bufc.generated.llama``.

Each step it admits the requests that have arrived (while decoder slots are free), gives every
generation request one token of the token budget, splits what is left over the pending prompts
in arrival order (chunked prefill: a chunk stops at the budget or at ``chunk_size``, wherever
that falls in a KV block), grows each request's KV blocks to cover this step's tokens, prepares
the step, runs the model and samples greedily. A request retires, freeing its blocks and slot,
after ``max_new_tokens`` tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from bufc.generated import gpt_pp, llama
from bufc.runtime import Request

from .llama import PackedLlama
from .paged_cache import BlockAllocator, PagedKVCache
from .parallel import Parallel


@dataclasses.dataclass(frozen=True)
class Job:
    """One request of a workload."""

    rid: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0


@dataclasses.dataclass
class StepStats:
    step: int
    in_flight: int
    context_requests: int
    generation_requests: int
    tokens: int
    prepare_s: float
    step_s: float
    finished: int  # requests retired so far


@dataclasses.dataclass
class Result:
    tokens: dict[int, list[int]]
    token_steps: dict[int, list[int]]  # the step that produced each generated token
    steps: list[StepStats]


@dataclasses.dataclass(eq=False)
class _Active:
    job: Job
    request: Request  # the bufc request, updated in place every step
    blocks: list[int]


class Executor:
    def __init__(
        self,
        hf_model: torch.nn.Module,
        *,
        max_batch_size: int = 16,
        token_budget: int = 256,
        chunk_size: int | None = None,
        tokens_per_block: int = 16,
        max_sequence_length: int = 1024,
        num_blocks: int | None = None,
        device: str = "cpu",
        bucketed_decode: bool = False,
        cuda_graphs: bool = False,
        parallel: Parallel | None = None,
    ) -> None:
        """`bucketed_decode` runs generation-only steps through the fixed-shape decode over a
        power-of-two batch bucket (the padding rows are the buffers' pad values);
        `cuda_graphs` also captures one CUDA graph per bucket and replays it. With `parallel`
        (a rank of a torch.distributed world, ``parallel.init``) this rank holds its pipeline
        stage's layers and its tensor-parallel share, and its buffers are the gpt_pp family's
        for its role; every rank runs the same schedule."""
        cfg = hf_model.config
        dtype = next(hf_model.parameters()).dtype
        par = self.parallel = parallel or Parallel()
        common = dict(
            max_batch_size=max_batch_size,
            max_num_tokens=token_budget,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_hidden_layers,
            max_attention_window=max_sequence_length,
            tokens_per_block=tokens_per_block,
            logits_dtype=dtype,
        )
        if par.distributed:
            self.config = gpt_pp.Config(
                **common,
                hidden_size=cfg.hidden_size,
                model_dtype=dtype,
                tp_size=par.tp_size,
                pp_size=par.pp_size,
                pp_rank=par.pp_rank,
            )
            self.buffers = gpt_pp.RuntimeBuffers(self.config, device=device)
        else:
            self.config = llama.Config(**common)
            self.buffers = llama.RuntimeBuffers(self.config, device=device)
        self.model = PackedLlama(hf_model, par, self.config.vocab_size_padded)
        blocks = (
            num_blocks or max_batch_size * self.config.max_blocks_per_seq + BlockAllocator.RESERVED
        )
        self.allocator = BlockAllocator(blocks)
        self.cache = PagedKVCache(
            blocks,
            self.model.num_layers,  # this stage's layers
            tokens_per_block,
            self.model.kv_heads,  # this rank's share of the heads
            self.model.head_dim,
            dtype,
            device,
        )
        self.chunk_size = chunk_size or token_budget
        self.token_budget = token_budget
        if par.distributed and (bucketed_decode or cuda_graphs):
            raise ValueError("bucketed decode and CUDA graphs run in one process")
        self.bucketed_decode = bucketed_decode or cuda_graphs
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def run(
        self,
        jobs: Iterable[Job],
        *,
        mutate: Callable[[int, object], None] | None = None,
        on_step: Callable[[StepStats], None] | None = None,
    ) -> Result:
        """Serve `jobs` to completion. `mutate(step_index, step)` may alter a prepared step
        before the model runs (the tests use it to prove the comparison can fail)."""
        pending = deque(sorted(jobs, key=lambda j: (j.arrival_step, j.rid)))
        waiting: deque[Job] = deque()
        active: list[_Active] = []
        free_slots = list(range(self.config.max_batch_size - 1, -1, -1))
        result = Result({j.rid: [] for j in pending}, {j.rid: [] for j in pending}, [])
        step_index = 0
        finished = 0
        last_generation: list[_Active] | None = None
        last_tokens: list[int] = []
        while pending or waiting or active:
            t0 = time.perf_counter()
            while pending and pending[0].arrival_step <= step_index:
                waiting.append(pending.popleft())
            while waiting and free_slots:
                job = waiting.popleft()
                req = Request(
                    seq_slot=free_slots.pop(),
                    prompt=list(job.prompt),
                    generated=[[]],
                    kv_block_ids=[[]],
                )
                active.append(_Active(job, req, req.kv_block_ids[0]))
            context, generation = self._schedule(active)
            if not context and not generation:
                last_generation = None
                step_index += 1
                continue
            t1 = time.perf_counter()
            if not context and generation == last_generation:
                # the same requests, one token longer each: the O(1)-Python decode step
                step = self.buffers.advance(last_tokens)
            else:
                step = self.buffers.prepare_step(
                    [a.request for a in context], [a.request for a in generation]
                )
            t2 = time.perf_counter()
            if mutate is not None:
                mutate(step_index, step)
            if self.bucketed_decode and not context:
                self._decode(step)
            else:
                self.model.forward(step, self.cache)
            sampled = self._sample(step)
            last_generation = generation if not context else None
            last_tokens = sampled
            for row, a in enumerate([*context, *generation]):
                req = a.request
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
                    finished += 1
            stats = StepStats(
                step=step_index,
                in_flight=len(context) + len(generation),
                context_requests=len(context),
                generation_requests=len(generation),
                tokens=step.sizes.num_tokens,
                prepare_s=t2 - t1,
                step_s=time.perf_counter() - t0,
                finished=finished,
            )
            result.steps.append(stats)
            if on_step is not None:
                on_step(stats)
            step_index += 1
        return result

    def _sample(self, step) -> list[int]:
        """Greedy tokens of the step's logit rows (over the real vocabulary, not its padding),
        from the last pipeline stage to every rank."""
        par = self.parallel
        if par.last_stage:
            tokens = step.outputs["logits"][:, : self.config.vocab_size].argmax(dim=-1)
        else:
            device = step.inputs["position_ids"].device
            tokens = torch.empty(step.sizes.num_logits, dtype=torch.int64, device=device)
        return par.share_tokens(tokens).tolist()

    def _decode(self, step) -> None:
        n = step.sizes.num_sequences
        bucket = min(1 << (n - 1).bit_length(), self.config.max_batch_size)
        sizes = step.sizes.generation_bucket(bucket)
        inputs, outputs = self.buffers.views(sizes)
        if not self.cuda_graphs:
            self.model.decode(inputs, outputs, self.cache)
            return
        graph = self.graphs.get(bucket)
        if graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up off the capture stream, as torch asks
                self.model.decode(inputs, outputs, self.cache)
            torch.cuda.current_stream().wait_stream(side)
            graph = self.graphs[bucket] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.model.decode(inputs, outputs, self.cache)
        graph.replay()

    def _schedule(self, active: list[_Active]) -> tuple[list[_Active], list[_Active]]:
        return schedule(active, self.token_budget, self.chunk_size, self._grow)

    def _grow(self, a: _Active, tokens: int) -> None:
        grow_blocks(a.blocks, tokens, self.config.tokens_per_block, self.allocator)


def schedule(
    active: list, token_budget: int, chunk_size: int, grow: Callable[[object, int], None]
) -> tuple[list, list]:
    """This step's context and generation requests among `active` (objects with a `request`):
    every generation request one token, then the pending prompts in order, each a chunk of at
    most `chunk_size`, while the token budget lasts. `grow(a, tokens)` makes a's KV blocks cover
    `tokens` tokens."""
    budget = token_budget
    generation = []
    for a in active:
        req = a.request
        if req.context_position == len(req.prompt) and budget > 0:
            grow(a, len(req.prompt) + len(req.generated[0]))
            generation.append(a)
            budget -= 1
    context = []
    for a in active:
        req = a.request
        remaining = len(req.prompt) - req.context_position
        if remaining == 0 or budget == 0:
            continue
        chunk = min(remaining, chunk_size, budget)
        grow(a, req.context_position + chunk)
        req.context_chunk_size = chunk
        context.append(a)
        budget -= chunk
    return context, generation


def grow_blocks(blocks: list[int], tokens: int, tokens_per_block: int, allocator) -> None:
    """Extend `blocks` (in place) from `allocator` until they cover `tokens` tokens."""
    need = -(-tokens // tokens_per_block) - len(blocks)
    if need > 0:
        blocks.extend(allocator.allocate(need))
