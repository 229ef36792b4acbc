"""Adversarial scenarios for steps continued in place (``requests.step._continued`` and the
continue forms): two RuntimeBuffers of one family take identical calls, one continuing steps
in place, the other (``_continuing = False``) running every step in full; after every call the
two must agree (every tensor, the step's sizes, scalars and views), a call refused by one must
be refused by the other, and a refused call changes nothing (on either). The messages are
compared only where a test asks (``same_message``): a continued step words a short KV list
its own way (test_continue.py holds it to that wording).

Each scenario also checks that the path it targets was taken (continued, full or steady), so
a scenario that drifts off the continue path is noticed.

Found by this battery, and fixed: a step after a generation=False step (whose rows produced no
token) was continued as if every row had produced one (test_*generation_false*, test_sat_out_*);
a steady step took `chunks` for a slot not in its context phase, which a full step refuses
(test_a_steady_step_ignores_chunks); a prompt finished right after its last chunk kept the
buffers "in flight" for prepare_step (test_prepare_step_after_every_request_finished).
"""

from __future__ import annotations

import contextlib
import copy
import random

import numpy as np
import pytest
import torch
from fuzz_configs import make_buffers
from test_continue import _pair, _same

from bufc.requests import step as request_step
from bufc.runtime import BatchError, Request

FAMILIES = ("llama", "gpt")


