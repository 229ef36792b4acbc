"""Beam search on a real model: an in-flight batching engine over the llama buffers' cache
indirection, checked against ``transformers.generate(num_beams=W)``.

Engine contract (docs/spec.md, "Engine contract: beam search"):

* ``cache_indirection`` is bound as TensorRT-LLM's runtime binds it, [max_batch_size, step
  beam width, max_attention_window], the step's width being its widest generation request's
  (the attention plugin reads the width from this dimension). Generation request i of the step (i counts generation requests only,
  in scheduled order) has its beams at rows [i, 0..beam_width-1, :];
  ``cache_indirection[i, k, t]`` is the beam whose KV beam k reads at past position t. Here the
  entry of the step's own token (t = sequence_length - 1) is k itself, and every prompt position
  reads beam 0, which the context step wrote.
* The decoder keeps its own indirection buffer [slots, max_beam_width, window] indexed by
  seq_slot. Before the step it copies per ``cache_indirection_copies`` (not an engine input:
  the buffers' tensor, read as [3, num_generation_requests]: src, dst, size in elements, flat
  offsets into the decoder buffer and into the engine's cache_indirection). After sampling it
  updates its own buffer in the region each request's ``cache_indirection_decoder_copies``
  entry names (src == dst, size beam_width * window): beam k's new row is its parent's row up
  to the step's token, then k at the new token's position.
* Paged KV: each beam has its own block list in ``kv_block_ids``. The beams share the prompt's
  full blocks (the same ids); the block holding the prompt's tail is beam 0's (the context step
  writes the prompt KV once, through the first list), and every other beam gets its own block
  there, whose prompt slots are never read because the prompt positions read beam 0. A beam's
  KV never moves: beam k writes the KV of its step token into its own blocks, and a reordering
  of beams is only a new indirection. Attention of beam k at past position t reads the KV of
  beam ``cache_indirection[i, k, t]`` at t, through that beam's row of kv_cache_block_offsets.
* Requests of beam width 2 and 4 under max_beam_width 4 are mixed in one workload, context
  and generation requests in the same steps, prompts in chunks. A context request is one
  sequence and one logit row; its last chunk's row starts the request's beam search.

Which generation sequence is beam k of request i: requests of different widths in one step are
bufc's mixed-width extension (TensorRT-LLM's runtime refuses them): the step's
``host_beam_widths`` input gives the width of each generation request, its sequences are
consecutive rows, and its beams sit at rows [i, 0..width-1] of the step-width
cache_indirection.

The decoder (``BeamSearch``) is transformers' ``GenerationMixin._beam_search`` (5.x) for one
request: float32 log-softmax of the logits, the top 2W continuations, the W best unfinished ones
kept, finished hypotheses merged with the length penalty, early stopping, with no EOS token:
a request ends after ``max_new_tokens`` tokens and returns its W best beams with their scores.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch

from bufc.generated import llama
from bufc.runtime import Request

from .beam_search import BeamSearch
from .compare import Mismatch
from .executor import Job, StepStats, grow_blocks
from .llama import PackedLlama
from .paged_cache import BlockAllocator, PagedKVCache


@dataclasses.dataclass(frozen=True)
class BeamJob(Job):
    """One beam-search request: `beam_width` beams, all returned, scored with
    `length_penalty` (transformers' sequences_scores)."""

    beam_width: int = 2
    length_penalty: float = 1.0


# ------------------------------------------------------------------------------ the engine
class BeamLlama(PackedLlama):
    """PackedLlama whose attention reads the past through ``cache_indirection``."""

    @torch.no_grad()
    def forward(self, step, cache: PagedKVCache) -> None:
        if self.par.distributed:
            raise NotImplementedError("the beam-search engine runs in one process")
        inp = step.inputs
        beam_widths = inp["host_beam_widths"].tolist()  # one per generation request
        positions = inp["position_ids"].long()
        types = inp["host_request_types"].tolist()
        lengths = inp["host_context_lengths"].tolist()
        seq_len = inp["sequence_length"].cpu().tolist()
        offsets = inp["kv_cache_block_offsets"][0]  # [sequences, K/V, max_blocks_per_seq]
        indirection = inp["cache_indirection"]  # [max_batch_size, step beam width, window]
        tokens, n_ctx = step.sizes.num_tokens, step.sizes.num_context_requests
        new = [n if t == 0 else 1 for t, n in zip(types, lengths)]
        if sum(new) != tokens:
            raise ValueError(f"context lengths cover {sum(new)} tokens, the step packs {tokens}")
        if n_ctx + sum(beam_widths) != len(types):
            raise ValueError(
                f"{len(types) - n_ctx} generation sequences, beam widths {list(beam_widths)}"
            )
        device, tpb = positions.device, cache.tokens_per_block
        window = indirection.shape[-1]
        # the row of kv_cache_block_offsets whose blocks hold each past position of each
        # sequence: its own for a context request, the indirection's beam for a generation beam
        owner = [torch.full((seq_len[i],), i, device=device) for i in range(n_ctx)]
        first = n_ctx
        for g, width in enumerate(beam_widths):
            for k in range(width):
                n = seq_len[first + k]
                if not 0 < n <= window:
                    raise ValueError(f"sequence {first + k}: length {n} outside 1 .. {window}")
                beams = indirection[g, k, :n].long()
                if ((beams < 0) | (beams >= width)).any():
                    t = int(torch.nonzero((beams < 0) | (beams >= width))[0])
                    raise ValueError(
                        f"cache_indirection[{g}, {k}, {t}] = {int(beams[t])} is not a beam of "
                        f"generation request {g} (beam width {width})"
                    )
                owner.append(first + beams)
            first += width
        starts = [0]
        for n in new:
            starts.append(starts[-1] + n)
        kv_pos = [torch.arange(n - m, n, device=device) for n, m in zip(seq_len, new)]
        writes = [(offsets[j, 0, p // tpb].long(), p % tpb) for j, p in enumerate(kv_pos)]
        histories = []
        for rows in owner:
            t = torch.arange(len(rows), device=device)
            histories.append((offsets[rows, 0, t // tpb].long(), t % tpb))

        x = self.model.embed_tokens(inp["input_ids"].long())
        cos, sin = self.model.rotary_emb(x[None], positions[None])
        group = self.num_heads // self.kv_heads
        for layer_idx, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            out = torch.empty_like(q)
            for j, (a, b) in enumerate(zip(starts, starts[1:])):
                cache.write(layer_idx, *writes[j], k[a:b], v[a:b])
                keys, values = cache.read(layer_idx, *histories[j])
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
                scores = torch.einsum("qhd,khd->hqk", q[a:b], keys) * self.head_dim**-0.5
                causal = kv_pos[j][:, None] >= torch.arange(seq_len[j], device=device)[None, :]
                scores = scores.masked_fill(~causal, float("-inf"))
                out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
            x = x + layer.self_attn.o_proj(out.reshape(tokens, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.model.norm(x)
        last = inp["last_token_ids"].long() - 1
        step.outputs["logits"].copy_(x[last] @ self.lm_weight.T)


# ---------------------------------------------------------------------------- the executor
@dataclasses.dataclass(frozen=True)
class LogitRecord:
    """The logits one beam got in one step, and the tokens it had read (prompt + beam)."""

    step: int
    beam: int
    tokens: tuple[int, ...]
    logits: torch.Tensor  # float64 [vocab]


@dataclasses.dataclass
class BeamResult:
    beams: dict[int, list[list[int]]]  # per request, its returned beams' generated tokens
    scores: dict[int, list[float]]  # their sequences_scores
    beam_indices: dict[int, list[list[int]]]
    log_probs: dict[int, list[torch.Tensor]]  # each step's [W, vocab] float32 log-softmax
    logits: dict[int, list[LogitRecord]]
    steps: list[StepStats]
    advanced: int = 0  # steps prepared by advance()
    reordered: int = 0  # beams whose parent was another beam slot


@dataclasses.dataclass(eq=False)
class _Active:
    job: BeamJob
    request: Request
    search: BeamSearch
    shared: int = 0  # prompt blocks every beam's list shares (the prompt's full blocks)


Mutate = Callable[[int, object, torch.Tensor], None]


def _admitted(job: BeamJob, slot: int) -> _Active:
    """A job taking seq slot `slot`: its request (one empty generated and block list per
    beam) and its beam search."""
    w = job.beam_width
    req = Request(
        seq_slot=slot,
        prompt=list(job.prompt),
        beam_width=w,
        generated=[[] for _ in range(w)],
        kv_block_ids=[[] for _ in range(w)],
    )
    return _Active(job, req, BeamSearch(job.prompt, w, job.max_new_tokens, job.length_penalty))


class BeamExecutor:
    def __init__(
        self,
        hf_model: torch.nn.Module,
        *,
        max_batch_size: int = 8,
        max_beam_width: int = 4,
        token_budget: int = 64,
        chunk_size: int | None = None,
        tokens_per_block: int = 4,
        max_sequence_length: int = 128,
        device: str = "cpu",
    ) -> None:
        cfg = hf_model.config
        dtype = next(hf_model.parameters()).dtype
        self.config = llama.Config(
            max_batch_size=max_batch_size,
            max_beam_width=max_beam_width,
            max_num_tokens=token_budget,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_hidden_layers,
            max_attention_window=max_sequence_length,
            tokens_per_block=tokens_per_block,
            logits_dtype=dtype,
        )
        self.buffers = llama.RuntimeBuffers(self.config, device=device)
        self.model = BeamLlama(hf_model)
        c = self.config
        blocks = max_batch_size * max_beam_width * c.max_blocks_per_seq + BlockAllocator.RESERVED
        self.allocator = BlockAllocator(blocks)
        self.cache = PagedKVCache.for_model(self.model, blocks, tokens_per_block, dtype, device)
        self.chunk_size = chunk_size or token_budget
        self.token_budget = token_budget
        window = c.max_attention_window
        # the decoder's cache indirection, [slots, max_beam_width, window], by seq_slot
        self.indirection = torch.zeros(
            (max_batch_size, max_beam_width, window), dtype=torch.int32, device=device
        )
        tensors = self.buffers.tensors  # capacity views of storage that never moves
        self._copies = tensors["cache_indirection_copies"].view(-1)
        self._decoder_copies = tensors["cache_indirection_decoder_copies"].view(-1)

    def run(
        self,
        jobs: Iterable[BeamJob],
        *,
        mutate: Mutate | None = None,
        on_step: Callable[[StepStats], None] | None = None,
    ) -> BeamResult:
        """Serve `jobs` to completion. `mutate(step_index, step, copies)` may alter a prepared
        step (or the [3, num_generation_requests] view of cache_indirection_copies) before the
        indirection is copied and the model runs; the tests use it to prove the checks fail."""
        c = self.config
        pending = deque(sorted(jobs, key=lambda j: (j.arrival_step, j.rid)))
        for j in pending:
            if len(j.prompt) + j.max_new_tokens > c.max_attention_window:
                raise ValueError(f"request {j.rid} does not fit max_attention_window")
            if not 1 <= j.beam_width <= min(c.max_beam_width, self.token_budget):
                raise ValueError(f"request {j.rid}: beam width {j.beam_width} cannot be scheduled")
        result = BeamResult({}, {}, {}, {}, {j.rid: [] for j in pending}, [])
        waiting: deque[BeamJob] = deque()
        active: list[_Active] = []
        free_slots = list(range(c.max_batch_size - 1, -1, -1))
        step_index = finished = 0
        last_generation: list[_Active] | None = None
        last_tokens: list[int] = []
        while pending or waiting or active:
            t0 = time.perf_counter()
            while pending and pending[0].arrival_step <= step_index:
                waiting.append(pending.popleft())
            while waiting and free_slots:
                active.append(_admitted(waiting.popleft(), free_slots.pop()))
            context, generation = self._schedule(active)
            if not context and not generation:
                last_generation = None
                step_index += 1
                continue
            t1 = time.perf_counter()
            if not context and generation == last_generation:
                step = self.buffers.advance(last_tokens)  # each beam one token longer
                result.advanced += 1
            else:
                step = self.buffers.prepare_step(
                    [a.request for a in context], [a.request for a in generation]
                )
            t2 = time.perf_counter()
            n_gen = step.sizes.num_generation_requests
            copies = self._copies[: 3 * n_gen].view(3, n_gen)
            if mutate is not None:
                mutate(step_index, step, copies)
            self._copy_indirection(step, copies)
            self.model.forward(step, self.cache)
            logits = step.outputs["logits"][:, : c.vocab_size]
            regions = self._decoder_copies[: 3 * step.sizes.num_requests].view(3, -1)
            sampled: list[_Active] = []  # the requests whose rows were sampled
            row = 0
            for i, a in enumerate(context):
                req = a.request
                req.context_position += req.context_chunk_size
                req.context_chunk_size = None
                if req.context_position < len(req.prompt):
                    row += 1
                    continue  # a middle chunk: its logit row is not sampled
                prompt = tuple(req.prompt)
                result.logits[a.job.rid].append(
                    LogitRecord(step_index, 0, prompt, logits[row].clone())
                )
                first = logits[row : row + 1].expand(req.beam_width, -1)
                self._decode(a, first, regions[:, i], first_step=True)
                sampled.append(a)
                row += 1
            for g, a in enumerate(generation):
                w, req = a.job.beam_width, a.request
                for k in range(w):
                    tokens = (*req.prompt, *req.generated[k])
                    result.logits[a.job.rid].append(
                        LogitRecord(step_index, k, tokens, logits[row + k].clone())
                    )
                parents = self._decode(a, logits[row : row + w], regions[:, len(context) + g])
                result.reordered += sum(p != k for k, p in enumerate(parents))
                sampled.append(a)
                row += w
            last_generation = generation if not context else None
            last_tokens = [
                b[-1] for a in generation if not a.search.done for b in a.request.generated
            ]
            for a in sampled:
                if a.search.done:
                    rid = a.job.rid
                    tokens, scores, indices = a.search.results()
                    result.beams[rid], result.scores[rid] = tokens, scores
                    result.beam_indices[rid] = indices
                    result.log_probs[rid] = a.search.log_probs
                    active.remove(a)
                    self._release(a)
                    free_slots.append(a.request.seq_slot)
                    finished += 1
                    last_generation = None
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

    # ------------------------------------------------------------------- the decoder side
    def _copy_indirection(self, step, copies: torch.Tensor) -> None:
        """The batched copy: each generation request's beams from the decoder's buffer into the
        engine's cache_indirection, per [src, dst, size] (flat element offsets)."""
        source = self.indirection.view(-1)
        target = step.inputs["cache_indirection"].view(-1)
        for src, dst, size in copies.T.tolist():
            target[dst : dst + size] = source[src : src + size]

    def _decode(
        self, a: _Active, logits: torch.Tensor, region: torch.Tensor, first_step: bool = False
    ) -> list[int]:
        """One beam-search step of request `a`, then its decoder indirection: `region` is its
        [src, dst, size] of cache_indirection_decoder_copies (src == dst: the request's rows in
        the decoder buffer). Returns each new beam's parent."""
        search, req = a.search, a.request
        length = search.cur_len  # tokens of each beam before this step's token
        parents, _ = search.step(logits)
        src, dst, size = region.tolist()
        w, window = req.beam_width, self.config.max_attention_window
        if src != dst or size != w * window or src % window:
            raise ValueError(f"decoder copy {[src, dst, size]} is not request {a.job.rid}'s rows")
        rows = self.indirection.view(-1)[src : src + size].view(w, window)
        if first_step:
            rows[:, :length] = 0  # every beam reads the prompt KV of beam 0
        else:
            rows[:, :length] = rows[parents, :length].clone()
        if not search.done:
            rows[:, length] = torch.arange(w, dtype=rows.dtype)  # its next token: its own KV
            req.generated = search.running_tokens()
        return parents

    # ------------------------------------------------------------------------ scheduling
    def _schedule(self, active: list[_Active]) -> tuple[list[_Active], list[_Active]]:
        """Generation requests first (a request's beams take one token each), then prompt
        chunks over what is left of the budget, in arrival order."""
        budget = self.token_budget
        generation = []
        for a in active:
            req = a.request
            if req.context_position == len(req.prompt) and budget >= req.beam_width:
                self._grow_beams(a, len(req.prompt) + len(req.generated[0]))
                generation.append(a)
                budget -= req.beam_width
        context = []
        for a in active:
            req = a.request
            remaining = len(req.prompt) - req.context_position
            if remaining == 0 or budget == 0:
                continue
            chunk = min(remaining, self.chunk_size, budget)
            self._grow(req.kv_block_ids[0], req.context_position + chunk)
            req.context_chunk_size = chunk
            context.append(a)
            budget -= chunk
        return context, generation

    def _grow(self, blocks: list[int], tokens: int) -> None:
        grow_blocks(blocks, tokens, self.config.tokens_per_block, self.allocator)

    def _grow_beams(self, a: _Active, tokens: int) -> None:
        """Every beam's list covers `tokens`: the prompt's full blocks shared with beam 0 (the
        context step's list), the rest the beam's own."""
        lists = a.request.kv_block_ids
        if not a.shared and any(not x for x in lists[1:]):
            a.shared = len(a.request.prompt) // self.config.tokens_per_block
            for blocks in lists[1:]:
                blocks.extend(lists[0][: a.shared])
        for blocks in lists:
            self._grow(blocks, tokens)

    def _release(self, a: _Active) -> None:
        lists = a.request.kv_block_ids
        self.allocator.release(lists[0])
        for blocks in lists[1:]:
            self.allocator.release(blocks[a.shared :])


# ------------------------------------------------------------------------- the ground truth
@dataclasses.dataclass
class Reference:
    beams: list[list[int]]
    scores: list[float]
    beam_indices: list[list[int]]
    log_probs: list[torch.Tensor]  # transformers' output scores, per step [W, vocab]


def reference_beams(model: torch.nn.Module, jobs: Iterable[BeamJob]) -> dict[int, Reference]:
    """Each request alone through transformers.generate with beam search."""
    out = {}
    for job in jobs:
        prompt = torch.tensor([job.prompt], device=model.device)
        g = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            num_beams=job.beam_width,
            num_return_sequences=job.beam_width,
            do_sample=False,
            early_stopping=True,
            length_penalty=job.length_penalty,
            max_new_tokens=job.max_new_tokens,
            output_scores=True,
            return_dict_in_generate=True,
        )
        out[job.rid] = Reference(
            g.sequences[:, len(job.prompt) :].tolist(),
            g.sequences_scores.tolist(),
            g.beam_indices.tolist(),
            list(g.scores),
        )
    return out


@dataclasses.dataclass(frozen=True)
class Figures:
    max_score_difference: float
    max_log_prob_difference: float


def assert_same_beams(
    result: BeamResult, reference: dict[int, Reference], tol: float = 1e-9
) -> Figures:
    """Every request's returned beams equal transformers' (tokens and beam indices) and their
    scores agree within `tol`, as do the per-step log-probabilities of the running beams."""
    score_diff = log_prob_diff = 0.0
    for rid, want in reference.items():
        if rid not in result.beams:
            raise Mismatch(f"request {rid} did not finish")
        got = result.beams[rid]
        if got != want.beams:
            raise Mismatch(f"request {rid}: beams {got}, transformers.generate gave {want.beams}")
        if result.beam_indices[rid] != want.beam_indices:
            raise Mismatch(
                f"request {rid}: beam indices {result.beam_indices[rid]}, transformers.generate "
                f"gave {want.beam_indices}"
            )
        for k, (a, b) in enumerate(zip(result.scores[rid], want.scores)):
            score_diff = max(score_diff, abs(a - b))
            if not abs(a - b) <= tol:
                raise Mismatch(f"request {rid} beam {k}: score {a!r}, transformers gave {b!r}")
        mine = result.log_probs[rid]
        if len(mine) != len(want.log_probs):
            raise Mismatch(
                f"request {rid}: {len(mine)} steps, transformers ran {len(want.log_probs)}"
            )
        for s, (a, b) in enumerate(zip(mine, want.log_probs)):
            d = float((a.double() - b.double()).abs().max())
            log_prob_diff = max(log_prob_diff, d)
            if not d <= tol:
                raise Mismatch(f"request {rid} step {s}: log-probabilities differ by {d:.3g}")
    return Figures(score_diff, log_prob_diff)


@torch.no_grad()
def assert_logits_match(model: torch.nn.Module, result: BeamResult, tol: float = 1e-9) -> float:
    """Every beam's logits of every step equal a teacher-forced forward of the model over the
    tokens that beam had read, within `tol`; raise on the earliest step that differs, naming
    the request, step and beam. Returns the largest difference."""
    vocab = model.config.vocab_size
    worst, first_bad = 0.0, None
    for rid, records in result.logits.items():
        if not records:
            continue
        # one forward per maximal token sequence covers every prefix of it (causal)
        where: dict[tuple[int, ...], int] = {}
        maximal: list[tuple[int, ...]] = []
        for tokens in sorted({r.tokens for r in records}, key=len, reverse=True):
            if tokens in where:
                continue
            for n in range(1, len(tokens) + 1):
                where.setdefault(tokens[:n], len(maximal))
            maximal.append(tokens)
        longest = max(map(len, maximal))
        batch = torch.zeros((len(maximal), longest), dtype=torch.int64, device=model.device)
        for b, tokens in enumerate(maximal):
            batch[b, : len(tokens)] = torch.tensor(tokens)
        teacher = model(batch).logits[..., :vocab]
        for r in records:
            want = teacher[where[r.tokens], len(r.tokens) - 1]
            d = float((r.logits.to(want.device, want.dtype) - want).abs().max())
            worst = max(worst, d)
            if not d <= tol and (first_bad is None or r.step < first_bad[0]):
                first_bad = (r.step, rid, r.beam, d)
    if first_bad is not None:
        step, rid, beam, d = first_bad
        raise Mismatch(
            f"request {rid} beam {beam} at step {step}: logits differ from a teacher-forced "
            f"forward by {d:.3g}"
        )
    return worst


def beam_workload(
    n: int = 10,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    max_prompt: int = 40,
    max_new_tokens: int = 7,
    length_penalties: Sequence[float] = (1.0, 0.7),
) -> list[BeamJob]:
    """`n` requests of beam width 2 and 4 (alternating), prompts of 1 to `max_prompt` tokens
    (a one-token prompt and one a whole number of 4-token blocks among them), arriving over
    the first steps, each with its own number of tokens and length penalty."""
    import random

    rng = random.Random(seed)
    lengths = [1, 8, max_prompt] + [rng.randint(1, max_prompt) for _ in range(n - 3)]
    return [
        BeamJob(
            rid=i,
            prompt=tuple(rng.randrange(vocab_size) for _ in range(length)),
            max_new_tokens=rng.randint(1, max_new_tokens) if i % 5 else max_new_tokens,
            arrival_step=rng.randint(0, n // 2),
            beam_width=(2, 4)[i % 2],
            length_penalty=length_penalties[(i // 2) % len(length_penalties)],
        )
        for i, length in enumerate(lengths)
    ]
