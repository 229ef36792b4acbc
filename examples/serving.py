"""Serving ``FastLlama`` in flight, with the sampled tokens left on the device (overlap).

``Server.run`` admits requests into free seq slots as they come, gives every generation request
one token and the waiting prompts chunks of what is left of the token budget, grows the KV blocks
each needs, and hands the step's changes to a `feeder`: ``BufcFeeder`` drives ``llama_flash``'s
buffers with ``add`` / ``finish`` / ``step`` (bench/serving.py has a plain torch feeder behind the
same four calls). A step runs ``FastLlama.step`` at a token and batch bucket through a CUDA graph
(the bucket's views keep their addresses, the padded rows hold the pad values), mixed steps of
chunked prefill and decode included; a step of more than `graph_tokens` tokens runs eagerly
(``FastLlama.forward``, FlashAttention for its prompt chunks). Sampling is greedy, on the device: the next step gathers the
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

from .executor import Job, gpu_times
from .fast_llama import Batch, FastLlama, StepGraphs
from .flash_llama import FlashKVCache
from .paged_cache import BlockAllocator


@dataclasses.dataclass
class Prepared:
    """A step as a feeder hands it to the engine: the batch at the step's shapes, the seq
    slot of each logit row, the logits buffer, and the inputs and logits padded to a bucket
    (`bucket_inputs(tokens, rows)`: fixed addresses per bucket)."""

    batch: Batch
    seq_slots: torch.Tensor
    logits: torch.Tensor
    rows: int  # logit rows (one per request: no drafts, one beam)
    bucket_inputs: Callable[[int, int], tuple[dict[str, torch.Tensor], torch.Tensor]]
    tokens: int | None = None  # the step's tokens, where `batch` is laid out at its bucket


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
        self._buckets: dict[tuple[int, int], tuple[dict[str, torch.Tensor], torch.Tensor]] = {}
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
            self._bucket,
        )

    def _bucket(self, tokens: int, rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The engine views at a bucket of `tokens` and `rows` (fixed addresses: made once;
        bufc keeps the rows past the step at their pads)."""
        held = self._buckets.get((tokens, rows))
        if held is None:
            inputs, outputs = self.buffers.views(self._last.padded(tokens, rows))
            held = self._buckets[tokens, rows] = (inputs, outputs["logits"])
        return held


class DeviceFeeder:
    """llama_flash's buffers built on the device (``build='device'``, ``host_inputs=False``):
    each step laid out at the bucket its CUDA graph runs (the server's ``bucket``, told
    before the step: ``bucketing``), the sampled tokens never read on the host. The feeder
    keeps each slot's prompt position, for the batch's host integers (context KV)."""

    name = "device"

    def __init__(self, config: llama_flash.Config, device: str | torch.device) -> None:
        config = dataclasses.replace(config, host_inputs=False)
        self.buffers = llama_flash.RuntimeBuffers(config, device=device, build="device")
        n = config.max_batch_size
        self.prompt_len, self.position = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.live = np.zeros(n, bool)
        self.bucketing: Callable[[int, int], tuple[int, int] | None] = lambda t, r: None

    def add(self, slot: int, prompt: Sequence[int], blocks: list[int]) -> None:
        self.buffers.add(Request(seq_slot=slot, prompt=prompt, kv_block_ids=[blocks]))
        self.prompt_len[slot], self.position[slot], self.live[slot] = len(prompt), 0, True

    def finish(self, slot: int) -> None:
        self.buffers.finish(slot)
        self.live[slot] = False

    def step(
        self, tokens: torch.Tensor | None, chunks: dict[int, int], blocks: dict[int, list[int]]
    ) -> Prepared:
        decoding = int(np.count_nonzero(self.live & (self.position == self.prompt_len)))
        context_tokens = sum(chunks.values())
        n = context_tokens + decoding
        bucket = self.bucketing(n, len(chunks) + decoding)
        step = self.buffers.step(tokens, chunks=chunks, blocks=blocks, bucket=bucket)
        s, inp = step.sizes, step.inputs
        context_kv = sum(int(self.position[slot]) + size for slot, size in chunks.items())
        for slot, size in chunks.items():
            self.position[slot] += size
        batch = Batch(
            inp,
            s.num_context_requests,
            s.num_context_tokens,
            context_kv,
            step.scalars["max_query_len"],
            step.scalars["max_seq_len"],
        )
        logits = step.outputs["logits"]
        return Prepared(
            batch, inp["row_slots"], logits, s.num_logits, lambda t, r: (inp, logits), n
        )


