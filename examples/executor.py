"""An in-flight batching executor that takes every per-step tensor from ``bufc.generated.llama``.

Each step it admits the requests that have arrived (while decoder slots are free), gives every
generation request one token of the token budget, splits what is left over the pending prompts
in arrival order (chunked prefill: a chunk stops at the budget or at ``chunk_size``, wherever
that falls in a KV block), grows each request's KV blocks to cover this step's tokens, prepares
the step, runs the model and samples greedily. A request retires, freeing its blocks and slot,
after ``max_new_tokens`` tokens.

With ``in_flight`` the executor drives the buffers the way a serving loop does: ``add`` on
arrival, ``finish`` on retirement and ``step`` with what changed (the chunks, the blocks added,
the tokens the last step sampled, by seq slot). With ``overlap`` too, the sampled tokens stay on
the device: the next step gathers them there, and the host reads them (for the results) one step
later from a pinned copy, so it prepares and enqueues step t + 1 while the GPU still runs step t.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from bufc.generated import gpt_pp, llama, llama_flash, llama_flashinfer
from bufc.runtime import Request

from .flash_llama import FlashKVCache, FlashLlama
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
    # on CUDA: each step's GPU time (its model and sampling) and the GPU's idle time before it
    # (from the end of the last step's work to the start of this step's model), in seconds
    gpu_s: list[float] = dataclasses.field(default_factory=list)
    idle_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class _Flight:
    """A request in flight, as the in-flight executor tracks it: counts only (the tokens may
    still be on the device)."""

    job: Job
    slot: int
    blocks: list[int]
    position: int = 0  # prompt tokens computed
    generated: int = 0


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
        in_flight: bool = False,
        overlap: bool = False,
        contract: str = "trtllm",
        attention: str = "packed",
    ) -> None:
        """`bucketed_decode` runs generation-only steps through the fixed-shape decode over a
        power-of-two batch bucket (the padding rows are the buffers' pad values);
        `cuda_graphs` also captures one CUDA graph per bucket and replays it. With `parallel`
        (a rank of a torch.distributed world, ``parallel.init``) this rank holds its pipeline
        stage's layers and its tensor-parallel share, and its buffers are the gpt_pp family's
        for its role; every rank runs the same schedule. `in_flight` drives the buffers with
        add/finish/step, `overlap` also keeps the sampled tokens on the device (module
        docstring); generation-only steps then run the fixed-shape decode. `contract`:
        "trtllm" feeds the packed model from the llama family (TensorRT-LLM's inputs), "flash"
        feeds FlashLlama from the llama_flash family (the FlashAttention/vLLM inputs), with
        its `attention` ("packed", or "varlen": torch's FlashAttention on CUDA), and
        "flashinfer" from the llama_flashinfer family (FlashInfer's paged-KV arrays)."""
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
        families = {"flash": llama_flash, "flashinfer": llama_flashinfer}
        if contract not in ("trtllm", *families):
            raise ValueError(f"contract is 'trtllm', 'flash' or 'flashinfer', got {contract!r}")
        self.flash = contract in families
        if self.flash and par.distributed:
            raise ValueError("the flash contracts run in one process")
        if contract == "flashinfer" and (bucketed_decode or cuda_graphs):
            raise ValueError("the fixed-shape decode reads llama_flash's block_table")
        if self.flash:
            family = families[contract]
            self.config = family.Config(**common)
            self.buffers = family.RuntimeBuffers(
                self.config, device=device, device_tokens=overlap or None
            )
        elif par.distributed:
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
            self.buffers = llama.RuntimeBuffers(
                self.config, device=device, device_tokens=overlap or None
            )
        blocks = (
            num_blocks or max_batch_size * self.config.max_blocks_per_seq + BlockAllocator.RESERVED
        )
        self.allocator = BlockAllocator(blocks)
        self.model: PackedLlama | FlashLlama
        self.cache: PagedKVCache | FlashKVCache
        if self.flash:
            self.model = FlashLlama(hf_model, attention)
            self.cache = FlashKVCache(
                blocks,
                self.model.num_layers,
                tokens_per_block,
                self.model.kv_heads,
                self.model.head_dim,
                dtype,
                device,
            )
        else:
            self.model = PackedLlama(hf_model, par, self.config.vocab_size_padded)
            # this stage's layers, this rank's share of the heads
            self.cache = PagedKVCache.for_model(self.model, blocks, tokens_per_block, dtype, device)
        self.chunk_size = chunk_size or token_budget
        self.token_budget = token_budget
        if par.distributed and (bucketed_decode or cuda_graphs):
            raise ValueError("bucketed decode and CUDA graphs run in one process")
        self.bucketed_decode = bucketed_decode or cuda_graphs
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.in_flight = in_flight or overlap
        self.overlap = overlap
        if self.in_flight and (par.distributed or self.bucketed_decode):
            raise ValueError("the in-flight executor runs in one process, without buckets")
        if self.in_flight and token_budget < max_batch_size:
            raise ValueError(
                "in flight every generation request runs every step: token_budget must be at "
                "least max_batch_size"
            )
        self.device = torch.device(device)

    def run(
        self,
        jobs: Iterable[Job],
        *,
        mutate: Callable[[int, object], None] | None = None,
        on_step: Callable[[StepStats], None] | None = None,
    ) -> Result:
        """Serve `jobs` to completion. `mutate(step_index, step)` may alter a prepared step
        before the model runs (the tests use it to prove the comparison can fail)."""
        if self.in_flight:
            return self._run_in_flight(jobs, mutate, on_step)
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
            if not context and generation == last_generation and not self.flash:
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
            _done(
                result,
                on_step,
                step_index,
                len(context),
                len(generation),
                step,
                t2 - t1,
                t0,
                finished,
            )
            step_index += 1
        return result

    def _flight_schedule(self, active: dict[int, _Flight]) -> tuple[list[_Flight], dict[int, int]]:
        """The step's schedule: every generation request one token (the budget covers them
        all), then prompt chunks in arrival order ({slot: tokens})."""
        generation = [a for a in active.values() if a.position == len(a.job.prompt)]
        left = [len(a.job.prompt) - a.position for a in active.values()]
        _, sizes = split_budget(self.token_budget, self.chunk_size, len(generation), left)
        return generation, {a.slot: n for a, n in zip(active.values(), sizes) if n}

    def _grow_blocks(
        self, active: dict[int, _Flight], generation: list[_Flight], chunks: dict[int, int]
    ) -> dict[int, list[int]]:
        """The KV blocks each scheduled sequence needs for its tokens after the step, allocated
        now; returns the blocks appended per slot (step(blocks=...))."""
        grown = {a.slot: len(a.job.prompt) + a.generated for a in generation}
        grown.update((slot, active[slot].position + n) for slot, n in chunks.items())
        blocks = {}
        for slot, tokens in grown.items():
            before = len(active[slot].blocks)
            grow_blocks(active[slot].blocks, tokens, self.config.tokens_per_block, self.allocator)
            if len(active[slot].blocks) > before:
                blocks[slot] = active[slot].blocks[before:]
        return blocks

    def _run_in_flight(
        self,
        jobs: Iterable[Job],
        mutate: Callable[[int, object], None] | None,
        on_step: Callable[[StepStats], None] | None,
    ) -> Result:
        buffers, mbs = self.buffers, self.config.max_batch_size
        cuda = self.device.type == "cuda"
        pending = deque(sorted(jobs, key=lambda j: (j.arrival_step, j.rid)))
        waiting: deque[Job] = deque()
        active: dict[int, _Flight] = {}  # by seq slot, in arrival order
        free_slots = list(range(mbs - 1, -1, -1))
        result = Result({j.rid: [] for j in pending}, {j.rid: [] for j in pending}, [])
        # what each slot sampled in the last step, on the device; a pinned copy per step parity
        # (read one step later with overlap, at once without)
        sampled = torch.zeros(mbs, dtype=torch.int64, device=self.device)
        copies = [torch.zeros(mbs, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        landed = [torch.cuda.Event() if cuda else None for _ in range(2)]
        seq_slots = buffers.tensors["seq_slots"]  # the device tensor (a fixed address)
        unread: tuple[int, int, list[tuple[int, int]]] | None = None  # (parity, step, producers)
        produced_last = False  # a request still in flight sampled a token in the last step
        parity = 0
        timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        step_index = finished = 0

        def read(parity: int, at: int, producers: list[tuple[int, int]]) -> None:
            event = landed[parity]
            if event is not None:
                event.synchronize()
            values = copies[parity].tolist()
            for rid, slot in producers:
                result.tokens[rid].append(values[slot])
                result.token_steps[rid].append(at)

        while pending or waiting or active:
            t0 = time.perf_counter()
            while pending and pending[0].arrival_step <= step_index:
                waiting.append(pending.popleft())
            while waiting and free_slots:
                job = waiting.popleft()
                slot = free_slots.pop()
                active[slot] = _Flight(job, slot, [])
                buffers.add(Request(seq_slot=slot, prompt=list(job.prompt), kv_block_ids=[[]]))
            generation, chunks = self._flight_schedule(active)
            if not chunks and not generation:
                step_index += 1
                continue
            blocks = self._grow_blocks(active, generation, chunks)
            t1 = time.perf_counter()
            if not produced_last:
                tokens = None
            elif self.overlap:
                tokens = sampled
            else:
                tokens = copies[parity].numpy()
            step = buffers.step(tokens, chunks=chunks, blocks=blocks)
            t2 = time.perf_counter()
            if mutate is not None:
                mutate(step_index, step)
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            if start is not None:
                start.record()
            if chunks or self.flash:
                self.model.forward(step, self.cache)
            else:
                self.model.decode(step.inputs, step.outputs, self.cache)
            rows = step.sizes.num_logits
            logits = step.outputs["logits"][:, : self.config.vocab_size]
            sampled.index_copy_(0, seq_slots[:rows].long(), logits.argmax(dim=-1))
            parity ^= 1  # per step run: step_index also counts idle steps
            copies[parity].copy_(sampled, non_blocking=cuda)
            event = landed[parity]
            if event is not None:
                event.record()
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                timings.append((start, end))
            # the counts move on now; the token values are read when they land
            producers = _count_step(active, generation, chunks)
            if unread is not None:  # the last step's tokens (with overlap: model t runs now)
                read(*unread)
                unread = None
            if self.overlap:
                unread = (parity, step_index, producers)
            else:
                read(parity, step_index, producers)
            for _, slot in producers:
                a = active[slot]
                if a.generated == a.job.max_new_tokens:
                    del active[slot]
                    buffers.finish(slot)
                    self.allocator.release(a.blocks)
                    free_slots.append(slot)
                    finished += 1
            produced_last = any(slot in active for _, slot in producers)
            _done(
                result,
                on_step,
                step_index,
                len(chunks),
                len(generation),
                step,
                t2 - t1,
                t0,
                finished,
            )
            step_index += 1
        if unread is not None:
            read(*unread)
        if timings:
            result.gpu_s, result.idle_s = gpu_times(timings)
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


def gpu_times(events: list[tuple[Any, Any]]) -> tuple[list[float], list[float]]:
    """Each step's GPU time from its (start, end) CUDA events, and the GPU's idle time before
    it (from the last step's end; 0 for the first), in seconds (waits for the device)."""
    torch.cuda.synchronize()
    gpu = [a.elapsed_time(b) / 1e3 for a, b in events]
    idle = [0.0] + [b.elapsed_time(a) / 1e3 for (_, b), (a, _) in zip(events, events[1:])]
    return gpu, idle


def _done(
    result: Result,
    on_step: Callable[[StepStats], None] | None,
    index: int,
    n_ctx: int,
    n_gen: int,
    step,
    prepare_s: float,
    start: float,
    finished: int,
) -> None:
    """A step ran: its figures into `result` and to `on_step`."""
    stats = StepStats(
        step=index,
        in_flight=n_ctx + n_gen,
        context_requests=n_ctx,
        generation_requests=n_gen,
        tokens=step.sizes.num_tokens,
        prepare_s=prepare_s,
        step_s=time.perf_counter() - start,
        finished=finished,
    )
    result.steps.append(stats)
    if on_step is not None:
        on_step(stats)


def schedule(
    active: list, token_budget: int, chunk_size: int, grow: Callable[[object, int], None]
) -> tuple[list, list]:
    """This step's context and generation requests among `active` (objects with a `request`):
    every generation request one token, then the pending prompts in order, each a chunk of at
    most `chunk_size`, while the token budget lasts. `grow(a, tokens)` makes a's KV blocks cover
    `tokens` tokens."""
    decoding = [a for a in active if a.request.context_position == len(a.request.prompt)]
    left = [len(a.request.prompt) - a.request.context_position for a in active]
    served, chunks = split_budget(token_budget, chunk_size, len(decoding), left)
    generation = decoding[:served]
    for a in generation:
        grow(a, len(a.request.prompt) + len(a.request.generated[0]))
    context = []
    for a, chunk in zip(active, chunks):
        if chunk:
            grow(a, a.request.context_position + chunk)
            a.request.context_chunk_size = chunk
            context.append(a)
    return context, generation


def split_budget(
    token_budget: int, chunk_size: int, decoding: int, left: list[int]
) -> tuple[int, list[int]]:
    """A step's token budget: one token for each of `decoding` generation requests while it
    lasts (how many get one), then, in order, a chunk of each prompt with `left[i]` tokens still
    to compute (0: it waits), at most `chunk_size`."""
    served = min(decoding, token_budget)
    budget = token_budget - served
    chunks = []
    for remaining in left:
        chunk = min(remaining, chunk_size, budget)
        chunks.append(chunk)
        budget -= chunk
    return served, chunks


def whole_prompt_queue(jobs: Iterable[Job], max_num_tokens: int) -> deque[Job]:
    """`jobs` in arrival order (by step, then id), each checked to fit one context step: a
    prompt of 1 to `max_num_tokens` tokens (whole prompts only) and max_new_tokens >= 1."""
    pending = deque(sorted(jobs, key=lambda j: (j.arrival_step, j.rid)))
    for job in pending:
        if not 1 <= len(job.prompt) <= max_num_tokens or job.max_new_tokens < 1:
            raise ValueError(
                f"request {job.rid}: a prompt of 1 to max_num_tokens={max_num_tokens} "
                f"tokens (whole prompts only) and max_new_tokens >= 1, got "
                f"{len(job.prompt)} and {job.max_new_tokens}"
            )
    return pending


def admit_whole_prompts(
    waiting: deque[Job], free: list[int], used: set[int], budget: int
) -> list[tuple[Job, int, bool]]:
    """A context step's admissions: waiting requests in arrival order while a slot is free and
    their whole prompts fit the token `budget`, each into the lowest free slot. Takes them off
    `waiting` and their slots off `free` (into `used`); returns (job, slot, whether an earlier
    request had used the slot) of each."""
    admitted = []
    while waiting and free and len(waiting[0].prompt) <= budget:
        job = waiting.popleft()
        free.sort()
        slot = free.pop(0)
        admitted.append((job, slot, slot in used))
        used.add(slot)
        budget -= len(job.prompt)
    return admitted


def grow_blocks(blocks: list[int], tokens: int, tokens_per_block: int, allocator) -> None:
    """Extend `blocks` (in place) from `allocator` until they cover `tokens` tokens."""
    need = -(-tokens // tokens_per_block) - len(blocks)
    if need > 0:
        blocks.extend(allocator.allocate(need))


def _count_step(
    active: dict[int, _Flight], generation: list[_Flight], chunks: dict[int, int]
) -> list[tuple[int, int]]:
    """Moves each scheduled request's counts past the step; returns (rid, slot) of those that
    produced a token (the generation requests and the prompts the step finished)."""
    producers = [(a.job.rid, a.slot) for a in generation]
    for a in generation:
        a.generated += 1
    for slot, chunk in chunks.items():
        a = active[slot]
        a.position += chunk
        if a.position == len(a.job.prompt):
            a.generated += 1
            producers.append((a.job.rid, slot))
    return producers
