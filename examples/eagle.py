"""EAGLE tree verification on a real model through the generated ``eagle`` buffers.

TensorRT-LLM's EAGLE runtime verifies a draft *tree* per generation request in one base-model
step; this module plays every part around bufc's buffers:

* ``TreeDrafter``: draft trees of 0..``max_draft_tokens`` nodes, at most ``max_draft_path_len``
  deep, with branching, deterministic from a seed. Like ``speculative.NoisyOracle`` it knows
  each request's greedy continuation: below a node on the true path one child (any of them,
  not only the first) carries the true next token, with a given probability; its siblings and
  everything below a wrong node are wrong, so a run has rejected, partly accepted, fully
  accepted paths and paths accepted on a non-first branch.
* ``write_tree_inputs``: the drafter's ``external`` tensors, written into the step's bound
  views after ``step()`` returns and before the engine runs, as TensorRT-LLM's Eagle packing
  kernel writes them: ``spec_decoding_generation_lengths`` (1 + drafts),
  ``spec_decoding_position_offsets`` (row g at the bound row length, max_generation_length:
  each node's depth), ``spec_decoding_packed_mask`` (request g's rows dense from the sum of
  the earlier requests' generation lengths; bit j of row i: node j is an ancestor-or-self of
  node i), ``eagle_draft_tokens``, ``eagle_draft_lens`` and ``eagle_draft_paths`` (bound as
  draft_tokens, draft_lens, draft_paths; one root-to-leaf path per row of the paths, node
  indices, -1 after).
* ``EagleLlama``: ``speculative.SpecLlama``'s packed paged forward; it reads only the step's
  engine inputs and writes one logit row per tree node of a generation request and one per
  context request. Tree node j of generation request g sits at ``position_ids`` of its row +
  ``spec_decoding_position_offsets[g, j]``, attends to the past and to its ancestors, and
  writes its K/V to cache position past + j.
* ``TreeExecutor``: in-flight batching over ``add`` / ``step`` / ``finish`` (arrivals,
  chunked prefill, a token budget, finishes and slot reuse, KV blocks on a paged pool); the
  accepted path's K/V moved from past + j_k to past + k (TensorRT-LLM's KV-cache rewind);
  ``step(tokens, accepted={slot: n}, drafts=...)`` with the bonus token in ``tokens[slot]``.
  ``EagleExecutor`` is it with the drafter above and greedy acceptance from the root (the
  decoder's job); ``lookahead.LookaheadExecutor`` is it with lookahead's drafter.

tests/test_eagle_model.py proves with it that every request's tokens equal
``transformers.generate`` (greedy), that every verified logit row equals the Hugging Face
model's logits at its position, and that each of four deliberate errors (``Faults``) breaks
that comparison.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from bufc.generated import eagle
from bufc.runtime import Request

from .compare import random_jobs
from .executor import Job, grow_blocks, split_budget
from .paged_cache import BlockAllocator, PagedKVCache
from .speculative import LogitRecord, SpecLlama, SpecResult, _Seq, unpack_mask

# --------------------------------------------------------------------------- draft trees


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """One request's draft tree in tree (level) order: node 0 is the root (the request's last
    token, not a draft), node j >= 1 is draft ``tokens[j - 1]`` under node ``parents[j - 1]``
    (an earlier node)."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} draft tokens, {len(self.parents)} parents")
        if any(not 0 <= p <= j for j, p in enumerate(self.parents)):
            raise ValueError(f"parents {self.parents} are not in tree order")

    @property
    def size(self) -> int:
        """Tree nodes: the root and the drafts (the request's generation length)."""
        return 1 + len(self.tokens)

    def parent(self, j: int) -> int:
        return self.parents[j - 1]

    def token(self, j: int) -> int:
        return self.tokens[j - 1]

    def path(self, j: int) -> list[int]:
        """The nodes from the root to node j, both included."""
        out = [j]
        while out[-1]:
            out.append(self.parent(out[-1]))
        return out[::-1]

    @property
    def depths(self) -> list[int]:
        return [len(self.path(j)) - 1 for j in range(self.size)]

    def children(self, j: int) -> list[int]:
        return [c for c in range(1, self.size) if self.parent(c) == j]

    def leaves(self) -> list[int]:
        return [j for j in range(self.size) if not self.children(j)]

    def mask(self) -> np.ndarray:
        """[size, size] bool: row i has column j set when node j is an ancestor-or-self of i."""
        m = np.zeros((self.size, self.size), bool)
        for i in range(self.size):
            m[i, self.path(i)] = True
        return m

    def is_first_child(self, j: int) -> bool:
        return self.children(self.parent(j))[0] == j