class Twins:
    """Both buffers of `_pair`, driven by identical calls and compared after each."""

    def __init__(
        self, name: str, tpb: int = 2, device_tokens: bool = False, both_on_device: bool = False
    ) -> None:
        """`device_tokens`: ours takes tokens on the device (the full twin on the host);
        `both_on_device`: both do (a token out of the vocabulary is then refused one step
        later by both)."""
        self.name = name
        self.ours, self.full = _pair(name, tpb, device_tokens or both_on_device)
        if both_on_device:
            kw = dict(max_batch_size=12, max_beam_width=1, tokens_per_block=tpb, num_kv_blocks=0)
            if name == "llama":
                kw["max_attention_window"] = 32 * tpb
            self.full = make_buffers(name, "cpu", device_tokens=True, **kw)
            self.full._continuing = False
            device_tokens = True
        self.c = self.ours.config
        self.paged = hasattr(self.c, "max_blocks_per_seq")
        self.device_tokens = device_tokens
        self.paths: list[str] = []  # ours: the path each successful step took
        self.steps = 0
        self.next_block = 1

    # ---------------------------------------------------------------- the caller's calls
    def ids(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def request(self, slot: int, prompt, blocks: int | None = None, extra: int = 4) -> Request:
        """A request for `slot` with `prompt`, and (paged) a list covering it plus `extra`."""
        prompt = list(prompt)
        kv = None
        if self.paged:
            tpb = self.c.tokens_per_block
            n = -(-len(prompt) // tpb) + extra if blocks is None else blocks
            kv = [self.ids(min(n, self.c.max_blocks_per_seq))]
        return Request(seq_slot=slot, prompt=prompt, kv_block_ids=kv)

    def add(self, r: Request) -> None:
        errors = []
        for b, req in ((self.ours, r), (self.full, copy.deepcopy(r))):
            try:
                b.add(req)
                errors.append(None)
            except BatchError as e:
                errors.append(str(e))
        assert errors[0] == errors[1], errors
        if errors[0] is not None:
            raise BatchError(errors[0])

    def finish(self, slot: int) -> None:
        for b in (self.ours, self.full):
            b.finish(slot)

    def step(
        self, tokens=None, *, expect: str | None = None, full_tokens=None, same_message=False, **kw
    ):
        """One step on both; `expect`: the path ours must take ('continued', 'full',
        'steady'), or 'refused' (both raise BatchError, nothing changes)."""
        where = (self.name, self.steps)
        before = self._snapshot()
        log: list[str] = []
        real_continued, real_steady = request_step._continued, request_step._steady

        def continued(*args, **kwargs):
            plan = real_continued(*args, **kwargs)
            log.append("continued" if plan is not None else "full")
            return plan

        def steady(*args, **kwargs):
            log.append("steady")
            return real_steady(*args, **kwargs)

        results = []
        for b, given in (
            (self.ours, tokens),
            (self.full, tokens if full_tokens is None else full_tokens),
        ):
            kwargs = {k: (dict(v) if isinstance(v, dict) else v) for k, v in kw.items()}
            kwargs = copy.deepcopy(kwargs)
            with pytest.MonkeyPatch.context() as mp:
                if b is self.ours:
                    mp.setattr(request_step, "_continued", continued)
                    mp.setattr(request_step, "_steady", steady)
                try:
                    results.append(("ok", b.step(given, **kwargs)))
                except BatchError as e:
                    results.append(("error", str(e)))
        (ka, a), (kb, bb) = results
        assert ka == kb, (
            f"{where}: ours {'refused: ' + a if ka == 'error' else 'took the step'}, "
            f"full {'refused: ' + bb if kb == 'error' else 'took it'} (paths {self.paths})"
        )
        if ka == "error":
            if same_message:
                assert a == bb, (where, a, bb)
            after = self._snapshot()
            for which, snap in (("ours", 0), ("full", 1)):
                for k in before[snap]:
                    assert torch.equal(before[snap][k], after[snap][k]), (which, k, where)
            self.paths.append("refused")
            if expect is not None:
                assert expect == "refused", (where, a)
            self.steps += 1
            return None
        path = log[0] if log else "full"
        self.paths.append(path)
        host = not self.device_tokens
        diff = _diff(self.ours, self.full, a, bb, host)
        assert not diff, f"{where} {path} {self.paths}\n" + "\n".join(map(str, diff))
        _same(self.ours, self.full, a, bb, where, host=host)
        if expect is not None:
            assert path == expect, (where, path, expect, self.paths)
        self.steps += 1
        return a

    def _snapshot(self):
        if self.device_tokens:
            return [{}, {}]
        return [{k: v.clone() for k, v in b.tensors.items()} for b in (self.ours, self.full)]

    def check(self) -> None:
        """Every tensor of both (device tokens: once they are back)."""
        for name, t in self.ours.tensors.items():
            assert torch.equal(t, self.full.tensors[name]), (name, self.steps)

    def tokens(self, value: int | None = None, seed: int | None = None) -> np.ndarray:
        n = self.c.max_batch_size
        if value is not None:
            return np.full(n, value, np.int64)
        rng = random.Random(seed if seed is not None else self.steps)
        return np.array([rng.randrange(self.c.vocab_size) for _ in range(n)], np.int64)


def _diff(ours, full, a, b, host: bool = True) -> list:
    """What differs between the twins' steps `a` (ours) and `b` (full): sizes, scalars, each
    view and tensor, with the positions and values that differ (a few)."""
    out: list = []
    if a.sizes != b.sizes:
        out.append(("sizes", a.sizes, b.sizes))
    pairs = [(f"view {k}", v.cpu(), b.inputs[k].cpu()) for k, v in a.inputs.items()]
    if host:
        if a.scalars != b.scalars:
            out.append(("scalars", a.scalars, b.scalars))
        ft = full.tensors
        pairs += [(k, v, ft[k]) for k, v in ours.tensors.items()]
    for k, x, y in pairs:
        if x.shape != y.shape:
            out.append((k, "shape", list(x.shape), list(y.shape)))
        elif not torch.equal(x, y):
            at = torch.nonzero(x.reshape(-1) != y.reshape(-1)).reshape(-1)[:6].tolist()
            xs, ys = x.reshape(-1), y.reshape(-1)
            out.append((k, "at", at, "ours", xs[at].tolist(), "full", ys[at].tolist()))
    return out


# ------------------------------------------------------------------------------------ basics
@pytest.mark.parametrize("name", FAMILIES)
def test_generation_false_then_continued(name: str) -> None:
    """A step with generation=False (the generation rows sit out, produce nothing), then a
    step of the same context layout: the rows that sat out produced no token, so their input
    is their last token and their length does not grow."""
    tw = Twins(name)
    tw.add(tw.request(0, [1, 2, 3]))
    tw.step(expect="full")
    tw.add(tw.request(1, [4, 5, 6]))
    tw.step(tw.tokens(seed=1), expect="continued")  # slot 1's prompt, slot 0 joins
    tw.add(tw.request(2, [7, 8, 9]))
    tw.step(tw.tokens(seed=2), generation=False, expect="full")  # slot 0 sits out
    tw.add(tw.request(3, [1, 1, 1]))
    # slot 3's prompt (the layout of the last step), slots 0, 1 decode, slot 2 joins
    tw.step(tw.tokens(seed=3))
    tw.add(tw.request(4, [2, 2, 2]))
    tw.step(tw.tokens(seed=4))
    # the rows that sat out did not produce: that step runs in full, the next continues
    assert tw.paths[-2:] == ["full", "continued"], tw.paths


@pytest.mark.parametrize("name", FAMILIES)
def test_drafted_row_finished_then_continued(name: str) -> None:
    """The last step verified draft tokens on generation row 0 (three input tokens there);
    that request finishes, the last row refills row 0, and row 1 is kept: its input
    position in the last step was not its row index (the drafts came before it)."""
    tw = Twins(name)
    for s in range(3):
        tw.add(tw.request(s, [1 + s, 2, 3]))
    tw.step(expect="full")
    tw.step(tw.tokens(seed=1), drafts={0: [5, 6]}, expect="full")
    tw.finish(0)
    tw.step(tw.tokens(seed=2), accepted=None)
    tw.add(tw.request(0, [4, 4, 4]))
    tw.step(tw.tokens(seed=3))
    tw.step(tw.tokens(seed=4))


@pytest.mark.parametrize("name", FAMILIES)
def test_drafted_row_finished_then_arrival_continued(name: str) -> None:
    """As above, with a prompt arriving (context rows of the last step's layout: none, then
    one of as many tokens as the last step's context drafts and prompt)."""
    tw = Twins(name)
    for s in range(4):
        tw.add(tw.request(s, [1 + s, 2, 3]))
    tw.step(expect="full")
    tw.add(tw.request(4, [7, 7]))
    tw.step(tw.tokens(seed=1), drafts={1: [5, 6, 7]}, expect="full")
    tw.finish(1)  # row 1 refilled by the last row; rows 2 .. kept
    tw.add(tw.request(5, [8, 8]))
    tw.step(tw.tokens(seed=2))
    tw.step(tw.tokens(seed=3))


# ------------------------------------------------------------------------ the random battery
class Traffic:
    """The caller's side of a random churn, read from the full twin's request table (the
    trusted state): which slots produce a token, what each sequence needs in KV blocks."""

    def __init__(self, tw: Twins, rng: random.Random) -> None:
        self.tw, self.rng = tw, rng
        self.t = tw.full._flight

    def free(self) -> list[int]:
        return [s for s, e in enumerate(self.t.entries) if e is None]

    def rows(self) -> list[int]:
        return self.t.rows[: self.t.n_rows].tolist()

    def waiting(self) -> list[int]:
        return list(self.t.waiting)

    def promoted(self) -> list[int]:
        t = self.t
        return [s for s, serial in t.completing if t.serial[s] == serial]

    def producers(self) -> list[int]:
        t = self.t
        alive = [int(s) for s, k in zip(t.produced, t.produced_serial) if t.serial[s] == k]
        return self.promoted() + alive

    def tokens_after(self, slot: int, generation: bool = True) -> int:
        """A generation row's tokens after the next step (exact, as the full step counts)."""
        t = self.t
        produced = slot in self.producers()
        return int(t.prompt_len[slot] + t.generated[slot] + (1 if produced else 0))

    def count(self, slot: int) -> int:
        kv = self.t.kv
        return int(kv.count[slot * kv.lists])

    def grow(self, over: int = 1) -> dict[int, list[int]]:
        """Blocks for every generation row (and prompt joining them) to cover its tokens
        after the next step (plus `over` tokens), within the window."""
        tw = self.tw
        if not tw.paged:
            return {}
        tpb, width = tw.c.tokens_per_block, tw.c.max_blocks_per_seq
        out = {}
        for slot in self.rows() + self.promoted():
            need = min(-(-(self.tokens_after(slot) + over) // tpb), width)
            have = self.count(slot)
            if have < need:
                out[slot] = tw.ids(need - have)
        return out


def fuzz(
    name: str,
    seed: int,
    steps: int = 30,
    *,
    gen_false: bool = False,
    refusals: bool = True,
    graphs: bool = True,
    chunking: bool = True,
    forms: bool = True,
    device_tokens: bool = False,
    churn: float = 0.15,
    prefixes: bool = True,
    drafting: bool = True,
) -> list[str]:
    """A random churn through the twins (see the module docstring); returns ours' paths."""
    rng = random.Random(seed)
    tw = Twins(name, rng.choice((1, 2, 4)), device_tokens)
    c = tw.c
    traffic = Traffic(tw, rng)
    length, per_step = rng.randint(1, 6), rng.randint(0, 2)
    budget = rng.randint(2, 8) if chunking and rng.random() < 0.4 else None
    drafted: dict[int, int] = {}  # slot -> drafts it verifies in the step to come
    for _ in range(steps):
        # finishes: decoding rows, waiting prompts, prompts just completed
        finished = []
        for slot in traffic.rows():
            if rng.random() < churn:
                tw.finish(slot)
                finished.append(slot)
        for slot in traffic.waiting():
            if rng.random() < 0.04:
                tw.finish(slot)
                finished.append(slot)
        for slot in traffic.promoted():
            if rng.random() < 0.05:
                tw.finish(slot)
                finished.append(slot)
        # arrivals: most steps as many prompts of one length (the layout repeats), now and
        # then into a slot just finished
        k = per_step if rng.random() < 0.8 else rng.randint(0, 3)
        free = traffic.free()
        picked = rng.sample(free, min(k, len(free)))
        if finished and picked and rng.random() < 0.4:
            picked[0] = finished[0]
            picked = list(dict.fromkeys(picked))
        for slot in picked:
            n = length if rng.random() < 0.85 else rng.randint(1, 8)
            prompt = [rng.randrange(c.vocab_size) for _ in range(n)]
            extra = rng.choice((0, 0, 1, 3))
            r = tw.request(slot, prompt, extra=extra)
            if prefixes and n > 1 and rng.random() < 0.1:
                r.context_position = rng.randint(1, n - 1)
            tw.add(r)
        chunks = None
        if budget is not None and traffic.waiting():
            chunks, left = {}, budget
            for slot in traffic.waiting():
                rest = int(traffic.t.prompt_len[slot] - traffic.t.position[slot])
                take = min(rest, left)
                if take <= 0:
                    break
                chunks[slot] = take
                left -= take
        producers = traffic.producers()
        tokens = tw.tokens(seed=rng.randrange(1 << 30)) if producers else None
        extra_kw: dict = {}
        live = {s: n for s, n in drafted.items() if s in producers}
        if live:  # the drafts verified in the last step: some accepted
            extra_kw["accepted"] = {s: rng.randint(0, n) for s, n in live.items()}
        drafted = {}
        if drafting and rng.random() < 0.06:
            rows = traffic.rows() + traffic.promoted()
            if rows:
                slot = rng.choice(rows)
                drafted[slot] = rng.randint(1, 3)
                extra_kw["drafts"] = {slot: [rng.randrange(c.vocab_size)] * drafted[slot]}
        over = 8 if (drafted or live) else rng.choice((0, 0, 1, 2))
        blocks = traffic.grow(over=over)
        # a waiting prompt may get a block too
        if tw.paged and traffic.waiting() and rng.random() < 0.1:
            slot = rng.choice(traffic.waiting())
            if traffic.count(slot) < c.max_blocks_per_seq:
                blocks[slot] = tw.ids(1)
        generation = not (gen_false and rng.random() < 0.1)
        if drafted and not generation:
            generation = True
        if refusals and rng.random() < 0.2 and not (drafted or live):
            _refused(tw, traffic, rng, tokens, chunks, blocks, generation)
        given = tokens
        if forms and tokens is not None:
            given = _form(tokens, rng, device_tokens)
        tw.step(
            given,
            chunks=chunks,
            blocks=blocks,
            generation=generation,
            full_tokens=tokens,
            **extra_kw,
        )
        if rng.random() < 0.3:
            tw.check()  # `tensors` read between steps
        s = tw.ours._last
        if graphs and s is not None and not s.num_context_requests and rng.random() < 0.25:
            m = rng.randint(1, 4096)
            for b in (tw.ours, tw.full):
                b.prepare_for_cuda_graph(m)
            tw.check()
    return tw.paths


def _form(tokens: np.ndarray, rng: random.Random, device_tokens: bool):
    """The same tokens in another form the step takes."""
    kind = rng.choice(("int64", "int32", "uint16", "list", "torch", "torch32", "column"))
    if device_tokens:  # mostly on the device, now and then on the host
        kind = rng.choice(("torch", "torch", "torch32", "int64", "list"))
    if kind == "int64":
        return tokens
    if kind in ("int32", "uint16"):
        return tokens.astype(kind)
    if kind == "list":
        return tokens.tolist()
    if kind == "torch":
        return torch.as_tensor(tokens)
    if kind == "torch32":
        return torch.as_tensor(tokens, dtype=torch.int32)
    return tokens.reshape(-1, 1)


def _refused(tw, traffic, rng, tokens, chunks, blocks, generation) -> None:
    """One step both twins must refuse, changing nothing (a variant of the step to come)."""
    c = tw.c
    kinds = ["free_slot_blocks", "bad_chunk", "short_tokens"]
    producers = traffic.producers()
    if producers and tokens is not None:
        kinds += ["bad_token", "negative_token"]
    if tw.paged:
        kinds += ["bad_block_id", "too_many_blocks"]
        short = [
            s
            for s in blocks
            if s in producers
            and traffic.count(s) * c.tokens_per_block < traffic.tokens_after(s)
            and traffic.count(s) < c.max_blocks_per_seq
        ]
        if short and generation:
            kinds.append("uncovered")
    kind = rng.choice(kinds)
    tok = None if tokens is None else tokens.copy()
    ch = None if chunks is None else dict(chunks)
    bl = {s: list(v) for s, v in blocks.items()}
    if kind == "free_slot_blocks":
        free = traffic.free()
        if not free:
            return
        bl[rng.choice(free)] = [1]
    elif kind == "bad_chunk":
        waiting = traffic.waiting()
        if waiting and rng.random() < 0.5:
            slot = rng.choice(waiting)
            rest = int(traffic.t.prompt_len[slot] - traffic.t.position[slot])
            ch = dict(ch or {})
            ch[slot] = rng.choice((0, rest + 1, -1))
        else:
            # a slot not in its context phase (a steady step, of no waiting prompt, reads no
            # chunks at all: see test_a_steady_step_ignores_chunks)
            rows = traffic.rows() + traffic.free()
            if not rows or not waiting:
                return
            ch = dict(ch or {})
            ch[rng.choice(rows)] = 1
    elif kind == "short_tokens":
        tok = np.zeros(3, np.int64) if tok is None else tok[: c.max_batch_size - 1]
    elif kind in ("bad_token", "negative_token"):
        tok[rng.choice(producers)] = c.vocab_size if kind == "bad_token" else -1
    elif kind == "bad_block_id":
        rows = traffic.rows() + traffic.waiting()
        if not rows:
            return
        bl[rng.choice(rows)] = [-1]
    elif kind == "too_many_blocks":
        rows = traffic.rows() + traffic.waiting()
        if not rows:
            return
        bl[rng.choice(rows)] = list(range(1, c.max_blocks_per_seq + 2))
    elif kind == "uncovered":
        del bl[rng.choice(short)]
    tw.step(tok, chunks=ch, blocks=bl, generation=generation, expect="refused")


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("seed", range(12))
def test_battery(name: str, seed: int) -> None:
    """Refusals, graph captures, chunked prompts, prefixes, drafts, token forms, same-slot
    reuse, finishes of waiting and just-completed prompts; no generation=False steps (see
    test_battery_generation_false)."""
    fuzz(name, seed)


def test_the_battery_continues_steps() -> None:
    """The battery's traffic itself: a good share of its steps continue in place, and it
    refuses, runs in full and advances too."""
    from collections import Counter

    paths = Counter()
    for name in FAMILIES:
        for seed in range(4):
            paths.update(fuzz(name, seed))
    assert paths["continued"] >= 40 and paths["refused"] >= 15, paths
    assert paths["full"] >= 40 and paths["steady"] >= 3, paths


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("seed", range(6))
def test_battery_generation_false(name: str, seed: int) -> None:
    fuzz(name, 100 + seed, gen_false=True)


@pytest.mark.parametrize("seed", range(6))
def test_battery_device_tokens(seed: int) -> None:
    fuzz("llama", 200 + seed, device_tokens=True)


# ------------------------------------------------------------------------ targeted scenarios
def _serving(name: str, tpb: int = 2, rows: int = 4, length: int = 3, extra: int = 4) -> Twins:
    """Twins two steps in: `rows` decoding requests (slots 0 ..), one prompt of `length`
    tokens (the next slot) finished in the last step, so a step with one arrival of `length`
    tokens continues the last one in place."""
    tw = Twins(name, tpb)
    for s in range(rows):
        tw.add(tw.request(s, [1 + s] * length, extra=extra))
    tw.step(expect="full")
    tw.add(tw.request(rows, [9] * length, extra=extra))
    tw.step(tw.tokens(seed=1), blocks=Traffic(tw, random.Random(0)).grow())
    return tw


def _arrive(tw: Twins, slot: int, length: int = 3, **kw) -> None:
    tw.add(tw.request(slot, [7] * length, **kw))


def _grow(tw: Twins, over: int = 0) -> dict[int, list[int]]:
    return Traffic(tw, random.Random(0)).grow(over)


@pytest.mark.parametrize("name", FAMILIES)
def test_refusals_between_continued_steps(name: str) -> None:
    """Every kind of refusal in a run of continued steps: each changes nothing (on both
    twins) and the next continued step equals the full one."""
    tw = _serving(name, tpb=1, extra=0)  # every row takes a block every step
    traffic = Traffic(tw, random.Random(1))
    c = tw.c
    for i, kind in enumerate(
        [
            "bad_token",
            "negative_token",
            "uncovered",
            "free_slot_blocks",
            "chunk_zero",
            "chunk_past_prompt",
            "chunk_of_row",
            "bad_block_id",
            "too_many_blocks",
            "short_tokens",
            "float_tokens",
            "bool_list",
            "int8_tokens",
        ]
    ):
        if not tw.paged and kind in ("uncovered", "bad_block_id", "too_many_blocks"):
            continue
        slot = 5 + i % 6
        if tw.full._flight.entries[slot] is not None:
            tw.finish(slot)
        _arrive(tw, slot, extra=0)
        tokens = tw.tokens(seed=10 + i)
        blocks = _grow(tw)
        bad_tokens, bad_blocks, chunks = tokens, dict(blocks), None
        producer = traffic.producers()[0]
        if kind == "bad_token":
            bad_tokens = tokens.copy()
            bad_tokens[producer] = c.vocab_size
        elif kind == "negative_token":
            bad_tokens = tokens.copy()
            bad_tokens[producer] = -1
        elif kind == "uncovered":
            assert blocks
            bad_blocks = {s: v for s, v in blocks.items() if s != next(iter(blocks))}
        elif kind == "free_slot_blocks":  # (gpt: blocks at all, without a paged KV cache)
            bad_blocks[traffic.free()[0]] = [1]
        elif kind == "chunk_zero":
            chunks = {slot: 0}
        elif kind == "chunk_past_prompt":
            chunks = {slot: 4}
        elif kind == "chunk_of_row":
            chunks = {slot: 3, producer: 1}
        elif kind == "bad_block_id":
            bad_blocks[producer] = [-1]
        elif kind == "too_many_blocks":
            bad_blocks[producer] = list(range(1, c.max_blocks_per_seq + 1))
        elif kind == "short_tokens":
            bad_tokens = tokens[:5]
        elif kind == "float_tokens":
            bad_tokens = tokens.astype(np.float64)
        elif kind == "bool_list":
            bad_tokens = tokens.tolist()
            bad_tokens[producer] = True
        elif kind == "int8_tokens":
            bad_tokens = tokens.astype(np.int8)
        tw.step(bad_tokens, chunks=chunks, blocks=bad_blocks, expect="refused")
        tw.step(tokens, blocks=blocks, expect="continued")


@pytest.mark.parametrize("name", FAMILIES)
def test_refused_twice_then_continued(name: str) -> None:
    """Two refusals in a row (blocks appended then taken back, twice), then continued steps
    on both halves."""
    tw = _serving(name, tpb=1)
    for i in range(6):
        tw.finish(i % 4)  # refills a row (never the last one), reused at once
        _arrive(tw, i % 4)
        tokens, blocks = tw.tokens(seed=i), _grow(tw)
        if tw.paged and blocks:
            first = next(iter(blocks))
            bad = {s: v for s, v in blocks.items() if s != first}
            bad[first] = [-5]
            tw.step(tokens, blocks=bad, expect="refused")  # others appended, then undone
            tw.step(
                tokens, blocks={s: v for s, v in blocks.items() if s != first}, expect="refused"
            )  # uncovered
        tw.step(tokens, blocks=blocks, expect="continued")


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("arrivals", [False, True])
def test_cuda_graph_capture_then_steps(name: str, arrivals: bool) -> None:
    """prepare_for_cuda_graph after a generation-only step (full, steady or continued), then
    more steps, with and without arrivals."""
    tw = _serving(name)
    tw.step(tw.tokens(seed=2), blocks=_grow(tw), expect="full")  # generation only
    for m in (1, 7, 300, 4096):
        for b in (tw.ours, tw.full):
            b.prepare_for_cuda_graph(m)
        tw.check()
        if arrivals:
            _arrive(tw, 6 + m % 3)
        else:
            tw.finish(0)  # a refilled row
        tw.step(tw.tokens(seed=m), blocks=_grow(tw))
        if arrivals:  # its prompt joins: the layout of no context rows, refilled rows none
            tw.step(tw.tokens(seed=m + 1), blocks=_grow(tw))
        tw.finish(1)
        tw.step(tw.tokens(seed=m + 2), blocks=_grow(tw))  # generation only
        tw.step(tw.tokens(seed=m + 3), blocks=_grow(tw))
        if not arrivals:
            tw.add(tw.request(0, [1, 2, 3]))
            tw.add(tw.request(1, [1, 2, 3]))
            tw.step(tw.tokens(seed=m + 4), blocks=_grow(tw))
            tw.step(tw.tokens(seed=m + 5), blocks=_grow(tw))
        else:
            for s in (6, 7, 8):
                if tw.full._flight.entries[s] is not None:
                    tw.finish(s)
            tw.add(tw.request(1, [1, 2, 3]))
            tw.step(tw.tokens(seed=m + 4), blocks=_grow(tw))
            tw.step(tw.tokens(seed=m + 5), blocks=_grow(tw))
    assert "continued" in tw.paths, tw.paths


@pytest.mark.parametrize("name", FAMILIES)
def test_capture_after_a_continued_generation_only_step(name: str) -> None:
    """A continued step without context rows (a finish refilled a row), captured, then a
    continued step again two steps on (the captured half written again)."""
    tw = _serving(name, rows=6)
    tw.step(tw.tokens(seed=2), blocks=_grow(tw), expect="full")
    tw.finish(1)
    tw.step(tw.tokens(seed=3), blocks=_grow(tw), expect="continued")
    for b in (tw.ours, tw.full):
        b.prepare_for_cuda_graph(5)
    tw.check()
    for i, expect in enumerate(["full", "continued", "continued", "continued"]):
        tw.finish(int(tw.full._flight.rows[0]))  # row 0 refilled by the last row
        tw.step(tw.tokens(seed=4 + i), blocks=_grow(tw), expect=expect)  # after a capture: full


@pytest.mark.parametrize("name", FAMILIES)
def test_same_slot_finished_and_reused(name: str) -> None:
    """The same slot finished and taken again by add() before each of many continued steps:
    a decoding row's slot, a waiting prompt's slot, the slot of the prompt just completed."""
    tw = _serving(name)
    for i in range(12):
        which = i % 3
        if which == 0:  # a decoding row (row 0 refilled by the last row)
            slot = int(tw.full._flight.rows[0])
            tw.finish(slot)
            _arrive(tw, slot)
        elif which == 1:  # the prompt that arrives: finished and re-added before its step
            slot = Traffic(tw, random.Random(0)).free()[0]
            _arrive(tw, slot)
            tw.finish(slot)
            _arrive(tw, slot)
        else:  # the prompt the last step completed: finished before it joins, slot reused
            slot = Traffic(tw, random.Random(0)).promoted()[0]
            tw.finish(slot)
            _arrive(tw, slot)
        tw.step(tw.tokens(seed=i), blocks=_grow(tw), expect="continued")
        tw.check()


@pytest.mark.parametrize("name", FAMILIES)
def test_finish_while_waiting_or_just_completed(name: str) -> None:
    """A request finished while its prompt waits (chunked, partly computed), and one finished
    right after its prompt completed, between continued steps."""
    tw = _serving(name)
    tw.add(tw.request(6, list(range(1, 13))))  # 12 tokens, chunked 3 a step
    _arrive(tw, 7)
    tw.step(tw.tokens(seed=2), chunks={6: 3}, blocks=_grow(tw), expect="continued")  # 7 waits
    tw.step(tw.tokens(seed=3), chunks={6: 3}, blocks=_grow(tw), expect="continued")
    tw.finish(6)  # mid-prompt
    tw.step(tw.tokens(seed=4), chunks={7: 3}, blocks=_grow(tw), expect="continued")
    tw.finish(7)  # its prompt just completed: it never joins the generation rows
    _arrive(tw, 8)
    tw.step(tw.tokens(seed=5), blocks=_grow(tw), expect="continued")
    _arrive(tw, 7)
    tw.step(tw.tokens(seed=6), blocks=_grow(tw), expect="continued")


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prompts_of_one_layout(name: str) -> None:
    """Steps of two context chunks totalling 5 tokens, from different requests with different
    chunk sizes and begins, one prompt completing while another continues."""
    tw = _serving(name)
    tw.add(tw.request(5, list(range(1, 10))))  # 9 tokens
    tw.add(tw.request(6, list(range(11, 18))))  # 7 tokens
    tw.add(tw.request(7, [5, 5, 5, 5]))
    plan = [
        {5: 2, 6: 3},
        {5: 4, 6: 1},
        {5: 3, 6: 2},  # 5 completes (9 = 2 + 4 + 3)
        {6: 1, 7: 4},  # 6 and 7 complete (7 = 3 + 1 + 2 + 1)
    ]
    for i, chunks in enumerate(plan):
        tw.step(
            tw.tokens(seed=i),
            chunks=chunks,
            blocks=_grow(tw),
            expect="full" if i == 0 else "continued",
        )
    tw.add(tw.request(8, [3] * 6))
    tw.add(tw.request(9, [4] * 7))
    tw.step(tw.tokens(seed=9), chunks={8: 4, 9: 1}, blocks=_grow(tw), expect="continued")
    tw.step(tw.tokens(seed=10), chunks={8: 2}, blocks=_grow(tw), expect="full")
    tw.step(tw.tokens(seed=11), chunks={9: 2}, blocks=_grow(tw), expect="continued")
    tw.step(tw.tokens(seed=12), chunks={9: 2}, blocks=_grow(tw), expect="continued")
    tw.step(tw.tokens(seed=13), blocks=_grow(tw), expect="continued")  # its last 2
    tw.step(tw.tokens(seed=14), blocks=_grow(tw), expect="full")


@pytest.mark.parametrize("name", FAMILIES)
def test_prompts_with_computed_prefix(name: str) -> None:
    """Prompts arriving with context_position > 0 (a computed prefix): the chunk begins
    there, its tokens as many as the last step's."""
    tw = _serving(name)
    for i, (length, begin) in enumerate([(5, 2), (4, 1), (3, 0), (9, 6), (7, 4)]):
        slot = 6 + i
        r = tw.request(slot, [i + 1] * length)
        r.context_position = begin
        tw.add(r)
        tw.step(tw.tokens(seed=i), blocks=_grow(tw), expect="continued")


@pytest.mark.parametrize("name", FAMILIES)
def test_alternating_paths(name: str) -> None:
    """continued, full (another layout), steady (generation only, nothing changed),
    continued (a refill) ... with `tensors` read between steps."""
    tw = _serving(name, tpb=1)
    for i in range(4):
        _arrive(tw, Traffic(tw, random.Random(0)).free()[0])
        tw.step(tw.tokens(seed=10 * i), blocks=_grow(tw), expect="continued")
        tw.check()
        tw.step(tw.tokens(seed=10 * i + 1), blocks=_grow(tw), expect="full")  # 6 joins
        tw.step(tw.tokens(seed=10 * i + 2), blocks=_grow(tw), expect="steady")
        tw.check()
        tw.step(tw.tokens(seed=10 * i + 3), blocks=_grow(tw), expect="steady")
        tw.finish(0)
        tw.step(tw.tokens(seed=10 * i + 4), blocks=_grow(tw), expect="continued")
        tw.finish(int(tw.full._flight.rows[tw.full._flight.n_rows - 1]))  # the last row
        tw.step(tw.tokens(seed=10 * i + 5), blocks=_grow(tw), expect="full")
        free = Traffic(tw, random.Random(0)).free()
        tw.add(tw.request(free[0], [4, 4, 4]))
        tw.step(tw.tokens(seed=10 * i + 6), blocks=_grow(tw), expect="full")  # another layout
        tw.check()


@pytest.mark.parametrize("name", FAMILIES)
def test_token_forms(name: str) -> None:
    """The sampled tokens as numpy arrays of other integer dtypes, lists, [slots, k] tables,
    longer arrays and torch CPU tensors, in continued steps."""
    tw = _serving(name)
    forms = [
        lambda t: t.astype(np.int32),
        lambda t: t.astype(np.uint16),
        lambda t: t.astype(np.int16),
        lambda t: t.astype(np.uint32),
        lambda t: t.tolist(),
        lambda t: np.stack([t, t + 1], axis=1),
        lambda t: np.concatenate([t, t[:4]]),
        lambda t: torch.as_tensor(t),
        lambda t: torch.as_tensor(t, dtype=torch.int32),
        lambda t: torch.as_tensor(np.stack([t, t], axis=1))[:, 1],  # non-contiguous
        lambda t: [np.int64(x) for x in t],
        lambda t: tuple(int(x) for x in t),
    ]
    for i, form in enumerate(forms):
        slot = 5 + i % 6
        if tw.full._flight.entries[slot] is not None:
            tw.finish(slot)
        _arrive(tw, slot)
        tokens = tw.tokens(seed=i)
        tw.step(form(tokens), blocks=_grow(tw), expect="continued", full_tokens=tokens)


@pytest.mark.parametrize(
    "form",
    [
        lambda t: torch.as_tensor(t),
        lambda t: torch.as_tensor(t, dtype=torch.int32),
        lambda t: torch.as_tensor(np.stack([t, t + 1], axis=1)),
        lambda t: torch.as_tensor(np.stack([t + 1, t], axis=1))[:, 1],  # non-contiguous
        lambda t: torch.as_tensor(np.concatenate([t, t[:4]])),
        lambda t: torch.as_tensor(t, dtype=torch.int16),
    ],
    ids=["int64", "int32", "table", "strided", "longer", "int16"],
)
def test_device_token_forms(form) -> None:
    """Tokens as a tensor on the buffers' device (CPU, device_tokens=True) in continued
    steps, gathered there: against host tokens in full."""
    tw = Twins("llama", 2, device_tokens=True)
    for s in range(4):
        tw.add(tw.request(s, [1 + s] * 3))
    tw.step(expect="full")
    for i in range(8):
        slot = 4 + i % 6
        if tw.full._flight.entries[slot] is not None:
            tw.finish(slot)
        _arrive(tw, slot)
        tokens = tw.tokens(seed=i)
        tw.step(
            form(tokens),
            blocks=_grow(tw),
            full_tokens=tokens,
            expect="full" if i == 0 else "continued",
        )
        tw.check()


@pytest.mark.parametrize("tpb", [1, 2])
def test_many_appends_and_the_window(tpb: int) -> None:
    """Ten decoding rows that each take a block every step or two (more than 8 slots: the
    appends checked and written at once), their lists growing to max_blocks_per_seq and
    staying there (the window); each step one prompt arrives (its layout repeats) and the
    one that joined the step before finishes (the last row: no refill), so that every step
    continues in place."""
    tw = Twins("llama", tpb)
    width = tw.c.max_blocks_per_seq
    for s in range(10):
        tw.add(tw.request(s, [1 + s] * 9, extra=0))
    tw.step(expect="full")
    tw.add(tw.request(10, [3] * 2))
    tw.step(tw.tokens(seed=0), blocks=_grow(tw), expect="full")
    for i in range(width * tpb - 6):
        slot = 11 - i % 2
        tw.add(tw.request(slot, [2] * 2, extra=0))
        tw.step(tw.tokens(seed=i + 1), blocks=_grow(tw), expect="continued")
        tw.finish(21 - slot)  # the prompt of the step before, now the last row
    counts = tw.full._flight.kv.count[:10]
    assert (counts == width).all(), counts
    assert tw.paths.count("continued") > 20


def test_many_appends_one_block_each_and_lists() -> None:
    """Appends to more than 8 slots in one continued step in each form: one id each, several
    ids, numpy rows (not checked at once), an empty list."""
    tw = Twins("llama", 1)
    for s in range(10):
        tw.add(tw.request(s, [1 + s] * 4, extra=0))
    tw.step(expect="full")
    tw.add(tw.request(10, [3] * 2, extra=0))
    tw.step(tw.tokens(seed=0), blocks=_grow(tw), expect="full")
    for i, style in enumerate(["one", "several", "numpy", "empty", "tuple", "one"]):
        tw.finish(int(tw.full._flight.rows[0]))
        slot = Traffic(tw, random.Random(0)).free()[0]
        tw.add(tw.request(slot, [2] * 2, extra=0))
        traffic = Traffic(tw, random.Random(0))
        blocks = {s: tw.ids(1) for s in traffic.rows() + traffic.promoted()}
        if style == "several":
            blocks = {s: v + tw.ids(2) for s, v in blocks.items()}
        elif style == "numpy":
            blocks = {s: np.array(v) for s, v in blocks.items()}
        elif style == "empty":
            extra = {s: [] for s in Traffic(tw, random.Random(0)).rows() if s not in blocks}
            blocks.update(extra)
        elif style == "tuple":
            blocks = {s: tuple(v) for s, v in blocks.items()}
        assert len(blocks) > 8, blocks
        tw.step(tw.tokens(seed=i + 1), blocks=blocks, expect="continued")


def test_a_prompt_longer_than_the_window() -> None:
    """Prompts longer than the attention window (their lists fill it) in continued steps."""
    tw = Twins("llama", 1)
    width = tw.c.max_blocks_per_seq
    for s in range(2):
        tw.add(tw.request(s, [1 + s] * (width + 5)))
    tw.step(expect="full")
    tw.add(tw.request(3, [2] * (width + 5)))
    tw.step(tw.tokens(seed=0), blocks=_grow(tw), expect="full")
    for i in range(6):
        tw.finish(int(tw.full._flight.rows[0]))
        slot = Traffic(tw, random.Random(0)).free()[0]
        tw.add(tw.request(slot, [3] * (width + 5)))
        tw.step(tw.tokens(seed=i + 1), blocks=_grow(tw), expect="continued")


@pytest.mark.parametrize("name", FAMILIES)
def test_generation_false_with_no_producer(name: str) -> None:
    """A chunk of a prompt with generation=False, then a second such chunk (the rows sat out
    the step before: no request produced a token), then a third chunk with generation on:
    nothing produced, so the full step takes tokens=None."""
    tw = _serving(name)
    tw.add(tw.request(6, list(range(1, 13))))
    tw.step(tw.tokens(seed=2), chunks={6: 3}, blocks=_grow(tw), expect="continued")
    tw.step(tw.tokens(seed=3), chunks={6: 3}, generation=False, expect="full")
    tw.step(None, chunks={6: 3}, generation=False, expect="full")  # nothing produced
    tw.step(None, chunks={6: 3}, blocks=_grow(tw))  # nothing to read: tokens=None


@pytest.mark.parametrize("name", FAMILIES)
def test_generation_false_with_no_producer_tokens_given(name: str) -> None:
    """As above, the caller passing a token array anyway."""
    tw = _serving(name)
    tw.add(tw.request(6, list(range(1, 13))))
    tw.step(tw.tokens(seed=2), chunks={6: 3}, blocks=_grow(tw), expect="continued")
    tw.step(tw.tokens(seed=3), chunks={6: 3}, generation=False, expect="full")
    tw.step(None, chunks={6: 3}, generation=False, expect="full")
    tw.step(tw.tokens(seed=4), chunks={6: 3}, blocks=_grow(tw))


@pytest.mark.parametrize("name", FAMILIES)
def test_context_drafts_finished_before_joining(name: str) -> None:
    """The last step's context chunk carried draft tokens (its last chunk); that request
    finishes before it joins, and a prompt of as many tokens (chunk + drafts) arrives."""
    tw = _serving(name)
    r = tw.request(6, [4, 4, 4], extra=1)
    r.draft_tokens = [1, 2]
    tw.add(r)
    tw.step(tw.tokens(seed=2), blocks=_grow(tw))
    tw.finish(6)
    _arrive(tw, 7, length=5)
    tw.step(tw.tokens(seed=3), blocks=_grow(tw))
    _arrive(tw, 8, length=5)
    tw.step(tw.tokens(seed=4), blocks=_grow(tw))


def test_a_steady_step_ignores_chunks() -> None:
    """(Not the continue path.) chunks naming a slot that holds no prompt in its context
    phase are refused by a steady step (generation only, nothing changed) as by a full step:
    whether a call is refused does not depend on the path it would take."""
    tw = _serving("llama")
    tw.step(tw.tokens(seed=2), blocks=_grow(tw), expect="full")
    row = int(tw.full._flight.rows[0])
    tw.finish(int(tw.full._flight.rows[tw.full._flight.n_rows - 1]))  # not steady: refused
    tw.step(tw.tokens(seed=3), blocks=_grow(tw), chunks={row: 1}, expect="refused")
    tw.step(tw.tokens(seed=3), blocks=_grow(tw), expect="full")
    tw.step(tw.tokens(seed=4), blocks=_grow(tw), chunks={row: 1}, expect="refused")  # steady


@pytest.mark.parametrize("seed", range(6))
def test_battery_both_on_device(seed: int) -> None:
    """Both twins take the tokens as a tensor on the device (CPU here)."""
    rng = random.Random(300 + seed)
    tw = Twins("llama", rng.choice((1, 2)), both_on_device=True)
    traffic = Traffic(tw, rng)
    for _ in range(25):
        for slot in traffic.rows():
            if rng.random() < 0.15:
                tw.finish(slot)
        free = traffic.free()
        for slot in rng.sample(free, min(1, len(free))):
            tw.add(tw.request(slot, [rng.randrange(1000) for _ in range(3)]))
        tokens = None
        if traffic.producers():
            tokens = torch.as_tensor(tw.tokens(seed=rng.randrange(1 << 20)))
        tw.step(tokens, blocks=traffic.grow(1))
        if rng.random() < 0.3:
            tw.check()
    assert "continued" in tw.paths


@pytest.mark.parametrize("name", ["llama"])
def test_a_bad_token_on_the_device(name: str) -> None:
    """A token outside the vocabulary, on the device, in a continued step: both twins
    write the pad there and refuse the next step until that request finishes; then the
    steps go on alike."""
    tw = Twins(name, 2, both_on_device=True)
    for s in range(4):
        tw.add(tw.request(s, [1 + s] * 3))
    tw.step(expect="full")
    tw.add(tw.request(4, [9] * 3))
    tw.step(torch.as_tensor(tw.tokens(seed=1)), blocks=_grow(tw), expect="full")
    tw.add(tw.request(5, [9] * 3))
    bad = tw.tokens(seed=2)
    bad[2] = tw.c.vocab_size + 5
    tw.step(torch.as_tensor(bad), blocks=_grow(tw), expect="continued")
    tw.check()
    tw.step(torch.as_tensor(tw.tokens(seed=3)), blocks=_grow(tw), expect="refused")
    tw.finish(2)
    tw.add(tw.request(2, [9] * 3))
    tw.step(torch.as_tensor(tw.tokens(seed=4)), blocks=_grow(tw), expect="continued")
    tw.check()


def test_explicit_positions_leave_then_continued() -> None:
    """(gpt) A request with explicit position ids in flight keeps every step in full; once
    it finishes (its row refilled), the steps continue in place from a full step's rows."""
    tw = _serving("gpt")
    r = tw.request(6, [5, 5, 5])
    r.position_ids = [10, 20, 30]
    tw.add(r)
    tw.step(tw.tokens(seed=2), expect="full")
    _arrive(tw, 7)
    tw.step(tw.tokens(seed=3), expect="full")
    tw.finish(6)
    _arrive(tw, 8)
    tw.step(tw.tokens(seed=4), expect="continued")
    tw.finish(0)
    _arrive(tw, 9)
    tw.step(tw.tokens(seed=5), expect="continued")


@pytest.mark.parametrize("name", FAMILIES)
def test_drafts_then_continued(name: str) -> None:
    """Draft tokens verified on two rows, some accepted, then continued steps (arrivals and
    refills): the kept rows' values follow the full steps that took the drafts."""
    tw = _serving(name, tpb=1, extra=8)
    tw.step(tw.tokens(seed=2), drafts={0: [4, 5], 3: [6]}, blocks=_grow(tw, 3), expect="full")
    tw.step(tw.tokens(seed=3), accepted={0: 2, 3: 0}, blocks=_grow(tw, 3), expect="full")
    _arrive(tw, 6)
    tw.step(tw.tokens(seed=4), blocks=_grow(tw, 3), expect="full")
    _arrive(tw, 7)
    tw.step(tw.tokens(seed=5), blocks=_grow(tw, 3), expect="continued")
    tw.finish(1)
    _arrive(tw, 1)
    tw.step(tw.tokens(seed=6), blocks=_grow(tw, 3), expect="continued")
    tw.step(tw.tokens(seed=7), drafts={3: [1, 2, 3]}, blocks=_grow(tw, 4), expect="full")
    tw.finish(3)  # its drafts verified, it leaves: no draft in flight
    _arrive(tw, 3)
    tw.step(tw.tokens(seed=8), blocks=_grow(tw, 3))
    _arrive(tw, 8)
    tw.step(tw.tokens(seed=9), blocks=_grow(tw, 3), expect="continued")


@pytest.mark.parametrize("name", FAMILIES)
def test_stateless_steps_between_runs_in_flight(name: str) -> None:
    """A run in flight with continued steps, every request finished, stateless steps
    (prepare_step, advance) on both halves, then requests in flight again."""
    tw = _serving(name, tpb=1, extra=6)
    for i in range(3):
        _arrive(tw, 5 + i)
        tw.step(tw.tokens(seed=i), blocks=_grow(tw), expect="continued")
    for s in list(Traffic(tw, random.Random(0)).rows()) + [7]:
        tw.finish(s)
    assert tw.full._flight.entries.count(None) == tw.c.max_batch_size
    # (an empty step first: see test_prepare_step_after_every_request_finished)
    tw.step(expect="full")
    gen = [
        Request(
            seq_slot=s,
            prompt=[1, 2, 3],
            generated=[[4, 5]],
            kv_block_ids=[[100 + 8 * s + k for k in range(8)]] if tw.paged else None,
        )
        for s in (2, 9, 4)
    ]
    ctx = [Request(seq_slot=0, prompt=[7, 7], kv_block_ids=[[50, 51]] if tw.paged else None)]
    steps = [b.prepare_step(ctx, gen) for b in (tw.ours, tw.full)]
    assert not _diff(tw.ours, tw.full, *steps)
    steps = [b.prepare_step([], gen) for b in (tw.ours, tw.full)]
    for k in range(3):
        steps = [b.advance(np.array([5 + k, 6, 7])) for b in (tw.ours, tw.full)]
        assert not _diff(tw.ours, tw.full, *steps)
    for s in range(4):
        tw.add(tw.request(s, [1 + s] * 3))
    tw.step(expect="full")
    for i in range(4):
        _arrive(tw, 4 + i)
        tw.step(tw.tokens(seed=10 + i), blocks=_grow(tw), expect="full" if i == 0 else "continued")
        tw.finish(int(tw.full._flight.rows[0]))


@pytest.mark.parametrize("name", FAMILIES)
def test_block_keys_and_values_of_other_types(name: str) -> None:
    """blocks keyed by numpy integers, their ids numpy arrays or tuples, in continued
    steps with more and fewer than 8 slots appending."""
    if name == "gpt":
        pytest.skip("no paged KV cache")
    tw = _serving(name, tpb=1, rows=9, extra=0)
    for i, style in enumerate(["npkey", "nparray", "tuple", "npkey_few", "mixed"]):
        _arrive(tw, 10 + i % 2, extra=0)
        blocks = _grow(tw)
        if style in ("npkey", "npkey_few"):
            blocks = {np.int64(s): v for s, v in blocks.items()}
            if style == "npkey_few":
                blocks = dict(list(blocks.items())[:4])
                rest = {s: tw.ids(0) for s in []}
                blocks.update(rest)
        elif style == "nparray":
            blocks = {s: np.array(v, np.int32) for s, v in blocks.items()}
        elif style == "tuple":
            blocks = {s: tuple(v) for s, v in blocks.items()}
        elif style == "mixed":
            blocks = {s: (np.array(v) if k % 2 else v) for k, (s, v) in enumerate(blocks.items())}
        if style == "npkey_few":  # the rows left out are uncovered: refused by both
            tw.step(tw.tokens(seed=i), blocks=blocks, expect="refused")
            blocks = _grow(tw)
        tw.step(tw.tokens(seed=i), blocks=blocks, expect="continued")
        tw.finish(10 + i % 2)


def test_prepare_step_after_every_request_finished() -> None:
    """(Not the continue path.) Every request in flight finished, the last one right after
    its prompt completed: nothing is in flight, and prepare_step runs (the finish takes the
    prompt off the table's completing list)."""
    b = make_buffers("gpt", max_beam_width=1)
    b.add(Request(seq_slot=0, prompt=[1, 2, 3]))
    b.step()
    b.finish(0)
    assert all(e is None for e in b._flight.entries)
    b.prepare_step([Request(seq_slot=0, prompt=[1, 2])], [])


@pytest.mark.parametrize("name", FAMILIES)
def test_a_failed_fill_then_continued_steps(name: str) -> None:
    """A fill that raises after its checks passed (a bug, injected: the last continue form in
    ours, the last rule in the full twin) abandons the half it was writing on both; the steps
    after it (continued ones writing that half again) still agree."""
    from bufc.rules import continued as continue_forms
    from bufc.rules import core

    tw = _serving(name)
    _arrive(tw, 5)
    tw.step(tw.tokens(seed=2), blocks=_grow(tw), expect="continued")
    _arrive(tw, 6)
    tokens, blocks = tw.tokens(seed=3), _grow(tw)

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(continue_forms, "continue_seq_slots", boom)
        mp.setattr(core, "seq_slots", boom)
        tw.step(tokens, blocks=blocks, expect="refused", same_message=True)
    tw.step(tokens, blocks=blocks, expect="continued")  # the step again, into that half
    for i in range(6):
        _arrive(tw, Traffic(tw, random.Random(0)).free()[0])
        if i % 2:
            tw.finish(int(tw.full._flight.rows[0]))
        tw.step(tw.tokens(seed=4 + i), blocks=_grow(tw), expect="continued")
        tw.check()


# ------------------------------------ generation=False, then a step of the same context layout
def _sat_out(name: str) -> Twins:
    """Twins whose last step ran with generation=False: slots 0 and 1 (decoding, each
    produced a token in the step before) sat it out while slot 2's prompt ran (3 tokens);
    slot 3 arrives with a prompt as long, so the next step has the last step's context
    layout. The rows of slots 0 and 1 produced nothing in the last step."""
    tw = Twins(name)
    tw.add(tw.request(0, [1, 2, 3]))
    tw.step(expect="full")
    tw.add(tw.request(1, [4, 5, 6]))
    tw.step(tw.tokens(seed=1), expect="continued")
    tw.add(tw.request(2, [7, 8, 9]))
    tw.step(tw.tokens(seed=2), generation=False, expect="full")
    tw.add(tw.request(3, [1, 1, 1]))
    return tw


@pytest.mark.parametrize("name", FAMILIES)
def test_sat_out_rows_keep_their_counts(name: str) -> None:
    """The step after generation=False: the table's counts of the rows that sat out grow by
    one in ours (they produced nothing), and stay wrong in every step after."""
    tw = _sat_out(name)
    for b in (tw.ours, tw.full):
        with contextlib.suppress(BatchError):
            b.step(tw.tokens(seed=3))
    assert tw.ours._flight.generated.tolist() == tw.full._flight.generated.tolist()
    assert tw.ours._flight.last.tolist() == tw.full._flight.last.tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_sat_out_rows_token_check(name: str) -> None:
    """The step after generation=False reads no token for the rows that sat out (they
    produced none): a value out of the vocabulary in such a slot of the array is not read by
    the full step, but refused by ours."""
    tw = _sat_out(name)
    tokens = tw.tokens(seed=3)
    tokens[0] = -7  # slot 0 sat out: not read
    tw.step(tokens)


def test_sat_out_rows_block_check() -> None:
    """The step after generation=False: a row that sat out needs no KV block for a token it
    did not produce; ours counts one more token and asks for a block the full step does not
    need."""
    tw = Twins("llama", 1)
    tw.add(tw.request(0, [1, 2, 3], extra=0))
    tw.step(expect="full")
    tw.add(tw.request(1, [4, 5, 6], extra=0))
    tw.step(tw.tokens(seed=1), blocks={0: tw.ids(1)}, expect="continued")  # slot 0: 4 tokens
    tw.add(tw.request(2, [7, 8, 9], extra=0))
    # slots 0 and 1 sit out (their tokens 5 and 4 are computed in a later step)
    tw.step(tw.tokens(seed=2), generation=False, expect="full")
    tw.add(tw.request(3, [1, 1, 1], extra=0))
    # slot 0 has 4 tokens + its sampled one = 5: one more block; slot 1 4: one more; slot 2 4
    blocks = {0: tw.ids(1), 1: tw.ids(1), 2: tw.ids(1)}
    tw.step(tw.tokens(seed=3), blocks=blocks)


@pytest.mark.parametrize("name", FAMILIES)
def test_sat_out_rows_with_device_tokens(name: str) -> None:
    """As test_generation_false_then_continued, both twins taking tokens on the device."""
    tw = Twins(name, both_on_device=True)
    tw.add(tw.request(0, [1, 2, 3]))
    tw.step(expect="full")
    tw.add(tw.request(1, [4, 5, 6]))
    tw.step(torch.as_tensor(tw.tokens(seed=1)), expect="continued")
    tw.add(tw.request(2, [7, 8, 9]))
    tw.step(torch.as_tensor(tw.tokens(seed=2)), generation=False, expect="full")
    tw.add(tw.request(3, [1, 1, 1]))
    tw.step(torch.as_tensor(tw.tokens(seed=3)))
    tw.check()


@pytest.mark.parametrize("name", FAMILIES)
def test_two_bad_tokens(name: str) -> None:
    """Two tokens out of the vocabulary, a kept row's and a joining prompt's: both twins
    refuse (the messages name different ones: ours the first in row order, the full step
    the joining prompt's first), and the next continued step runs."""
    tw = _serving(name)
    _arrive(tw, 5)
    tokens, blocks = tw.tokens(seed=3), _grow(tw)
    bad = tokens.copy()
    bad[4] = tw.c.vocab_size + 4  # slot 4: the prompt the last step completed
    bad[0] = tw.c.vocab_size  # slot 0: a kept row
    tw.step(bad, blocks=blocks, expect="refused")
    tw.step(tokens, blocks=blocks, expect="continued")
