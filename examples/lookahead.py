"""Lookahead decoding on a real model through the generated ``lookahead`` buffers.

TensorRT-LLM's lookahead runtime (Jacobi decoding with an n-gram pool, Fu et al. 2024) verifies
in one base-model step per generation request the tokens of a Jacobi window and a few n-gram
guesses, laid out as one tree; this module plays every part around bufc's buffers:

* ``LookaheadDrafter``: TensorRT-LLM's ``LookaheadAlgorithm`` for a window of W columns, n-grams
  of N tokens and G guesses, one state per request: the window (W columns of N - 1 tokens,
  started from prompt tokens, where TensorRT-LLM first fills it level by level) and an
  ``NgramPool`` (its ``LookaheadPoolManager``: at most G n-grams per first token, the most
  recent last; the prompt's, the window's and the accepted tokens' n-grams). Each step it lays
  out the lookahead branch (column 0 after the root, column w from position root + w) and the
  pool's guesses for the last token (each from root + 1), and ``encode`` turns the positions
  into parents (``posIdsToMask``) and merges equal prefixes into a trie, numbered depth first
  (``treeEncode``). After the step each column shifts by the base model's argmax at its last
  token, its n-gram joins the pool, and so do the accepted tokens'. With ``truth`` (the
  greedy continuation) it now and then guesses a noisy copy of it too, as a pool warmed
  elsewhere would, so that runs have rejected, partly and fully accepted guesses.
* ``write_lookahead_inputs``: the drafter's part of the step, written into the step's bound
  views after ``step()`` returns and before the engine runs: the generation part of
  ``position_ids`` (bound per token; each node at the root's position plus its depth, as
  TensorRT-LLM's LookaheadRuntimeBuffers copies the decoder's positionIds there),
  ``spec_decoding_generation_lengths`` (the tree's size), ``spec_decoding_position_offsets``
  (row g at the bound row length, max_generation_length: each node's depth) and
  ``spec_decoding_packed_mask`` (request g's rows dense from the sum of the earlier requests'
  generation lengths; bit j of row i: node j is an ancestor-or-self of node i).
* ``LookaheadLlama``: ``eagle.EagleLlama``'s layout, but each generation token's RoPE position
  is its own ``position_ids`` entry, which must equal the root's position plus its
  ``spec_decoding_position_offsets`` entry (ValueError otherwise); it reads only the step's
  engine inputs and writes one logit row per context request and per tree node.
* ``LookaheadExecutor``: ``eagle.TreeExecutor``'s in-flight batching over ``add`` / ``step`` /
  ``finish`` (arrivals, chunked prefill, a token budget, finishes and slot reuse, a paged KV
  pool) with the drafter's state per request; greedy
  verification as TensorRT-LLM's ``verify`` (the longest path of drafts equal to the base
  model's argmax, at most N - 1 drafts); the accepted nodes' K/V moved onto the path
  (``eagle.move_kv``); ``step(tokens, accepted={slot: n}, drafts=...)`` with the bonus token.

tests/test_lookahead_model.py proves with it that every request's tokens equal
``transformers.generate`` (greedy), that every logit row equals the Hugging Face model's logits
at its position, and that each deliberate error (``Faults``) breaks that comparison or is
refused by the engine. ``python -m bufc.examples.lookahead`` runs a workload and prints the
acceptance.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from bufc.generated import lookahead

from . import eagle
from .compare import assert_same_tokens, reference_tokens, threads_option, tiny_llama, torch_threads
from .eagle import DraftTree, EagleLlama, TreeExecutor, accept, pack_mask, workload
from .executor import Job
from .speculative import HFLogits, SpecResult, assert_logits_match

# --------------------------------------------------------------------------- the drafter


class NgramPool:
    """TensorRT-LLM's LookaheadPoolManager: continuations of `n - 1` tokens by the token before
    them, at most `size` per key, the most recent last (one seen again moves to the end)."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size
        self.grams: dict[int, list[tuple[int, ...]]] = {}

    def insert(self, key: int, gram: Sequence[int]) -> None:
        if not self.size:
            return
        gram = tuple(gram)
        kept = [g for g in self.grams.get(key, []) if g != gram]
        self.grams[key] = [*kept[max(0, len(kept) - self.size + 1) :], gram]

    def fill(self, tokens: Sequence[int]) -> None:
        """Every n-gram of `tokens`."""
        for i in range(len(tokens) - self.n + 1):
            self.insert(tokens[i], tokens[i + 1 : i + self.n])

    def guess(self, key: int) -> list[tuple[int, ...]]:
        return list(self.grams.get(key, ()))