@dataclasses.dataclass
class StepRecord:
    context_requests: int
    generation_requests: int
    tokens: int
    kv_tokens: int  # KV positions the step's attention reads (its sequences' lengths)
    arrived: int
    finished: int
    graph: bool
    captured: bool  # the step's bucket was captured as a CUDA graph (a one-time cost)
    prepare_s: float  # the feeder's call
    host_s: float  # the whole loop iteration


@dataclasses.dataclass
class Served:
    tokens: dict[int, list[int]]
    steps: list[StepRecord]
    gpu_s: list[float] = dataclasses.field(default_factory=list)  # per step (CUDA)
    idle_s: list[float] = dataclasses.field(default_factory=list)  # before each step (CUDA)
    wall_s: list[float] = dataclasses.field(default_factory=list)  # per step, loop to loop


class _Slots:
    """The requests in flight, per seq slot (numpy columns, so that a step's bookkeeping is a
    few array operations whatever the batch): prompt length, prompt tokens computed, tokens
    generated, tokens to generate, request id; each slot's block ids (Python lists)."""

    def __init__(self, size: int) -> None:
        self.prompt_len = np.zeros(size, np.int64)
        self.position = np.zeros(size, np.int64)
        self.generated = np.zeros(size, np.int64)
        self.max_new = np.zeros(size, np.int64)
        self.rid = np.full(size, -1, np.int64)
        self.decoding = np.zeros(size, bool)
        self.blocks: list[list[int]] = [[] for _ in range(size)]
        self.held = np.zeros(size, np.int64)  # len(blocks[slot])
        self.prefilling: dict[int, Job] = {}  # slots in their context phase, arrival order


class _Arrivals:
    """The jobs not yet admitted, taken in order, each from its arrival step on."""

    def __init__(self, jobs: Iterable[Job]) -> None:
        self.incoming: Iterator[Job] = iter(jobs)
        self.ahead: deque[Job] = deque()
        self.exhausted = False

    def due(self, step: int) -> Job | None:
        """The next job, if it has arrived by `step`."""
        if not self.ahead and not self.exhausted:
            nxt = next(self.incoming, None)
            if nxt is None:
                self.exhausted = True
            else:
                self.ahead.append(nxt)
        if not self.ahead or self.ahead[0].arrival_step > step:
            return None
        return self.ahead.popleft()

    @property
    def done(self) -> bool:
        return self.exhausted and not self.ahead


def _advance(st: _Slots, decode: np.ndarray, chunks: dict[int, int]) -> tuple[int, list[int]]:
    """The counts move on once a step is enqueued (its token values are read when they
    land): each generation request one token longer, each chunk's prompt position on, a
    prompt whose last chunk ran decodes from now on. Returns the context rows' KV tokens
    after the step and the slots whose prompt completed."""
    st.generated[decode] += 1
    kv_tokens, completed = 0, []
    for slot, n in chunks.items():
        st.position[slot] += n
        kv_tokens += int(st.position[slot])
        if st.position[slot] == st.prompt_len[slot]:
            del st.prefilling[slot]
            st.generated[slot] = 1
            st.decoding[slot] = True
            completed.append(slot)
    return kv_tokens, completed


