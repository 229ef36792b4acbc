"""The twins that the battery (test_staging_twins_battery.py) and its targeted scenarios
(test_staging_twins_scenarios.py) drive: two RuntimeBuffers of one family take identical calls,
one with two staging halves (or tokens on the device), the other with one half and host tokens
(``test_staging_twins._pair``), and are compared after every call; the battery's random
traffic; the set-ups scenarios start from.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from fuzz_configs import make_buffers
from test_staging_twins import _pair, _same

from bufc.requests import step as request_step
from bufc.runtime import BatchError, Request

FAMILIES = ("llama", "gpt")


class Twins:
    """Both buffers of `_pair`, driven by identical calls and compared after each."""

    def __init__(
        self,
        name: str,
        tpb: int = 2,
        device_tokens: bool = False,
        both_on_device: bool = False,
        halves: int = 1,
    ) -> None:
        """`device_tokens`: ours takes tokens on the device (the full twin on the host);
        `both_on_device`: both do (a token out of the vocabulary is then refused one step
        later by both); `halves`: the twin's staging halves (2: as ours)."""
        self.name = name
        self.ours, self.full = _pair(
            name, tpb, device_tokens or both_on_device, twin_double_buffered=halves == 2
        )
        if both_on_device:
            kw = dict(max_batch_size=12, max_beam_width=1, tokens_per_block=tpb, num_kv_blocks=0)
            if name == "llama":
                kw["max_attention_window"] = 32 * tpb
            self.full = make_buffers(name, "cpu", device_tokens=True, double_buffered=False, **kw)
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
        """One step on both; `expect`: the path ours must take ('full' or 'steady'), or
        'refused' (both raise BatchError, nothing changes)."""
        where = (self.name, self.steps)
        before = self._snapshot()
        log: list[str] = []
        real_steady = request_step._steady

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
        return list(self.t.completing)

    def producers(self) -> list[int]:
        t = self.t
        alive = [int(s) for s in t.produced if s not in t.left]
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


# ------------------------------------------------------------- the scenarios' set-ups
def _serving(
    name: str, tpb: int = 2, rows: int = 4, length: int = 3, extra: int = 4, halves: int = 1
) -> Twins:
    """Twins two steps in: `rows` decoding requests (slots 0 ..), one prompt of `length`
    tokens (the next slot) finished in the last step (`halves`: the twin's staging halves)."""
    tw = Twins(name, tpb, halves=halves)
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


def _sat_out(name: str) -> Twins:
    """Twins whose last step ran with generation=False: slots 0 and 1 (decoding, each
    produced a token in the step before) sat it out while slot 2's prompt ran (3 tokens);
    slot 3 arrives with a prompt as long, so the next step has the last step's context
    layout. The rows of slots 0 and 1 produced nothing in the last step."""
    tw = Twins(name)
    tw.add(tw.request(0, [1, 2, 3]))
    tw.step(expect="full")
    tw.add(tw.request(1, [4, 5, 6]))
    tw.step(tw.tokens(seed=1), expect="full")
    tw.add(tw.request(2, [7, 8, 9]))
    tw.step(tw.tokens(seed=2), generation=False, expect="full")
    tw.add(tw.request(3, [1, 1, 1]))
    return tw