def encode(
    tokens: Sequence[int], positions: Sequence[int], root: int
) -> tuple[DraftTree, list[int]]:
    """TensorRT-LLM's posIdsToMask then treeEncode: token i's parent is the last earlier token
    still open at ``positions[i] - 1`` (the root, at `root`, below all), and tokens reached
    from the root through the same tokens merge into one node. Nodes are numbered depth first,
    children in the order first seen. Returns the tree and the node of each token."""
    parent_of, stack = [], []
    for i, p in enumerate(positions):
        while stack and p <= positions[stack[-1]]:
            stack.pop()
        below = positions[stack[-1]] if stack else root
        if p != below + 1:
            raise ValueError(f"draft token {i} at position {p} does not follow position {below}")
        parent_of.append(stack[-1] if stack else -1)
        stack.append(i)
    kids: list[dict[int, int]] = [{}]  # trie node -> {token: child}, in the order first seen
    trie_of: list[int] = []
    for i, t in enumerate(tokens):
        up = kids[trie_of[parent_of[i]]] if parent_of[i] >= 0 else kids[0]
        if t not in up:
            up[t] = len(kids)
            kids.append({})
        trie_of.append(up[t])
    number, out_tokens, out_parents = {0: 0}, [], []

    def visit(node: int) -> None:
        for t, child in kids[node].items():
            number[child] = len(number)
            out_tokens.append(t)
            out_parents.append(number[node])
            visit(child)

    visit(0)
    return DraftTree(tuple(out_tokens), tuple(out_parents)), [number[n] for n in trie_of]


@dataclasses.dataclass(frozen=True)
class LookaheadDraft:
    """One request's tree for one step: node 0 is the root (its last token, at
    `root_position`); `column_ends` the node of each window column's last token (whose argmax
    shifts the column); `sources` which drafts reached each node ("window", "pool", "hint")."""

    tree: DraftTree
    root_position: int
    column_ends: tuple[int, ...]
    sources: tuple[frozenset[str], ...]

    @property
    def positions(self) -> list[int]:
        return [self.root_position + d for d in self.tree.depths]


@dataclasses.dataclass
class _State:
    columns: list[list[int]]  # W columns of N - 1 tokens; column 0's first is the root's place
    pool: NgramPool
    prompt: int  # prompt tokens