def pack_mask(mask: np.ndarray, words: int) -> np.ndarray:
    """[rows, n] bool -> [rows, words] int32: bit j of word j // 32 (as int32 bits)."""
    out = np.zeros((mask.shape[0], words), np.int64)
    for j in range(mask.shape[1]):
        out[:, j // 32] |= mask[:, j].astype(np.int64) << (j % 32)
    return np.where(out >= 1 << 31, out - (1 << 32), out).astype(np.int32)


class TreeDrafter:
    """Draft trees from a known greedy continuation of each request (`truth`, by request id).

    The tree for a request that has generated `n` tokens is drawn from a seeded RNG keyed by
    (seed, request, n): 0..`max_nodes` nodes, each under a random earlier node shallower than
    `max_depth`, renumbered in level order. Below each node on the true path, with probability
    `follow`, one of its children (chosen at random) carries the true next token; every other
    node gets a wrong token, distinct from its siblings."""

    def __init__(
        self,
        truth: Mapping[int, Sequence[int]],
        vocab_size: int,
        *,
        max_nodes: int = 6,
        max_depth: int = 3,
        follow: float = 0.75,
        seed: int = 0,
    ) -> None:
        self.truth, self.vocab = truth, vocab_size
        self.max_nodes, self.max_depth, self.follow, self.seed = max_nodes, max_depth, follow, seed

    def _shape(self, rng: random.Random) -> list[int]:
        """Parents of a random tree's nodes 1.., in level order."""
        depth, parent = [0], [-1]
        for _ in range(rng.randrange(self.max_nodes + 1)):
            p = rng.choice([j for j, d in enumerate(depth) if d < self.max_depth])
            depth.append(depth[p] + 1)
            parent.append(p)
        order = [0]  # level order: by depth, then by the parent's new index, then as drawn
        for d in range(1, self.max_depth + 1):
            at = [j for j in range(1, len(depth)) if depth[j] == d]
            order += sorted(at, key=lambda j: (order.index(parent[j]), j))
        new = {old: i for i, old in enumerate(order)}
        return [new[parent[old]] for old in order[1:]]

    def draft(self, rid: int, generated: int) -> DraftTree:
        """The tree verified after a request's `generated` tokens (the last is the root)."""
        rng = random.Random(f"{self.seed}:{rid}:{generated}")
        parents = self._shape(rng)
        truth = self.truth[rid]
        size = 1 + len(parents)
        tokens = [0] * size
        on_truth = [True] + [False] * len(parents)  # the root is a true token
        depth = [0] * size
        for p in range(size):  # level order: a node's children come after it
            children = [j for j in range(1, size) if parents[j - 1] == p]
            if not children:
                continue
            at = generated + depth[p]  # index of the generated token the children guess
            right = truth[at] if at < len(truth) else rng.randrange(self.vocab)
            pick = -1
            if on_truth[p] and rng.random() < self.follow:
                pick = rng.randrange(len(children))
            taken = {right}
            for i, c in enumerate(children):
                depth[c] = depth[p] + 1
                if i == pick:
                    tokens[c], on_truth[c] = right, True
                    continue
                while (token := rng.randrange(self.vocab)) in taken:
                    pass
                tokens[c] = token
                taken.add(token)
        return DraftTree(tuple(tokens[1:]), tuple(parents))


def write_tree_inputs(step, trees: Sequence[DraftTree | None]) -> None:
    """The drafter's external tensors of one step, written into its bound views. `trees` has
    one entry per sequence of the step, in row order: None for a context request, the draft
    tree of a generation request."""
    inp = step.inputs
    gen = [t for t in trees if t is not None]
    offsets = inp["spec_decoding_position_offsets"]
    packed = inp["spec_decoding_packed_mask"]
    width, words = offsets.shape[1], packed.shape[1]
    lengths = np.array([t.size for t in gen], np.int32)
    rows = np.zeros((offsets.shape[0], width), np.int32)
    mask = np.zeros(tuple(packed.shape), np.int32)
    start = 0  # request g's mask rows start after the earlier requests' nodes (dense)
    for g, t in enumerate(gen):
        rows[g, : t.size] = t.depths
        mask[start : start + t.size] = pack_mask(t.mask(), words)
        start += t.size
    tokens = np.full(tuple(inp["draft_tokens"].shape), -1, np.int32)
    lens = np.zeros(tuple(inp["draft_lens"].shape), np.int32)
    paths = np.full(tuple(inp["draft_paths"].shape), -1, np.int32)
    for i, t in enumerate(trees):
        if t is None:
            continue
        tokens[i, : len(t.tokens)] = t.tokens
        lens[i] = len(t.tokens)
        for p, leaf in enumerate(t.leaves()):
            path = t.path(leaf)
            paths[i, p, : len(path)] = path
    for name, values in (
        ("spec_decoding_generation_lengths", lengths),
        ("spec_decoding_position_offsets", rows),
        ("spec_decoding_packed_mask", mask),
        ("draft_tokens", tokens),
        ("draft_lens", lens),
        ("draft_paths", paths),
    ):
        view = inp[name]
        view.copy_(torch.from_numpy(values).to(view.dtype).reshape(view.shape))


# --------------------------------------------------------------------------- the engine


class EagleLlama(SpecLlama):
    """``SpecLlama`` reading the Eagle contract's tree inputs: the position offsets at the
    bound row length (max_generation_length), the packed-mask rows of generation request g
    from the sum of the earlier requests' generation lengths.

    `offset_stride` / `mask_stride` (faults, for the tests): read the offsets of request g at
    row stride `offset_stride` of their storage, its mask rows from ``g * mask_stride``."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        *,
        offset_stride: int | None = None,
        mask_stride: int | None = None,
    ) -> None:
        super().__init__(hf_model)
        self.offset_stride, self.mask_stride = offset_stride, mask_stride

    def layout(self, inputs: dict[str, torch.Tensor]) -> list[_Seq]:
        types = inputs["host_request_types"].tolist()
        ctx_lengths = inputs["host_context_lengths"].tolist()
        seq_len = inputs["sequence_length"].cpu().tolist()
        past_kv = inputs["host_past_key_value_lengths"].tolist()
        gen_lengths = inputs["spec_decoding_generation_lengths"].cpu().tolist()
        offsets = inputs["spec_decoding_position_offsets"]
        if self.offset_stride is not None:  # fault: the storage read at another row stride
            offsets = offsets.as_strided(
                (offsets.shape[0], self.offset_stride), (self.offset_stride, 1)
            )
        offsets = offsets.long()
        packed = inputs["spec_decoding_packed_mask"]
        positions = inputs["position_ids"].long()
        if len(gen_lengths) != types.count(1):
            raise ValueError(
                f"{len(gen_lengths)} generation lengths for {types.count(1)} generation requests"
            )
        seqs, tok, pos, g, row = [], 0, 0, 0, 0
        for i, kind in enumerate(types):
            if kind == 0:  # a context chunk: plain causal
                new = ctx_lengths[i]
                past = seq_len[i] - new
                if past_kv[i] != seq_len[i] or past < 0:
                    raise ValueError(f"context sequence {i}: lengths do not agree")
                p = positions[pos : pos + new]
                pos += new
                visible = torch.ones(new, new, dtype=torch.bool, device=p.device).tril()
            else:  # the root, then the drafts: the tree's positions and mask
                new, past = gen_lengths[g], past_kv[i]
                if past + new != seq_len[i] or not 1 <= new <= offsets.shape[1]:
                    raise ValueError(
                        f"generation sequence {i}: past KV length {past} + {new} tree tokens "
                        f"!= sequence length {seq_len[i]}, or over {offsets.shape[1]}"
                    )
                p = positions[pos] + offsets[g, :new]
                pos += 1
                first = row if self.mask_stride is None else g * self.mask_stride
                visible = unpack_mask(packed[first : first + new], new)
                row += new
                g += 1
            seqs.append(_Seq(tok, new, past, p, visible))
            tok += new
        if tok != inputs["input_ids"].numel() or pos != positions.numel():
            raise ValueError(f"the sequences cover {tok} tokens and {pos} positions")
        return seqs


def move_kv(cache: PagedKVCache, offsets: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """Copy the K/V of cache positions `src` to `dst` in every layer (TensorRT-LLM's KV-cache
    rewind after acceptance); `offsets` is the sequence's kv_cache_block_offsets row."""
    device = offsets.device
    s = cache.slots(offsets, torch.tensor(src, device=device))
    d = cache.slots(offsets, torch.tensor(dst, device=device))
    for layer in range(cache.num_layers):
        k, v = cache.read(layer, *s)  # gathered copies: sources read before any write
        cache.write(layer, *d, k, v)


# --------------------------------------------------------------------------- the executor


@dataclasses.dataclass(frozen=True)
class Faults:
    """Deliberate errors, each of which must break the comparison with transformers."""

    mask_stride: int | None = None  # the engine reads request g's mask rows from g * stride
    offset_stride: int | None = None  # the engine reads the position offsets at this stride
    keep_kv: bool = False  # the accepted path's K/V is not moved
    accepted_short: bool = False  # the run's first accepted count >= 1 is reported one short


@dataclasses.dataclass(frozen=True)
class Verification:
    """One generation request's tree verified: `path`, the accepted nodes from the root."""

    step: int
    rid: int
    tree: DraftTree
    path: tuple[int, ...]

    @property
    def proposed(self) -> int:
        return len(self.tree.tokens)

    @property
    def accepted(self) -> int:
        return len(self.path) - 1

    @property
    def outcome(self) -> str:
        """'rejected', 'partial' (stopped above a leaf) or 'full' (down to a leaf)."""
        if not self.accepted:
            return "rejected"
        return "full" if not self.tree.children(self.path[-1]) else "partial"

    @property
    def moved(self) -> bool:
        """Some accepted node is not at its depth's index: its K/V has to move."""
        return any(j != k for k, j in enumerate(self.path))

    @property
    def off_first_branch(self) -> bool:
        return any(not self.tree.is_first_child(j) for j in self.path[1:])


@dataclasses.dataclass(frozen=True)
class StepStats:
    step: int
    context_requests: int
    generation_requests: int
    nodes: int  # tree nodes of the generation requests
    most_drafts: int  # of any generation request this step
    tokens: int
    logits: int
    positions_shape: tuple[int, ...]  # position_ids as bound
    offsets_shape: tuple[int, ...]  # spec_decoding_position_offsets as bound
    mask_shape: tuple[int, ...]  # spec_decoding_packed_mask as bound


@dataclasses.dataclass(eq=False)
class _Flight:
    job: Job
    slot: int
    blocks: list[int]
    position: int = 0  # prompt tokens computed
    generated: list[int] = dataclasses.field(default_factory=list)
    draft: Any = None  # this step's drafter output (a generation request)
    tree: DraftTree | None = None  # its draft tree


class TreeExecutor:
    """In-flight batching of draft-tree verification through a family's ``RuntimeBuffers``
    (``add`` / ``step`` / ``finish``): each step every generation request verifies one draft
    tree, prompt chunks share what is left of the token budget, the accepted path's K/V moves
    onto it. The drafter's and the family's parts are hooks: ``_draft``, ``_write_inputs``,
    ``_accept``, ``_verified``, ``_start`` / ``_finish`` (a request's drafter state)."""

    def __init__(
        self,
        family,
        hf_model: torch.nn.Module,
        model: SpecLlama,
        drafter,
        faults,
        *,
        max_draft_tokens: int,
        token_budget: int,
        max_batch_size: int = 4,
        chunk_size: int = 8,
        tokens_per_block: int = 4,
        max_sequence_length: int = 64,
        **config,
    ) -> None:
        """`config`: the family's own Config fields."""
        cfg = hf_model.config
        dtype = next(hf_model.parameters()).dtype
        if token_budget <= max_batch_size * (1 + max_draft_tokens):
            raise ValueError(f"a token budget of {token_budget} cannot hold every draft tree")
        self.config = family.Config(
            max_batch_size=max_batch_size,
            max_num_tokens=token_budget,
            max_draft_tokens=max_draft_tokens,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_hidden_layers,
            max_attention_window=max_sequence_length,
            tokens_per_block=tokens_per_block,
            logits_dtype=dtype,
            **config,
        )
        self.buffers = family.RuntimeBuffers(self.config)
        self.model, self.drafter, self.faults = model, drafter, faults
        blocks = max_batch_size * self.config.max_blocks_per_seq + BlockAllocator.RESERVED
        self.allocator = BlockAllocator(blocks)
        self.cache = PagedKVCache.for_model(model, blocks, tokens_per_block, dtype, "cpu")
        self.token_budget, self.chunk_size = token_budget, chunk_size

    def _draft(self, a: _Flight) -> tuple[Any, DraftTree]:
        raise NotImplementedError  # the drafter's output for a generation request, its tree

    def _write_inputs(self, step, drafts: list) -> None:
        raise NotImplementedError  # the drafter's tensors; drafts[i] None: a context request

    def _accept(self, step, row: int, tree: DraftTree, greedy: Sequence[int]) -> list[int]:
        raise NotImplementedError  # the accepted nodes, root first; greedy: argmax per node

    def _verified(self, index: int, a: _Flight, path, greedy, committed) -> Any:
        raise NotImplementedError  # a's Verification (None: none); committed: with the new

    def _start(self, job: Job) -> None:
        """A request was added."""

    def _finish(self, a: _Flight) -> None:
        """A request has its tokens."""

    def run(self, jobs: Iterable[Job]) -> SpecResult:
        """Serve `jobs` to completion: arrivals by step, add / step / finish."""
        buffers, mbs = self.buffers, self.config.max_batch_size
        pending = deque(sorted(jobs, key=lambda j: (j.arrival_step, j.rid)))
        waiting: deque[Job] = deque()
        active: dict[int, _Flight] = {}  # by seq slot, in arrival order
        free_slots = list(range(mbs - 1, -1, -1))
        rids = [j.rid for j in pending]
        result = SpecResult({r: [] for r in rids}, {r: [] for r in rids}, [], [], [])
        tokens = np.zeros(mbs, np.int64)  # what each slot sampled (the bonus token), by slot
        accepted: dict[int, int] = {}
        produced, step_index, shorted = False, 0, False
        while pending or waiting or active:
            while pending and pending[0].arrival_step <= step_index:
                waiting.append(pending.popleft())
            while waiting and free_slots:
                job = waiting.popleft()
                slot = free_slots.pop()
                active[slot] = _Flight(job, slot, [])
                buffers.add(Request(seq_slot=slot, prompt=list(job.prompt), kv_block_ids=[[]]))
                self._start(job)
            chunks, drafts, blocks = self._schedule(active)
            if not chunks and not any(a.tree for a in active.values()):
                step_index += 1
                continue
            step = buffers.step(
                tokens if produced else None,
                accepted=accepted,
                drafts=drafts,
                chunks=chunks,
                blocks=blocks,
            )
            slots = buffers.tensors["seq_slots"][: step.sizes.num_requests].tolist()
            rows = [active[s] for s in slots]
            self._write_inputs(step, [None if a.slot in chunks else a.draft for a in rows])
            self.model.forward(step, self.cache)
            result.steps.append(_stats(step_index, step, rows, chunks))
            accepted, producers = self._verify(step, step_index, rows, chunks, result, tokens)
            for a in rows:
                if len(a.generated) == a.job.max_new_tokens:
                    del active[a.slot]
                    buffers.finish(a.slot)
                    self._finish(a)
                    self.allocator.release(a.blocks)
                    free_slots.append(a.slot)
            produced = any(s in active for s in producers)
            accepted = {s: n for s, n in accepted.items() if s in active}
            slot = next((s for s, n in accepted.items() if n), None)
            if self.faults.accepted_short and not shorted and slot is not None:
                accepted[slot] -= 1  # fault: one count one short
                shorted = True
            step_index += 1
        return result

    def _schedule(self, active: dict[int, _Flight]):
        """Every generation request its draft tree (1 + drafts tokens), then prompt chunks in
        arrival order from what is left of the token budget; the KV blocks each needs for its
        tokens after the step. Returns ({slot: chunk}, {slot: drafts}, {slot: new blocks})."""
        budget, need = self.token_budget, {}
        for a in active.values():
            a.draft = a.tree = None
            if a.position == len(a.job.prompt):
                a.draft, a.tree = self._draft(a)
                budget -= a.tree.size
                need[a.slot] = len(a.job.prompt) + len(a.generated) + len(a.tree.tokens)
        waiting = [a for a in active.values() if a.position < len(a.job.prompt)]
        left = [len(a.job.prompt) - a.position for a in waiting]
        _, sizes = split_budget(budget, self.chunk_size, 0, left)
        chunks = {a.slot: n for a, n in zip(waiting, sizes) if n}
        need.update((s, active[s].position + n) for s, n in chunks.items())
        blocks = {}
        for slot, n in need.items():
            a = active[slot]
            before = len(a.blocks)
            grow_blocks(a.blocks, n, self.config.tokens_per_block, self.allocator)
            if len(a.blocks) > before:
                blocks[slot] = a.blocks[before:]
        drafts = {a.slot: list(a.tree.tokens) for a in active.values() if a.tree and a.tree.tokens}
        return chunks, drafts, blocks

    def _verify(self, step, index, rows, chunks, result, tokens):
        """Each row's logits: a last prompt chunk samples its first token; a draft tree is
        accepted (``_accept``), its nodes' K/V moved onto the accepted path, the bonus token
        sampled at the last accepted node. Every logit row is recorded (a generation
        request's along each root-to-leaf path). Returns the drafts each slot accepted and
        the slots that produced tokens (each one's last in `tokens`)."""
        logits = step.outputs["logits"][:, : self.config.vocab_size]
        greedy = logits.argmax(dim=-1).tolist()
        past = step.inputs["host_past_key_value_lengths"].tolist()
        offsets = step.inputs["kv_cache_block_offsets"][0]
        accepted, producers, r = {}, [], 0
        for i, a in enumerate(rows):
            job = a.job
            if a.slot in chunks:
                a.position += chunks[a.slot]
                row = logits[r : r + 1].clone()  # a chunk's last token
                result.records.append(
                    LogitRecord(index, job.rid, job.prompt[: a.position], a.position - 1, row)
                )
                r += 1
                if a.position < len(job.prompt):
                    continue
                new = [greedy[r - 1]]
            else:
                tree, committed = a.tree, (*job.prompt, *a.generated)
                for leaf in tree.leaves():
                    path = tree.path(leaf)
                    drafted = committed + tuple(tree.token(j) for j in path[1:])
                    rows_of_path = logits[[r + j for j in path]].clone()
                    result.records.append(
                        LogitRecord(index, job.rid, drafted, len(committed) - 1, rows_of_path)
                    )
                at = greedy[r : r + tree.size]
                path = self._accept(step, i, tree, at)
                new = [tree.token(j) for j in path[1:]] + [greedy[r + path[-1]]]
                if len(path) > 1 and not self.faults.keep_kv:
                    src = [past[i] + j for j in path[1:]]
                    move_kv(self.cache, offsets[i], src, [past[i] + k for k in range(1, len(path))])
                verification = self._verified(index, a, path, at, committed + tuple(new))
                if verification is not None:
                    result.verifications.append(verification)
                    accepted[a.slot] = len(path) - 1
                r += tree.size
            new = new[: job.max_new_tokens - len(a.generated)]
            a.generated += new
            result.tokens[job.rid] += new
            result.token_steps[job.rid] += [index] * len(new)
            tokens[a.slot] = new[-1]
            producers.append(a.slot)
        return accepted, producers


def _stats(index: int, step, rows: list[_Flight], chunks: Mapping[int, int]) -> StepStats:
    trees = [a.tree for a in rows if a.slot not in chunks]
    inp = step.inputs
    return StepStats(
        step=index,
        context_requests=len(rows) - len(trees),
        generation_requests=len(trees),
        nodes=sum(t.size for t in trees),
        most_drafts=max((len(t.tokens) for t in trees), default=0),
        tokens=step.sizes.num_tokens,
        logits=step.sizes.num_logits,
        positions_shape=tuple(inp["position_ids"].shape),
        offsets_shape=tuple(inp["spec_decoding_position_offsets"].shape),
        mask_shape=tuple(inp["spec_decoding_packed_mask"].shape),
    )


class EagleExecutor(TreeExecutor):
    """In-flight batching of Eagle tree verification through ``eagle.RuntimeBuffers``."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        drafter: TreeDrafter,
        *,
        max_draft_tokens: int = 6,
        max_draft_path_len: int = 3,
        token_budget: int = 40,
        faults: Faults = Faults(),
        **options,
    ) -> None:
        """`options`: ``TreeExecutor``'s (max_batch_size, chunk_size, tokens_per_block,
        max_sequence_length)."""
        model = EagleLlama(
            hf_model, offset_stride=faults.offset_stride, mask_stride=faults.mask_stride
        )
        super().__init__(
            eagle, hf_model, model, drafter, faults, max_draft_tokens=max_draft_tokens,
            token_budget=token_budget, max_draft_path_len=max_draft_path_len, **options,
        )  # fmt: skip

    def _draft(self, a: _Flight) -> tuple[DraftTree, DraftTree]:
        tree = self.drafter.draft(a.job.rid, len(a.generated))
        return tree, tree

    def _write_inputs(self, step, drafts: list) -> None:
        write_tree_inputs(step, drafts)

    def _accept(self, step, row: int, tree: DraftTree, greedy: Sequence[int]) -> list[int]:
        """Greedy from the root (``accept``); ``accept_on_paths`` on the step's draft_tokens
        and draft_paths (the drafter's, read back from the step) must agree."""
        path = accept(tree, greedy)
        on_paths = accept_on_paths(
            step.inputs["draft_tokens"][row].tolist(),
            step.inputs["draft_paths"][row].tolist(),
            greedy,
        )
        if on_paths != path:
            raise AssertionError(f"paths accept {on_paths}, the tree walk {path}")
        return path

    def _verified(self, index, a, path, greedy, committed) -> Verification | None:
        """A tree with drafts; none for a request without."""
        if not a.tree.tokens:
            return None
        return Verification(index, a.job.rid, a.tree, tuple(path))


def accept(tree: DraftTree, greedy: Sequence[int]) -> list[int]:
    """Greedy acceptance: from the root, while a child of the current node carries the base
    model's argmax at that node (`greedy[node]`), move to it. The accepted nodes, root first."""
    path = [0]
    while True:
        want = greedy[path[-1]]
        nxt = next((c for c in tree.children(path[-1]) if tree.token(c) == want), None)
        if nxt is None:
            return path
        path.append(nxt)


def accept_on_paths(tokens: list[int], paths: list[list[int]], greedy: Sequence[int]) -> list[int]:
    """The same acceptance over a request's draft paths, as TensorRT-LLM's decoder reads them
    (`tokens`: its draft_tokens row, node j >= 1 being ``tokens[j - 1]``; `paths`: its
    draft_paths rows, node indices padded with -1): the longest accepted prefix of any path,
    the first on ties."""
    best = [0]
    for row in paths:
        path = [j for j in row if j >= 0]
        k = 1
        while k < len(path) and tokens[path[k] - 1] == greedy[path[k - 1]]:
            k += 1
        if k > len(best):
            best = path[:k]
    return best


def workload(
    n: int = 10, *, seed: int = 0, vocab_size: int = 512, max_prompt: int = 24
) -> list[Job]:
    """`n` requests arriving over the first `n` steps: prompts of 1 to `max_prompt` tokens,
    2 to 16 new tokens each."""
    rng = random.Random(seed)
    lengths = [1, max_prompt] + [rng.randint(1, max_prompt) for _ in range(n - 2)]
    return random_jobs(rng, lengths, vocab_size=vocab_size, new_tokens=(2, 16), last_arrival=n)