def _by_request(taken: list[tuple[np.ndarray, np.ndarray]]) -> dict[int, list[int]]:
    """Each request's tokens in step order, from the (request ids, tokens) read per step."""
    if not taken:
        return {}
    rids = np.concatenate([r for r, _ in taken])
    values = np.concatenate([v for _, v in taken])
    order = np.argsort(rids, kind="stable")
    rids, values = rids[order], values[order]
    cuts = np.flatnonzero(np.diff(rids)) + 1
    return {int(r[0]): v.tolist() for r, v in zip(np.split(rids, cuts), np.split(values, cuts))}


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
        graph_tokens: int | None = None,
    ) -> None:
        if token_budget < max_batch_size:
            raise ValueError("every generation request runs every step: budget >= batch size")
        self.engine, self.feeder = engine, feeder
        self.max_batch_size = max_batch_size
        self.token_budget, self.chunk_size = token_budget, chunk_size
        self.tpb = tokens_per_block
        self.allocator = BlockAllocator(num_blocks)
        self.cache = FlashKVCache(
            num_blocks,
            engine.num_layers,
            tokens_per_block,
            engine.kv_heads,
            engine.head_dim,
            engine.dtype,
            engine.device,
        )
        self.graphs = StepGraphs(engine, self.cache, graphs)
        self.graph_tokens = token_budget if graph_tokens is None else graph_tokens
        if hasattr(feeder, "bucketing"):  # it lays each step out at its bucket itself
            feeder.bucketing = self._graph_bucket

    def _graph_bucket(self, tokens: int, rows: int) -> tuple[int, int] | None:
        """The bucket a step of `tokens` and `rows` runs at (None: eagerly, unpadded)."""
        return self.bucket(tokens, rows) if tokens <= self.graph_tokens else None

    def bucket(self, tokens: int, rows: int) -> tuple[int, int]:
        """A step's (tokens, rows) bucket: powers of two, tokens past 256 in steps of 256
        (a graph per bucket, padding a mixed step by less than a chunk), within the budget and
        the batch."""
        t = 1 << max(tokens - 1, 0).bit_length() if tokens <= 256 else -(-tokens // 256) * 256
        r = 1 << max(rows - 1, 0).bit_length()
        return min(t, self.token_budget), min(r, self.max_batch_size)

    def run(
        self,
        jobs: Iterable[Job],
        *,
        max_steps: int | None = None,
        record: bool = True,
        on_step: Callable[[int, StepRecord], None] | None = None,
    ) -> Served:
        """Serve `jobs` (taken in order as slots free, from their arrival step on) until none
        is left, or for `max_steps` steps. The host reads each step's tokens one step late;
        `record` keeps them (`Served.tokens`)."""
        engine, feeder, device = self.engine, self.feeder, self.engine.device
        cuda = device.type == "cuda"
        arrivals = _Arrivals(jobs)
        free = list(range(self.max_batch_size - 1, -1, -1))
        st = _Slots(self.max_batch_size)
        served = Served({}, [])
        taken: list[tuple[np.ndarray, np.ndarray]] = []  # (request ids, tokens) per step
        sampled = torch.zeros(self.max_batch_size, dtype=torch.int64, device=device)
        copies = [
            torch.zeros(self.max_batch_size, dtype=torch.int64, pin_memory=cuda) for _ in range(2)
        ]
        landed = [torch.cuda.Event() if cuda else None for _ in range(2)]
        events: list[tuple[Any, Any]] = []
        unread: tuple[int, np.ndarray, np.ndarray] | None = None  # parity, slots, request ids
        produced_last = False
        step_index = parity = 0
        last_loop = time.perf_counter()

        def read(parity: int, slots: np.ndarray, rids: np.ndarray) -> None:
            event = landed[parity]
            if event is not None:
                event.synchronize()
            if record:
                taken.append((rids, copies[parity].numpy()[slots]))

        while max_steps is None or step_index < max_steps:
            t0 = time.perf_counter()
            arrived = 0
            # admit what has arrived, while slots are free
            while free and (job := arrivals.due(step_index)) is not None:
                slot = free.pop()
                st.prefilling[slot] = job
                st.prompt_len[slot], st.position[slot] = len(job.prompt), 0
                st.generated[slot], st.max_new[slot], st.rid[slot] = 0, job.max_new_tokens, job.rid
                feeder.add(slot, job.prompt, [])
                arrived += 1
            decode = np.flatnonzero(st.decoding)
            if not st.prefilling and not len(decode):
                if arrivals.done:
                    break
                step_index += 1
                continue
            chunks = self._schedule(st, len(decode))
            lengths = st.prompt_len[decode] + st.generated[decode]  # KV after the step
            blocks = self._grow(st, decode, lengths, chunks)
            tokens = sampled if produced_last else None
            t1 = time.perf_counter()
            prepared = feeder.step(tokens, chunks, blocks)
            t2 = time.perf_counter()
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            if start is not None:
                start.record()
            rows = prepared.rows
            n_tokens = prepared.tokens or prepared.batch.inputs["input_ids"].shape[0]
            graphed = n_tokens <= self.graph_tokens
            captured_before = len(self.graphs.graphs)
            if graphed:
                bucket = self.bucket(n_tokens, rows)
                inputs, logits_buffer = prepared.bucket_inputs(*bucket)
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
            kv_context, completed = _advance(st, decode, chunks)
            kv_tokens = int(lengths.sum()) + kv_context
            producers = (
                np.concatenate((decode, completed)).astype(np.int64) if completed else decode
            )
            if unread is not None:  # the last step's tokens (model t runs meanwhile)
                read(*unread)
            unread = (parity, producers, st.rid[producers])
            done = self._finish_done(st, producers, free)
            produced_last = done < len(producers)
            now = time.perf_counter()
            rec = StepRecord(
                len(chunks),
                rows - len(chunks),
                n_tokens,
                kv_tokens,
                arrived,
                done,
                graphed and self.graphs.enabled,
                len(self.graphs.graphs) > captured_before,
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
        served.tokens.update(_by_request(taken))
        if events:
            served.gpu_s, served.idle_s = gpu_times(events)
        return served

    def _finish_done(self, st: _Slots, producers: np.ndarray, free: list[int]) -> int:
        """The requests that produced their last token in this step leave: their blocks and
        slots are free at once. Returns how many left."""
        done = producers[st.generated[producers] == st.max_new[producers]].tolist()
        for slot in done:
            st.decoding[slot] = False
            self.feeder.finish(slot)
            self.allocator.release(st.blocks[slot])
            st.blocks[slot], st.held[slot] = [], 0
            free.append(slot)
        return len(done)

    def _schedule(self, st: _Slots, n_decode: int) -> dict[int, int]:
        """Every generation request one token, the waiting prompts (in arrival order) chunks
        of what is left of the token budget."""
        budget = self.token_budget - n_decode
        chunks: dict[int, int] = {}
        for slot in st.prefilling:
            n = min(int(st.prompt_len[slot] - st.position[slot]), self.chunk_size, budget)
            if n <= 0:
                break
            chunks[slot] = n
            budget -= n
        return chunks

    def _grow(
        self, st: _Slots, decode: np.ndarray, lengths: np.ndarray, chunks: dict[int, int]
    ) -> dict[int, list[int]]:
        """The KV blocks each scheduled sequence needs for its tokens after the step,
        allocated now: {slot: the ids appended}."""
        tpb, grown = self.tpb, {}
        for slot in decode[(lengths + tpb - 1) // tpb > st.held[decode]].tolist():
            grown[slot] = self.allocator.allocate(1)
        for slot, n in chunks.items():
            need = (int(st.position[slot]) + n + tpb - 1) // tpb - int(st.held[slot])
            if need > 0:
                grown[slot] = self.allocator.allocate(need)
        for slot, ids in grown.items():
            st.blocks[slot] += ids
            st.held[slot] += len(ids)
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