class LookaheadDrafter:
    """Lookahead decoding's drafts (window `window`, n-grams of `ngram` tokens, `guesses`
    guesses), one state per request (``start`` / ``draft`` / ``update`` / ``finish``).

    `truth` (by request id, the greedy continuation): with probability `hint` a step's guesses
    include its next N - 1 tokens, each replaced by another with probability `noise`, at a
    random place among the pool's (all decided by a seeded RNG keyed by the request and the
    tokens generated)."""

    def __init__(
        self,
        window: int = 2,
        ngram: int = 4,
        guesses: int = 2,
        *,
        truth: Mapping[int, Sequence[int]] | None = None,
        vocab_size: int = 512,
        hint: float = 0.0,
        noise: float = 0.3,
        seed: int = 0,
    ) -> None:
        if window < 1 or ngram < 3 or guesses < 0 or (truth is not None and guesses < 1):
            raise ValueError(f"window {window}, ngram {ngram}, guesses {guesses}")
        self.w, self.n, self.g = window, ngram, guesses
        self.truth, self.vocab, self.hint, self.noise, self.seed = (
            truth, vocab_size, hint, noise, seed,
        )  # fmt: skip
        self.states: dict[int, _State] = {}

    @property
    def max_draft_tokens(self) -> int:
        """TensorRT-LLM's calculateSpeculativeResource: N - 2 + (W - 1 + G)(N - 1)."""
        return self.n - 2 + (self.w - 1 + self.g) * (self.n - 1)

    def start(self, rid: int, prompt: Sequence[int]) -> None:
        rng = random.Random(f"{self.seed}:{rid}:window")
        pool = NgramPool(self.n, self.g)
        pool.fill(prompt)
        columns = [[rng.choice(prompt) for _ in range(self.n - 1)] for _ in range(self.w)]
        self.states[rid] = _State(columns, pool, len(prompt))

    def finish(self, rid: int) -> None:
        del self.states[rid]

    def draft(self, rid: int, committed: Sequence[int]) -> LookaheadDraft:
        """The tree verified after `committed` (prompt and generated tokens; the last is the
        root): the window's columns, then the guesses for the root token."""
        s = self.states[rid]
        root, at = committed[-1], len(committed) - 1
        tokens: list[int] = []
        positions: list[int] = []
        labels: list[str] = []
        ends = []
        for w, column in enumerate(s.columns):
            part = column[1:] if w == 0 else column
            first = at + max(w, 1)
            tokens += part
            positions += range(first, first + len(part))
            labels += ["window"] * len(part)
            ends.append(len(tokens) - 1)
        for gram, label in self._guesses(rid, s, root, len(committed) - s.prompt):
            tokens += gram
            positions += range(at + 1, at + self.n)
            labels += [label] * len(gram)
        tree, node_of = encode(tokens, positions, at)
        sources: list[set[str]] = [set() for _ in range(tree.size)]
        for i, label in enumerate(labels):
            sources[node_of[i]].add(label)
        return LookaheadDraft(
            tree, at, tuple(node_of[i] for i in ends), tuple(map(frozenset, sources))
        )

    def _guesses(self, rid: int, s: _State, root: int, generated: int):
        """The pool's guesses for `root` (at most G), with the hint among them when drawn."""
        pool = [(g, "pool") for g in s.pool.guess(root)]
        if self.truth is None:
            return pool
        rng = random.Random(f"{self.seed}:{rid}:{generated}")
        if rng.random() >= self.hint:
            return pool
        truth, gram = self.truth[rid], []
        for at in range(generated, generated + self.n - 1):  # the generated tokens it guesses
            right = truth[at] if at < len(truth) else rng.randrange(self.vocab)
            if rng.random() < self.noise:
                right = (right + 1 + rng.randrange(self.vocab - 1)) % self.vocab
            gram.append(right)
        pool = pool[max(0, len(pool) - self.g + 1) :]  # room for the hint
        pool.insert(rng.randrange(len(pool) + 1), (tuple(gram), "hint"))
        return pool

    def update(
        self, rid: int, draft: LookaheadDraft, greedy: Sequence[int], committed: Sequence[int]
    ) -> None:
        """After the step that verified `draft`: `greedy` is the base model's argmax at each
        node, `committed` the request's tokens now (the accepted ones and the bonus after the
        draft's root). Each column shifts up by its last token's argmax and its n-gram (from
        the token before the column) joins the pool, as do the new tokens' n-grams."""
        s = self.states[rid]
        root = draft.root_position
        for w, column in enumerate(s.columns):
            key = committed[root] if w == 0 else column[0]
            shifted = [*column[1:], greedy[draft.column_ends[w]]]
            s.pool.insert(key, shifted)
            s.columns[w] = shifted
        for i in range(max(0, root + 1 - self.n + 1), len(committed) - self.n + 1):
            s.pool.insert(committed[i], committed[i + 1 : i + self.n])


