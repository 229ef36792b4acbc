"""Speculative decoding (Medusa) on a real model through the generated ``medusa`` buffers.

* ``SpecLlama``: a packed Llama forward (``llama.PackedLlama``'s weights and projections) that
  verifies draft tokens in one step. It reads only the step's engine inputs: ``input_ids``,
  ``position_ids``, ``spec_decoding_generation_lengths``, ``spec_decoding_position_offsets``,
  ``spec_decoding_packed_mask``, ``host_request_types``, ``host_context_lengths``,
  ``sequence_length``, ``host_past_key_value_lengths``, ``last_token_ids`` and
  ``kv_cache_block_offsets``; it writes ``logits`` (one row per logit group) and, with Medusa
  heads, ``medusa_logits``.
* ``SpeculativeExecutor``: in-flight batching (arrivals over time, a token budget, chunked
  prefill, mixed context and generation steps, a paged KV cache) where every generation request
  carries exactly ``max_draft_tokens`` drafts and a context request may carry drafts on its
  last chunk. Drafts are accepted greedily: the longest prefix equal to the base model's argmax
  at each position, plus the base model's next token. KV entries of rejected drafts are left
  where they are: the sequence length counts only accepted tokens, so later steps overwrite
  them.
* Draft sources: ``MedusaDrafts`` (random Medusa heads on the last hidden state, read from the
  family's ``medusa_logits`` output) and ``NoisyOracle`` (a known greedy continuation, each
  draft corrupted with a given probability, deterministically), so a run has rejected, partly
  accepted and fully accepted drafts.

Whatever the drafts, every request's tokens must equal ``transformers.generate`` (greedy) and
every logit row must equal the Hugging Face model's logits at that position
(tests/test_speculative_model.py). ``python -m bufc.examples.speculative`` runs a workload and
prints the acceptance rate and the steps saved.

Row layout the engine relies on (docs/contract.md, "Speculative decoding"):
context requests first (chunk tokens, then drafts on a last chunk), then per generation request
its last token followed by its drafts. ``position_ids`` holds one position per context token
(drafts included) and one per generation request (its last token's); a generation request's
tree token j sits at that position + ``spec_decoding_position_offsets[g, j]`` and its K/V goes
to cache slot past + j.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import torch

from bufc.generated import medusa
from bufc.runtime import Request

from .executor import Job, grow_blocks
from .llama import PackedLlama
from .paged_cache import BlockAllocator, PagedKVCache

# --------------------------------------------------------------------------- the fixed tree


def chain_tree(max_draft_tokens: int, max_batch_size: int) -> dict[str, list]:
    """Static values of Medusa's tree inputs for a chain (linear) tree of 1 + K tokens: every
    request feeds 1 + K tokens at offsets 0..K; token i attends to tokens 0..i (bit j of row i,
    32 bits per int32 word). Keys are the medusa family's static tensor names."""
    d = max_draft_tokens + 1
    words = -(-d // 32)
    rows = []
    for i in range(d):
        row = [0] * words
        for j in range(i + 1):
            row[j // 32] |= 1 << (j % 32)
        rows.append([w - (1 << 32) if w >= 1 << 31 else w for w in row])  # as int32
    return {
        "medusa_generation_lengths": [d] * max_batch_size,
        "medusa_position_offsets": [list(range(d))] * max_batch_size,
        "medusa_packed_mask": rows * max_batch_size,
    }


def unpack_mask(words: torch.Tensor, n: int) -> torch.Tensor:
    """[rows, spec_mask_words] int32 -> [rows, n] bool: bit j (word j // 32) of each row."""
    w = words.long() & 0xFFFFFFFF
    j = torch.arange(n, device=words.device)
    return ((w[:, j // 32] >> (j % 32)) & 1).bool()


# --------------------------------------------------------------------------- the engine


class MedusaHeads:
    """Random Medusa heads: head h maps the final (normed) hidden state of a token to logits of
    the token h + 2 places after it, through a residual block (h + SiLU(W h + b)) and its own
    LM head (the base model's, perturbed), as in Medusa-1."""

    def __init__(
        self, hf_model: torch.nn.Module, num_heads: int, *, seed: int = 0, noise: float = 0.05
    ) -> None:
        cfg = hf_model.config
        base = hf_model.lm_head.weight.detach()
        g = torch.Generator().manual_seed(seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64).to(base)

        hidden = cfg.hidden_size
        self.res_w = [randn(hidden, hidden) * hidden**-0.5 for _ in range(num_heads)]
        self.res_b = [randn(hidden) * 0.1 for _ in range(num_heads)]
        self.lm = [base + noise * randn(*base.shape) for _ in range(num_heads)]

    @property
    def num_heads(self) -> int:
        return len(self.lm)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [heads, rows, vocab]."""
        out = [
            (h + torch.nn.functional.silu(h @ w.T + b)) @ lm.T
            for w, b, lm in zip(self.res_w, self.res_b, self.lm)
        ]
        return torch.stack(out)


@dataclasses.dataclass(frozen=True)
class _Seq:
    """One sequence of a step as the engine derives it from the engine inputs."""

    start: int  # first packed token
    new: int  # tokens this step
    past: int  # KV entries before this step
    positions: torch.Tensor  # [new] RoPE positions
    visible: torch.Tensor  # [new, new] which of this step's tokens each one attends to


class SpecLlama(PackedLlama):
    """A packed Llama forward that verifies draft tokens in one step (one process)."""

    def __init__(self, hf_model: torch.nn.Module, heads: MedusaHeads | None = None) -> None:
        super().__init__(hf_model)
        self.heads = heads

    def layout(self, inputs: dict[str, torch.Tensor]) -> list[_Seq]:
        """The sequences of a step, from the engine inputs alone; ValueError on inputs that
        contradict each other (lengths that do not add up)."""
        types = inputs["host_request_types"].tolist()
        ctx_lengths = inputs["host_context_lengths"].tolist()
        seq_len = inputs["sequence_length"].cpu().tolist()
        past_kv = inputs["host_past_key_value_lengths"].tolist()
        gen_lengths = inputs["spec_decoding_generation_lengths"].cpu().tolist()
        offsets = inputs["spec_decoding_position_offsets"].long()
        packed = inputs["spec_decoding_packed_mask"]
        positions = inputs["position_ids"].long()
        tokens = inputs["input_ids"].numel()
        depth = offsets.shape[1]  # max_decoding_tokens: rows of the packed mask per request
        if len(gen_lengths) != types.count(1):
            raise ValueError(
                f"{len(gen_lengths)} spec_decoding_generation_lengths for "
                f"{types.count(1)} generation requests"
            )
        seqs, tok, pos, g = [], 0, 0, 0
        for i, kind in enumerate(types):
            if kind == 0:  # a context chunk, then its drafts on a last chunk: plain causal
                new = ctx_lengths[i]
                past = seq_len[i] - new
                if past_kv[i] != seq_len[i] or past < 0:
                    raise ValueError(
                        f"context sequence {i}: past KV length {past_kv[i]}, sequence length "
                        f"{seq_len[i]}, context length {new} do not agree"
                    )
                p = positions[pos : pos + new]
                pos += new
                visible = torch.ones(new, new, dtype=torch.bool, device=p.device).tril()
            else:  # the last token then the drafts: the tree's positions and mask
                new = gen_lengths[g]
                past = past_kv[i]
                if past + new != seq_len[i] or not 1 <= new <= depth:
                    raise ValueError(
                        f"generation sequence {i}: past KV length {past} + {new} tree tokens "
                        f"!= sequence length {seq_len[i]}"
                    )
                p = positions[pos] + offsets[g, :new]
                pos += 1
                visible = unpack_mask(packed[g * depth : g * depth + new], new)
                g += 1
            seqs.append(_Seq(tok, new, past, p, visible))
            tok += new
        if tok != tokens or pos != positions.numel():
            raise ValueError(
                f"the sequences cover {tok} tokens and {pos} positions; the step packs "
                f"{tokens} tokens and {positions.numel()} positions"
            )
        return seqs

    @torch.no_grad()
    def forward(self, step, cache: PagedKVCache) -> None:  # type: ignore[override]
        inp = step.inputs
        seqs = self.layout(inp)
        blocks = inp["kv_cache_block_offsets"][0]
        device = inp["input_ids"].device
        slots, history, masks = [], [], []
        for i, s in enumerate(seqs):
            total = s.past + s.new
            slots.append(cache.slots(blocks[i], torch.arange(s.past, total, device=device)))
            history.append(cache.slots(blocks[i], torch.arange(total, device=device)))
            past = torch.ones(s.new, s.past, dtype=torch.bool, device=device)
            masks.append(torch.cat((past, s.visible), dim=1))  # [new, past + new]
        x = self.model.embed_tokens(inp["input_ids"].long())
        positions = torch.cat([s.positions for s in seqs])
        cos, sin = self.model.rotary_emb(x[None], positions[None])
        group = self.num_heads // self.kv_heads
        for layer_idx, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            out = torch.empty_like(q)
            for i, s in enumerate(seqs):
                a, b = s.start, s.start + s.new
                cache.write(layer_idx, *slots[i], k[a:b], v[a:b])
                keys, values = cache.read(layer_idx, *history[i])
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
                scores = torch.einsum("qhd,khd->hqk", q[a:b], keys) * self.head_dim**-0.5
                scores = scores.masked_fill(~masks[i], float("-inf"))
                out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
            x = x + layer.self_attn.o_proj(out.reshape(x.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.model.norm(x)
        last = inp["last_token_ids"].long() - 1  # 1-based index of each logit row's last token
        h = x[last]
        logits = step.outputs["logits"]
        logits[:, : self.lm_weight.shape[0]] = h @ self.lm_weight.T
        if self.heads is not None:
            self._medusa(h, last, seqs, step.outputs["medusa_logits"])

    def _medusa(
        self, h: torch.Tensor, last: torch.Tensor, seqs: list[_Seq], out: torch.Tensor
    ) -> None:
        """medusa_logits[head, row]: the heads on logit row `row`, rows packed as in logits."""
        assert self.heads is not None
        heads = self.heads(h)  # [heads, rows, vocab]
        out[:, : heads.shape[1], : heads.shape[-1]] = heads.to(out.dtype)


# --------------------------------------------------------------------------- draft sources


class DraftSource(Protocol):
    def context(self, job: Job) -> list[int]:
        """Drafts to ride on the last prompt chunk (guesses of the first generated tokens)."""
        ...

    def generation(self, job: Job, generated: Sequence[int], heads: Sequence[int]) -> list[int]:
        """Exactly K drafts after `generated` (its last token is this step's input); `heads`
        are the Medusa heads' top-1 tokens at that token (empty without heads)."""
        ...


class MedusaDrafts:
    """The Medusa heads' top-1 tokens; none on the context (no hidden state yet)."""

    def context(self, job: Job) -> list[int]:
        return []

    def generation(self, job: Job, generated: Sequence[int], heads: Sequence[int]) -> list[int]:
        return list(heads)


class NoisyOracle:
    """Drafts from a known greedy continuation of each request (`truth`), each draft replaced
    by another token with probability `noise` (decided by a seeded hash of the request, the
    position drafted from and the draft's index, so runs repeat). Context requests carry
    0..K drafts (by request)."""

    def __init__(
        self,
        truth: Mapping[int, Sequence[int]],
        k: int,
        vocab_size: int,
        *,
        noise: float = 0.3,
        seed: int = 0,
    ) -> None:
        self.truth, self.k, self.vocab, self.noise, self.seed = truth, k, vocab_size, noise, seed

    def _drafts(self, rid: int, start: int, n: int) -> list[int]:
        truth = self.truth[rid]
        out = []
        for j in range(n):
            rng = random.Random(f"{self.seed}:{rid}:{start}:{j}")
            n_at = start + j  # index of the generated token this draft guesses
            right = truth[n_at] if n_at < len(truth) else rng.randrange(self.vocab)
            if rng.random() < self.noise:
                right = (right + 1 + rng.randrange(self.vocab - 1)) % self.vocab
            out.append(right)
        return out

    def context(self, job: Job) -> list[int]:
        n = random.Random(f"{self.seed}:{job.rid}:count").randrange(self.k + 1)
        return self._drafts(job.rid, 0, n)

    def generation(self, job: Job, generated: Sequence[int], heads: Sequence[int]) -> list[int]:
        return self._drafts(job.rid, len(generated), self.k)


# --------------------------------------------------------------------------- the driver


@dataclasses.dataclass(frozen=True)
class Verification:
    step: int
    rid: int
    kind: str  # "context" (drafts on a last chunk) or "generation"
    proposed: int
    accepted: int


@dataclasses.dataclass(frozen=True)
class LogitRecord:
    """Logit rows of one request in one step: row j is the model's logits after
    tokens[: first + j + 1]."""

    step: int
    rid: int
    tokens: tuple[int, ...]
    first: int
    logits: torch.Tensor


@dataclasses.dataclass
class SpecStepStats:
    step: int
    context_requests: int
    generation_requests: int
    context_drafts: int  # drafts riding on last context chunks
    tokens: int
    logits: int
    step_s: float


@dataclasses.dataclass
class SpecResult:
    tokens: dict[int, list[int]]
    token_steps: dict[int, list[int]]  # the step that produced each generated token
    steps: list[SpecStepStats]
    verifications: list[Verification]
    records: list[LogitRecord]

    @property
    def proposed(self) -> int:
        return sum(v.proposed for v in self.verifications)

    @property
    def accepted(self) -> int:
        return sum(v.accepted for v in self.verifications)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.proposed, 1)

    @property
    def steps_saved(self) -> int:
        """Token-producing steps saved against one token per step, over all requests: tokens
        generated minus the steps that produced them."""
        generated = sum(len(t) for t in self.tokens.values())
        producing = sum(len(set(s)) for s in self.token_steps.values())
        return generated - producing


@dataclasses.dataclass(eq=False)
class _Active:
    job: Job
    request: Request
    blocks: list[int]
    context_drafts: list[int]


Mutate = Callable[[int, object], Callable[[], None] | None]


class SpeculativeExecutor:
    def __init__(
        self,
        hf_model: torch.nn.Module,
        drafts: DraftSource,
        *,
        max_draft_tokens: int = 3,
        max_batch_size: int = 8,
        token_budget: int = 64,
        chunk_size: int | None = None,
        tokens_per_block: int = 16,
        max_sequence_length: int = 512,
        medusa_heads: MedusaHeads | None = None,
        keep_logits: bool = True,
        device: str = "cpu",
    ) -> None:
        cfg = hf_model.config
        dtype = next(hf_model.parameters()).dtype
        k = max_draft_tokens
        self.config = medusa.Config(
            max_batch_size=max_batch_size,
            max_num_tokens=token_budget,
            max_draft_tokens=k,
            num_medusa_heads=medusa_heads.num_heads if medusa_heads else k,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_hidden_layers,
            max_attention_window=max_sequence_length,
            tokens_per_block=tokens_per_block,
            logits_dtype=dtype,
        )
        if token_budget < k + 1:
            raise ValueError(f"a token budget of {token_budget} cannot hold 1 + {k} tokens")
        if medusa_heads is not None and medusa_heads.num_heads < k:
            raise ValueError(f"{medusa_heads.num_heads} Medusa heads cannot draft {k} tokens")
        self.buffers = medusa.RuntimeBuffers(
            self.config, device=device, static_inputs=chain_tree(k, max_batch_size)
        )
        self.model = SpecLlama(hf_model, medusa_heads)
        self.drafts = drafts
        self.k = k
        blocks = max_batch_size * self.config.max_blocks_per_seq + BlockAllocator.RESERVED
        self.allocator = BlockAllocator(blocks)
        self.cache = PagedKVCache.for_model(self.model, blocks, tokens_per_block, dtype, device)
        self.token_budget = token_budget
        self.chunk_size = chunk_size or token_budget
        self.keep_logits = keep_logits

    def run(self, jobs: Iterable[Job], *, mutate: Mutate | None = None) -> SpecResult:
        """Serve `jobs` to completion. `mutate(step_index, step)` may alter a prepared step
        before the model runs and return a function that undoes it after (the tests use it to
        prove the comparison can fail)."""
        pending = deque(sorted(jobs, key=lambda j: (j.arrival_step, j.rid)))
        waiting: deque[Job] = deque()
        active: list[_Active] = []
        free_slots = list(range(self.config.max_batch_size - 1, -1, -1))
        rids = [j.rid for j in pending]
        result = SpecResult({r: [] for r in rids}, {r: [] for r in rids}, [], [], [])
        step_index = 0
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
                drafts = self.drafts.context(job)[: self.k]
                active.append(_Active(job, req, req.kv_block_ids[0], drafts))
            context, generation = self._schedule(active)
            if not context and not generation:
                step_index += 1
                continue
            step = self.buffers.prepare_step(
                [a.request for a in context], [a.request for a in generation]
            )
            context_drafts = sum(len(a.request.draft_tokens) for a in context)
            undo = mutate(step_index, step) if mutate is not None else None
            self.model.forward(step, self.cache)
            if undo is not None:
                undo()
            self._verify(step, step_index, context, generation, active, free_slots, result)
            result.steps.append(
                SpecStepStats(
                    step=step_index,
                    context_requests=len(context),
                    generation_requests=len(generation),
                    context_drafts=context_drafts,
                    tokens=step.sizes.num_tokens,
                    logits=step.sizes.num_logits,
                    step_s=time.perf_counter() - t0,
                )
            )
            step_index += 1
        return result

    def _verify(self, step, step_index, context, generation, active, free_slots, result) -> None:
        vocab = self.config.vocab_size
        logits = step.outputs["logits"][:, :vocab]
        greedy = logits.argmax(dim=-1).tolist()
        heads = None
        if self.model.heads is not None:  # top-1 of each head at each logit row
            heads = step.outputs["medusa_logits"][: self.k, :, :vocab].argmax(-1).tolist()
        row = 0
        for r, a in enumerate([*context, *generation]):
            req, job = a.request, a.job
            drafts = list(req.draft_tokens)
            if r < len(context):
                begin, chunk = req.context_position, req.context_chunk_size
                req.context_position += chunk
                req.context_chunk_size = None
                last_chunk = req.context_position == len(req.prompt)
                if not last_chunk:
                    drafts = []
                inputs = tuple(req.prompt[: begin + chunk]) + tuple(drafts)
                first = begin + chunk - 1
                kind = "context"
            else:
                last_chunk = True
                inputs = tuple(req.prompt) + tuple(req.generated[0]) + tuple(drafts)
                first = len(req.prompt) + len(req.generated[0]) - 1
                kind = "generation"
            rows = 1 + len(drafts)
            if self.keep_logits:
                block = logits[row : row + rows].detach().clone()
                result.records.append(LogitRecord(step_index, job.rid, inputs, first, block))
            if not last_chunk:  # a middle chunk: its logit row is not sampled
                req.draft_tokens = []
                row += rows
                continue
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == greedy[row + accepted]:
                accepted += 1
            new = drafts[:accepted] + [greedy[row + accepted]]
            if drafts:
                result.verifications.append(
                    Verification(step_index, job.rid, kind, len(drafts), accepted)
                )
            new = new[: job.max_new_tokens - len(req.generated[0])]
            req.generated[0].extend(new)
            result.tokens[job.rid].extend(new)
            result.token_steps[job.rid].extend([step_index] * len(new))
            bonus_heads = [h[row + accepted] for h in heads] if heads is not None else []
            row += rows
            if len(req.generated[0]) >= job.max_new_tokens:
                active.remove(a)
                self.allocator.release(a.blocks)
                free_slots.append(req.seq_slot)
                continue
            req.draft_tokens = self.drafts.generation(job, req.generated[0], bonus_heads)
            if len(req.draft_tokens) != self.k:
                raise ValueError(
                    f"request {job.rid}: the draft source gave {len(req.draft_tokens)} drafts, "
                    f"Medusa verifies exactly {self.k}"
                )

    def _schedule(self, active: list[_Active]) -> tuple[list[_Active], list[_Active]]:
        """Generation requests first (1 + K tokens each), then prompt chunks in arrival order;
        a last chunk takes its drafts as far as the budget allows."""
        budget = self.token_budget
        generation = []
        for a in active:
            req = a.request
            if req.context_position == len(req.prompt) and budget >= 1 + self.k:
                self._grow(a, len(req.prompt) + len(req.generated[0]) + self.k)
                generation.append(a)
                budget -= 1 + self.k
        context = []
        for a in active:
            req = a.request
            remaining = len(req.prompt) - req.context_position
            if remaining == 0 or budget == 0:
                continue
            chunk = min(remaining, self.chunk_size, budget)
            drafts = a.context_drafts[: budget - chunk] if chunk == remaining else []
            req.context_chunk_size = chunk
            req.draft_tokens = drafts
            self._grow(a, req.context_position + chunk + len(drafts))
            context.append(a)
            budget -= chunk + len(drafts)
        return context, generation

    def _grow(self, a: _Active, tokens: int) -> None:
        grow_blocks(a.blocks, tokens, self.config.tokens_per_block, self.allocator)


# --------------------------------------------------------------------------- checks


class LogitsMismatch(AssertionError):
    pass


class HFLogits:
    """The Hugging Face model's logits of a token sequence, memoised (runs share prefixes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def __call__(self, tokens: tuple[int, ...]) -> torch.Tensor:
        out = self._memo.get(tokens)
        if out is None:
            ids = torch.tensor([tokens], device=self.model.device)
            out = self._memo[tokens] = self.model(ids).logits[0]
        return out


def assert_logits_match(result: SpecResult, hf: HFLogits, tol: float = 1e-9) -> float:
    """Every recorded logit row equals the HF model's logits at its position within `tol`,
    checked in step order; returns the largest difference, raises on the first row beyond."""
    worst = 0.0
    for rec in sorted(result.records, key=lambda r: (r.step, r.rid)):
        want = hf(rec.tokens)[rec.first : rec.first + len(rec.logits)]
        diff = (rec.logits - want.to(rec.logits)).abs().amax(dim=-1)
        bad = torch.nonzero(diff > tol)
        if bad.numel():
            j = int(bad[0, 0])
            raise LogitsMismatch(
                f"request {rec.rid}, step {rec.step}: logit row {j} (position "
                f"{rec.first + j}) differs from the HF model's by {float(diff[j]):.3e} "
                f"(tolerance {tol:g})"
            )
        worst = max(worst, float(diff.max()))
    return worst


# --------------------------------------------------------------------------- demo


def workload(n: int = 12, *, seed: int = 0, vocab_size: int = 512, max_prompt: int = 40):
    """`n` requests arriving over the first steps: prompts of 1 to `max_prompt` tokens, 4 to
    20 new tokens each."""
    from .compare import random_jobs

    rng = random.Random(seed)
    lengths = [1, max_prompt] + [rng.randint(1, max_prompt) for _ in range(n - 2)]
    return random_jobs(rng, lengths, vocab_size=vocab_size, new_tokens=(4, 20), last_arrival=n // 2)


def main(argv: list[str] | None = None) -> int:
    from .compare import threads_option, torch_threads

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--drafts", type=int, default=3, help="max_draft_tokens (K)")
    p.add_argument("--source", choices=("oracle", "medusa"), default="oracle")
    p.add_argument("--noise", type=float, default=0.3, help="oracle: chance a draft is wrong")
    p.add_argument("--token-budget", type=int, default=40)
    p.add_argument("--chunk-size", type=int, default=12)
    p.add_argument("--tokens-per-block", type=int, default=4)
    threads_option(p)
    args = p.parse_args(argv)
    with torch_threads(args.threads):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    from .compare import assert_same_tokens, reference_tokens, tiny_llama
    from .executor import Executor

    model = tiny_llama(0)
    jobs = workload(args.requests, seed=1)
    reference = reference_tokens(model, jobs)
    heads = MedusaHeads(model, args.drafts, seed=1)
    if args.source == "oracle":
        source: DraftSource = NoisyOracle(reference, args.drafts, 512, noise=args.noise, seed=2)
    else:
        source = MedusaDrafts()
    common = dict(
        max_batch_size=6,
        token_budget=args.token_budget,
        chunk_size=args.chunk_size,
        tokens_per_block=args.tokens_per_block,
        max_sequence_length=128,
    )
    ex = SpeculativeExecutor(
        model, source, max_draft_tokens=args.drafts, medusa_heads=heads, **common
    )
    result = ex.run(jobs)
    assert_same_tokens(result, reference)  # type: ignore[arg-type]
    worst = assert_logits_match(result, HFLogits(model))
    plain = Executor(model, **common).run(jobs)
    assert_same_tokens(plain, reference)
    outcomes = {"rejected": 0, "partial": 0, "full": 0}
    for v in result.verifications:
        key = "rejected" if v.accepted == 0 else "full" if v.accepted == v.proposed else "partial"
        outcomes[key] += 1
    generated = sum(len(t) for t in result.tokens.values())
    print(f"requests                 {len(jobs)} ({generated} tokens), K = {args.drafts}")
    print(f"draft source             {args.source}")
    print(f"steps                    {len(result.steps)} (one token per step: {len(plain.steps)})")
    mixed = sum(1 for s in result.steps if s.context_requests and s.generation_requests)
    print(f"mixed steps              {mixed}")
    print(
        f"drafts accepted          {result.accepted}/{result.proposed} "
        f"({100 * result.acceptance_rate:.1f} %); verifications {outcomes}"
    )
    print(f"token steps saved        {result.steps_saved} (over all requests)")
    print(f"max |logits - HF|        {worst:.2e}")
    print(f"torch intra-op threads   {args.threads}")
    print(f"result                   all {len(jobs)} requests match transformers.generate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
