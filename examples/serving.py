"""Serving ``FastLlama`` in flight, with the sampled tokens left on the device (overlap).

``Server.run`` admits requests into free seq slots as they come, gives every generation request
one token and the waiting prompts chunks of what is left of the token budget, grows the KV blocks
each needs, and hands the step's changes to a `feeder`: ``BufcFeeder`` drives ``llama_flash``'s
buffers with ``add`` / ``finish`` / ``step`` (bench/serving.py has a plain torch feeder behind the
same four calls). Generation-only steps run ``FastLlama.decode`` at a power-of-two batch bucket
through a CUDA graph (the bucket's views keep their addresses, the padded rows hold the pad
values); other steps run eagerly. Sampling is greedy, on the device: the next step gathers the
tokens there, and the host reads them one step later from a pinned copy, so it prepares and
enqueues step t + 1 while the GPU still runs step t. A request finishes after its
``max_new_tokens``; its blocks and slot are free at once.

Per step the result keeps the host time of the feeder's call (preparation), the whole loop
iteration, and on CUDA the GPU time of the step and the GPU's idle time before it (events).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from bufc.generated import llama_flash
from bufc.runtime import Request

from .executor import Job
from .fast_llama import Batch, DecodeGraphs, FastKVCache, FastLlama
from .paged_cache import BlockAllocator


@dataclasses.dataclass
class Prepared:
    """A step as a feeder hands it to the engine: the batch at the step's shapes, the seq
    slot of each logit row, the logits buffer, and for a generation-only step the inputs and
    logits at a bucket (`bucket_inputs(rows)`)."""

    batch: Batch
    seq_slots: torch.Tensor
    logits: torch.Tensor
    rows: int  # logit rows (one per request: no drafts, one beam)
    generation_only: bool
    bucket_inputs: Callable[[int], tuple[dict[str, torch.Tensor], torch.Tensor]]


class Feeder(Protocol):
    """What the server asks of an input preparation (bufc's in-flight calls)."""

    name: str

    def add(self, slot: int, prompt: Sequence[int], blocks: list[int]) -> None: ...

    def finish(self, slot: int) -> None: ...

    def step(
        self, tokens: torch.Tensor | None, chunks: dict[int, int], blocks: dict[int, list[int]]
    ) -> Prepared: ...


class BufcFeeder:
    """llama_flash's buffers in flight, the sampled tokens gathered on the device."""

    name = "bufc"

    def __init__(self, config: llama_flash.Config, device: str | torch.device) -> None:
        self.config = config
        self.buffers = llama_flash.RuntimeBuffers(config, device=device, device_tokens=True)
        self.seq_slots = self.buffers.tensors["seq_slots"]
        self._buckets: dict[int, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}
        self._last: Any = None

    def add(self, slot: int, prompt: Sequence[int], blocks: list[int]) -> None:
        self.buffers.add(Request(seq_slot=slot, prompt=prompt, kv_block_ids=[blocks]))

    def finish(self, slot: int) -> None:
        self.buffers.finish(slot)

    def step(
        self, tokens: torch.Tensor | None, chunks: dict[int, int], blocks: dict[int, list[int]]
    ) -> Prepared:
        step = self.buffers.step(tokens, chunks=chunks, blocks=blocks)
        s, inp = step.sizes, step.inputs
        n_ctx = s.num_context_requests
        context_kv = int(inp["seq_lens_cpu"][:n_ctx].sum()) if n_ctx else 0
        batch = Batch(
            inp,
            n_ctx,
            s.num_context_tokens,
            context_kv,
            step.scalars["max_query_len"],
            step.scalars["max_seq_len"],
        )
        self._last = s
        return Prepared(
            batch,
            self.seq_slots,
            step.outputs["logits"],
            s.num_logits,
            n_ctx == 0,
            self._bucket,
        )

    def _bucket(self, rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The engine views at a generation bucket of `rows` (fixed addresses: made once)."""
        held = self._buckets.get(rows)
        if held is None:
            inputs, outputs = self.buffers.views(self._last.generation_bucket(rows))
            held = self._buckets[rows] = (inputs, outputs["logits"])
        return held


@dataclasses.dataclass
class StepRecord:
    context_requests: int
    generation_requests: int
    tokens: int
    kv_tokens: int  # KV positions the step's attention reads (its sequences' lengths)
    arrived: int
    finished: int
    graph: bool
    prepare_s: float  # the feeder's call
    host_s: float  # the whole loop iteration


@dataclasses.dataclass
class Served:
    tokens: dict[int, list[int]]
    steps: list[StepRecord]
    gpu_s: list[float] = dataclasses.field(default_factory=list)  # per step (CUDA)
    idle_s: list[float] = dataclasses.field(default_factory=list)  # before each step (CUDA)
    wall_s: list[float] = dataclasses.field(default_factory=list)  # per step, loop to loop


@dataclasses.dataclass(eq=False)
class _Flight:
    job: Job
    blocks: list[int]
    position: int = 0  # prompt tokens computed
    generated: int = 0


class Server:
    """FastLlama and its paged cache, served in flight through a feeder (module docstring)."""

    def __init__(
        self,
        engine: FastLlama,
        feeder: Feeder,
        *,
        max_batch_size: int,
        token_budget: int,
        chunk_size: int,
        tokens_per_block: int,
        num_blocks: int,
        graphs: bool = True,
    ) -> None:
        if token_budget < max_batch_size:
            raise ValueError("every generation request runs every step: budget >= batch size")
        self.engine, self.feeder = engine, feeder
        self.max_batch_size = max_batch_size
        self.token_budget, self.chunk_size = token_budget, chunk_size
        self.tpb = tokens_per_block
        self.allocator = BlockAllocator(num_blocks)
        self.cache = FastKVCache(
            num_blocks,
            engine.num_layers,
            tokens_per_block,
            engine.kv_heads,
            engine.head_dim,
            engine.dtype,
            engine.device,
        )
        self.graphs = DecodeGraphs(engine, self.cache, graphs)

    def bucket(self, rows: int) -> int:
        return min(1 << max(rows - 1, 0).bit_length(), self.max_batch_size)

    def run(
        self,
        jobs: Iterable[Job],
        *,
        max_steps: int | None = None,
        record: bool = True,
        on_step: Callable[[int, StepRecord], None] | None = None,
    ) -> Served:
        """Serve `jobs` (taken in order as slots free, from their arrival step on) until none
        is left, or for `max_steps` steps. `record` keeps every token (the host reads them
        either way, one step late)."""
        engine, feeder, device = self.engine, self.feeder, self.engine.device
        cuda = device.type == "cuda"
        incoming: Iterator[Job] = iter(jobs)
        ahead: deque[Job] = deque()
        free = list(range(self.max_batch_size - 1, -1, -1))
        prefilling: dict[int, _Flight] = {}  # in arrival order
        decoding: dict[int, _Flight] = {}
        served = Served({}, [])
        sampled = torch.zeros(self.max_batch_size, dtype=torch.int64, device=device)
        copies = [
            torch.zeros(self.max_batch_size, dtype=torch.int64, pin_memory=cuda) for _ in range(2)
        ]
        landed = [torch.cuda.Event() if cuda else None for _ in range(2)]
        events: list[tuple[Any, Any]] = []
        unread: tuple[int, list[tuple[int, int]]] | None = None
        produced_last = False
        step_index = parity = 0
        last_loop = time.perf_counter()
        exhausted = False

        def read(parity: int, producers: list[tuple[int, int]]) -> None:
            event = landed[parity]
            if event is not None:
                event.synchronize()
            if record:
                values = copies[parity].tolist()
                for rid, slot in producers:
                    served.tokens[rid].append(values[slot])

        while max_steps is None or step_index < max_steps:
            t0 = time.perf_counter()
            arrived = 0
            while free:  # admit what has arrived, while slots are free
                if not ahead and not exhausted:
                    nxt = next(incoming, None)
                    if nxt is None:
                        exhausted = True
                    else:
                        ahead.append(nxt)
                if not ahead or ahead[0].arrival_step > step_index:
                    break
                job = ahead.popleft()
                slot = free.pop()
                prefilling[slot] = _Flight(job, [])
                served.tokens.setdefault(job.rid, [])
                feeder.add(slot, job.prompt, [])
                arrived += 1
            if not prefilling and not decoding:
                if exhausted and not ahead:
                    break
                step_index += 1
                continue
            # the schedule: every generation request one token, prompts chunks of the rest
            budget = self.token_budget - len(decoding)
            chunks: dict[int, int] = {}
            for slot, a in prefilling.items():
                n = min(len(a.job.prompt) - a.position, self.chunk_size, budget)
                if n <= 0:
                    break
                chunks[slot] = n
                budget -= n
            blocks = self._grow(prefilling, decoding, chunks)
            tokens = sampled if produced_last else None
            t1 = time.perf_counter()
            prepared = feeder.step(tokens, chunks, blocks)
            t2 = time.perf_counter()
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            if start is not None:
                start.record()
            rows = prepared.rows
            if prepared.generation_only:
                bucket = self.bucket(rows)
                inputs, logits_buffer = prepared.bucket_inputs(bucket)
                logits = self.graphs.run(bucket, inputs, logits_buffer)
            else:
                logits = engine.forward(prepared.batch, self.cache, prepared.logits)
            sampled.index_copy_(0, prepared.seq_slots[:rows].long(), logits[:rows].argmax(dim=-1))
            parity ^= 1  # per step run (not step_index, which also counts idle steps)
            copies[parity].copy_(sampled, non_blocking=cuda)
            if cuda:
                landed[parity].record()  # type: ignore[union-attr]
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                events.append((start, end))
            # the counts move on now; the values are read when they land
            producers = [(a.job.rid, slot) for slot, a in decoding.items()]
            kv_tokens = sum(len(a.job.prompt) + a.generated for a in decoding.values())
            for a in decoding.values():
                a.generated += 1
            for slot, n in chunks.items():
                a = prefilling[slot]
                a.position += n
                kv_tokens += a.position
                if a.position == len(a.job.prompt):
                    a.generated = 1
                    producers.append((a.job.rid, slot))
                    decoding[slot] = prefilling.pop(slot)
            if unread is not None:  # the last step's tokens (model t runs meanwhile)
                read(*unread)
            unread = (parity, producers)
            finished = 0
            for _, slot in producers:
                a = decoding[slot]
                if a.generated == a.job.max_new_tokens:
                    del decoding[slot]
                    feeder.finish(slot)
                    self.allocator.release(a.blocks)
                    free.append(slot)
                    finished += 1
            produced_last = any(slot in decoding for _, slot in producers)
            now = time.perf_counter()
            rec = StepRecord(
                len(chunks),
                rows - len(chunks),
                prepared.batch.inputs["input_ids"].shape[0],
                kv_tokens,
                arrived,
                finished,
                prepared.generation_only and self.graphs.enabled,
                t2 - t1,
                now - t0,
            )
            served.steps.append(rec)
            served.wall_s.append(now - last_loop)
            last_loop = now
            if on_step is not None:
                on_step(step_index, rec)
            step_index += 1
        if unread is not None:
            read(*unread)
        if events:
            torch.cuda.synchronize()
            served.gpu_s = [a.elapsed_time(b) / 1e3 for a, b in events]
            served.idle_s = [0.0] + [
                b.elapsed_time(a) / 1e3 for (_, b), (a, _) in zip(events, events[1:])
            ]
        return served

    def _grow(
        self,
        prefilling: dict[int, _Flight],
        decoding: dict[int, _Flight],
        chunks: dict[int, int],
    ) -> dict[int, list[int]]:
        """The KV blocks each scheduled sequence needs for its tokens after the step,
        allocated now: {slot: the ids appended}."""
        tpb, grown = self.tpb, {}
        for slot, a in decoding.items():
            if (len(a.job.prompt) + a.generated + tpb - 1) // tpb > len(a.blocks):
                grown[slot] = self.allocator.allocate(1)
                a.blocks += grown[slot]
        for slot, n in chunks.items():
            a = prefilling[slot]
            need = (a.position + n + tpb - 1) // tpb - len(a.blocks)
            if need > 0:
                grown[slot] = self.allocator.allocate(need)
                a.blocks += grown[slot]
        return grown


def churn_jobs(
    batch: int, changes: int, prompt: int, vocab: int, seed: int = 0, steady: bool = False
) -> Iterator[Job]:
    """Traffic for `batch` slots: the first `batch` requests arrive at once with their tokens
    to generate spread over 1 .. batch // changes, so that about `changes` finish every step
    once they decode, and each that finishes is followed by a new one that generates
    batch // changes tokens (`steady`: none finishes, none follows). Endless: serve it for a
    number of steps."""
    rng = np.random.default_rng(seed)
    life = max(1, batch // max(changes, 1))
    rid = 0
    while True:
        if steady:
            new = 1 << 30
        elif rid < batch:
            new = 1 + rid * life // batch
        else:
            new = life
        yield Job(rid, tuple(rng.integers(0, vocab, prompt).tolist()), new)
        rid += 1
        if steady and rid == batch:
            return