def write_lookahead_inputs(
    step,
    drafts: Sequence[LookaheadDraft | None],
    *,
    position_shift: int = 0,
    mask_stride: int | None = None,
    offset_stride: int | None = None,
) -> None:
    """The drafter's tensors of one step, written into its bound views. `drafts` has one entry
    per sequence of the step, in row order: None for a context request, the draft of a
    generation request. The fault arguments (for the tests): every generation position
    `position_shift` off, request g's mask rows from ``g * mask_stride``, the offsets written at
    row stride `offset_stride` of their storage."""
    inp = step.inputs
    gen = [d for d in drafts if d is not None]
    offsets, packed = inp["spec_decoding_position_offsets"], inp["spec_decoding_packed_mask"]
    tail = inp["position_ids"][step.sizes.num_context_tokens :]  # the generation tokens'
    if offset_stride is not None:  # fault: the rows at another stride of the storage
        offsets = offsets.as_strided((offsets.shape[0], offset_stride), (offset_stride, 1))
    words = packed.shape[1]
    lengths = np.array([d.tree.size for d in gen], np.int32)
    if lengths.sum() != tail.numel():
        raise ValueError(f"{lengths.sum()} tree nodes for {tail.numel()} generation tokens")
    rows = np.zeros(tuple(offsets.shape), np.int32)
    mask = np.zeros(tuple(packed.shape), np.int32)
    positions = np.zeros(tail.numel(), np.int32)
    start = 0  # request g's tokens and mask rows start after the earlier requests' nodes
    for g, d in enumerate(gen):
        size = d.tree.size
        rows[g, :size] = d.tree.depths
        first = start if mask_stride is None else g * mask_stride
        mask[first : first + size] = pack_mask(d.tree.mask(), words)
        positions[start : start + size] = np.array(d.positions) + position_shift
        start += size
    for view, values in (
        (inp["spec_decoding_generation_lengths"], lengths),
        (offsets, rows),
        (packed, mask),
        (tail, positions),
    ):
        view.copy_(torch.from_numpy(values).to(view.dtype).reshape(view.shape))


# --------------------------------------------------------------------------- the engine


class LookaheadLlama(EagleLlama):
    """``EagleLlama`` with ``position_ids`` bound per token: the tree's layout, lengths, mask
    rows and offsets read as Eagle's (from each generation request's first position), then
    every token's own position, which must equal its root's plus its offset."""

    def layout(self, inputs):
        per_token = inputs["position_ids"]
        types = inputs["host_request_types"].tolist()
        lengths = inputs["host_context_lengths"].tolist()
        gen_lengths = inputs["spec_decoding_generation_lengths"].cpu().tolist()
        if len(gen_lengths) != types.count(1):
            raise ValueError(f"{len(gen_lengths)} generation lengths, {types.count(1)} requests")
        keep, tok, g = [], 0, 0  # the context tokens' positions and each root's
        for i, kind in enumerate(types):
            new = lengths[i] if kind == 0 else gen_lengths[g]
            keep += range(tok, tok + new) if kind == 0 else [tok]
            tok, g = tok + new, g + kind
        if tok != per_token.numel():
            raise ValueError(f"the sequences cover {tok} tokens, position_ids {per_token.numel()}")
        index = torch.tensor(keep, dtype=torch.long, device=per_token.device)
        seqs = super().layout({**inputs, "position_ids": per_token[index]})
        out = []
        for i, s in enumerate(seqs):
            own = per_token[s.start : s.start + s.new].long()
            if not torch.equal(own, s.positions):
                raise ValueError(
                    f"sequence {i}: position_ids {own.tolist()} disagree with its first "
                    f"position plus spec_decoding_position_offsets, {s.positions.tolist()}"
                )
            out.append(dataclasses.replace(s, positions=own))
        return out


# --------------------------------------------------------------------------- the executor


@dataclasses.dataclass(frozen=True)
class Faults:
    """Deliberate errors, each of which must break the comparison with transformers (or, for
    `offset_stride`, be refused by the engine)."""

    position_shift: int = 0  # the drafter writes every generation position this far off
    mask_stride: int | None = None  # the drafter writes request g's mask rows from g * stride
    offset_stride: int | None = None  # the drafter writes the offsets at this row stride
    keep_kv: bool = False  # the accepted nodes' K/V is not moved
    accepted_short: bool = False  # the run's first accepted count >= 1 is reported one short


@dataclasses.dataclass(frozen=True)
class Verification(eagle.Verification):
    """``eagle.Verification`` of a lookahead draft, at most `cap` (N - 1) drafts accepted."""

    draft: LookaheadDraft
    cap: int

    @property
    def outcome(self) -> str:
        """'rejected', 'partial' (stopped above a leaf, below the cap) or 'full'."""
        if not self.accepted:
            return "rejected"
        stop = self.accepted == self.cap or not self.tree.children(self.path[-1])
        return "full" if stop else "partial"

    @property
    def via(self) -> frozenset[str]:
        """Which drafts reached the last accepted node (empty when rejected)."""
        return self.draft.sources[self.path[-1]] if self.accepted else frozenset()


class LookaheadExecutor(TreeExecutor):
    """In-flight batching of lookahead decoding through ``lookahead.RuntimeBuffers``: the
    drafter's state started on ``add`` and dropped on ``finish``, updated after each step."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        drafter: LookaheadDrafter,
        *,
        token_budget: int = 64,
        faults: Faults = Faults(),
        **options,
    ) -> None:
        """`options`: ``eagle.TreeExecutor``'s (max_batch_size, chunk_size, tokens_per_block,
        max_sequence_length)."""
        k = drafter.max_draft_tokens
        super().__init__(
            lookahead, hf_model, LookaheadLlama(hf_model), drafter, faults,
            max_draft_tokens=k, token_budget=token_budget, **options,
        )  # fmt: skip

    def _start(self, job: Job) -> None:
        self.drafter.start(job.rid, job.prompt)

    def _finish(self, a) -> None:
        self.drafter.finish(a.job.rid)

    def _draft(self, a) -> tuple[LookaheadDraft, DraftTree]:
        draft = self.drafter.draft(a.job.rid, (*a.job.prompt, *a.generated))
        return draft, draft.tree

    def _write_inputs(self, step, drafts: list) -> None:
        f = self.faults
        write_lookahead_inputs(
            step,
            drafts,
            position_shift=f.position_shift,
            mask_stride=f.mask_stride,
            offset_stride=f.offset_stride,
        )

    def _accept(self, step, row: int, tree: DraftTree, greedy: Sequence[int]) -> list[int]:
        """TensorRT-LLM's ``verify``: ``eagle.accept`` (from the root, the child carrying the
        base model's argmax), at most N - 1 drafts."""
        cap = self.drafter.n - 1
        return accept(tree, greedy)[: cap + 1]

    def _verified(self, index, a, path, greedy, committed) -> Verification:
        """The verification; the drafter updated with the step's argmax and tokens."""
        d = a.draft
        self.drafter.update(a.job.rid, d, greedy, committed)
        return Verification(index, a.job.rid, d.tree, tuple(path), d, self.drafter.n - 1)


def acceptance(result: SpecResult) -> str:
    """One line: drafts accepted, outcomes, what the accepted paths came from."""
    vs = result.verifications
    outcomes = Counter(v.outcome for v in vs)
    via = Counter("+".join(sorted(v.via)) for v in vs if v.accepted)
    moved = sum(v.moved for v in vs)
    return (
        f"{len(vs)} trees, drafts accepted {result.accepted}/{result.proposed}; "
        f"{dict(outcomes)}; accepted via {dict(via)}; K/V moved {moved}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--window", type=int, default=3, help="W, the Jacobi window's columns")
    p.add_argument("--ngram", type=int, default=4, help="N, tokens of an n-gram (>= 3)")
    p.add_argument("--guesses", type=int, default=2, help="G, n-grams verified per step")
    p.add_argument("--hint", type=float, default=0.5, help="chance of a noisy true guess")
    p.add_argument("--seed", type=int, default=1)
    threads_option(p)
    a = p.parse_args(argv)
    with torch_threads(a.threads):
        model = tiny_llama(0)
        jobs = workload(a.requests, seed=a.seed)
        reference = reference_tokens(model, jobs)
        truth = reference if a.hint else None
        drafter = LookaheadDrafter(
            a.window, a.ngram, a.guesses, truth=truth, hint=a.hint, seed=a.seed
        )
        k = drafter.max_draft_tokens
        ex = LookaheadExecutor(model, drafter, token_budget=4 * k + 12, max_sequence_length=128)
        result = ex.run(jobs)
        worst = assert_logits_match(result, HFLogits(model))
        assert_same_tokens(result, reference)
    print(f"requests {len(jobs)}, W N G = {a.window} {a.ngram} {a.guesses}, K = {k}")
    print(f"steps {len(result.steps)}, max |logits - HF| {worst:.2e}")
    print(f"acceptance: {acceptance(result)}")
    print(f"result: all {len(jobs)} requests match transformers.generate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
