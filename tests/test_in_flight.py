"""Requests in flight (add, finish, step) against the stateless prepare_step and the
loop-by-loop reference: the same random serving traffic drives both, and every tensor is
compared after every step.

The traffic: requests arrive (numpy-typed fields, explicit positions, beams with shared or
per-beam KV lists, drafts riding on the last chunk, LoRA rows), are computed in random context
chunks (some wait a step), decode with sampled tokens, verify drafts and accept some, grow their
KV block lists, and finish at random, their slots reused at once. The test keeps its own model of
the documented row order (context requests in arrival order, then the generation rows: a
finished row is filled by the last one, finished prompts join at the end) and hands the
stateless path the same requests in that order.
"""

from __future__ import annotations

import copy
import random
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import VARIANT, assert_matches_reference
from fuzz_client import Client
from fuzz_configs import HISTORY, make_buffers, make_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_step

from bufc.requests import step as request_step
from bufc.runtime import BatchError, Request

# "llama:1": one beam per request, so steady steps take the shortest path (with block growth)
FAMILIES = (
    "llama",
    "llama:1",
    "llama_flash",
    "llama_flashinfer",
    "gpt",
    "glm",
    "medusa",
    "gpt_lora",
    "mamba",
)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Traffic:
    """The caller's side: its requests (the stateless copies) and the row order it expects."""

    def __init__(self, name: str, rng: random.Random, **overrides) -> None:
        self.name, self.rng = name, rng
        self.c = make_config(name, **overrides)
        self.client = Client(name, self.c, rng)
        self.mbs = self.c.max_batch_size
        self.mbw = getattr(self.c, "max_beam_width", 1)
        self.max_drafts = getattr(self.c, "max_draft_tokens", 0)
        self.exact = name == "medusa"
        self.whole = name in ("glm", "mamba")  # no context chunks
        self.separate = name == "mamba"  # context and generation in separate steps
        self.paged = self.client.paged
        self.shadow: dict[int, Request] = {}  # slot -> the stateless path's request
        self.waiting: list[int] = []  # context phase, arrival order
        self.rows: list[int] = []  # generation rows
        self.completing: list[int] = []  # prompts the last step finished
        self.drafts: dict[int, list[int]] = {}  # drafts verified in the last step
        self.target: dict[int, int] = {}
        self.generated_last = True  # the last step ran the generation rows

    # ---------------------------------------------------------------- between steps
    def finish(self, slot: int) -> None:
        if slot in self.rows:
            i = self.rows.index(slot)
            self.rows[i] = self.rows[-1]
            self.rows.pop()
        for lst in (self.waiting, self.completing):
            if slot in lst:
                lst.remove(slot)
        self.drafts.pop(slot, None)
        del self.shadow[slot]

    def arrival(self) -> Request:
        free = [s for s in range(self.mbs) if s not in self.shadow]
        self.client.free = free
        self.client.live = []
        r = self.client.new_request().req
        r.generated = ()
        if self.name == "glm":
            r.position_ids = None  # GLM's two-row layout has its own positions
        if r.position_ids is not None and max(r.position_ids) > 2**31 - 1000:
            r.position_ids = [min(p, 5000) for p in r.position_ids]  # far from the int32 edge
        if (
            self.max_drafts
            and not self.exact
            and int(r.beam_width) == 1
            and self.rng.random() < 0.3
            and self.name != "glm"
        ):
            r.draft_tokens = [
                self.client.token() for _ in range(self.rng.randint(1, self.max_drafts))
            ]
        slot = int(r.seq_slot)
        self.shadow[slot] = copy.deepcopy(r)
        self.waiting.append(slot)
        self.target[slot] = self.rng.randint(1, 12)
        return r

    # ---------------------------------------------------------------- one step
    def plan(self) -> dict:
        """The step's arguments for step(), applying them to the stateless requests."""
        rng = self.rng
        tok = np.array(
            [[self.client.token() for _ in range(self.mbw)] for _ in range(self.mbs)], np.int64
        )
        producers = self.completing + (self.rows if self.generated_last else [])
        accepted = {}
        for slot in producers:
            r = self.shadow[slot]
            beams = int(r.beam_width)
            verified = self.drafts.get(slot, [])
            n = rng.randint(0, len(verified)) if verified else 0
            if n:
                accepted[slot] = n
            if slot in self.completing:
                r.generated = [[] for _ in range(beams)]
            for k in range(beams):
                r.generated[k] += list(verified[:n]) + [int(tok[slot, k if self.mbw > 1 else 0])]
            if rng.random() < 0.3 and n:
                accepted[slot] = np.int64(n)
        self.rows += self.completing
        self.completing = []
        # a recurrent model runs context and generation requests in separate steps
        self.generation = not (self.separate and self.waiting and rng.random() < 0.5)
        rows = self.rows if self.generation else []
        # drafts of this step's generation requests
        drafts: dict[int, list[int]] = {}
        if self.max_drafts and (self.exact or rng.random() < 0.5):
            for slot in rows:
                if int(self.shadow[slot].beam_width) != 1:
                    continue
                if self.exact:
                    k = self.max_drafts
                elif rng.random() < 0.4:
                    k = rng.randint(1, self.max_drafts)
                else:
                    continue
                drafts[slot] = [self.client.token() for _ in range(k)]
        for slot in rows:
            self.shadow[slot].draft_tokens = drafts.get(slot, [])
        # context chunks within the token budget: every waiting request's rest, or some of
        # them in chunks
        budget = self.c.max_num_tokens - sum(
            int(self.shadow[s].beam_width) + len(drafts.get(s, [])) for s in rows
        )

        def cost(slot: int, chunk: int) -> int:
            r = self.shadow[slot]
            last = int(r.context_position) + chunk == len(r.prompt)
            return chunk + (len(r.draft_tokens or []) if last else 0)

        left = {
            s: len(self.shadow[s].prompt) - int(self.shadow[s].context_position)
            for s in self.waiting
        }
        chunks = None
        scheduled = list(self.waiting)
        if self.separate and rows:
            chunks, scheduled = {}, []  # a generation step
        elif sum(cost(s, left[s]) for s in self.waiting) > budget or rng.random() < 0.5:
            chunks = {}
            for slot in self.waiting:
                if rng.random() < 0.2 and (rows or chunks):
                    continue  # waits this step (a context-only step runs one at least)
                chunk = min(left[slot] if self.whole else rng.randint(1, left[slot]), budget)
                if self.whole and chunk < left[slot]:
                    continue  # ChatGLM/GLM compute a prompt in one step
                while chunk and cost(slot, chunk) > budget:
                    chunk -= 1
                if chunk:
                    chunks[slot] = chunk
                    budget -= cost(slot, chunk)
            scheduled = [s for s in self.waiting if s in chunks]
        for slot in scheduled:
            r = self.shadow[slot]
            r.context_chunk_size = None if chunks is None else chunks[slot]
        # KV blocks: enough for every sequence's tokens after the step (sometimes more)
        blocks: dict[int, list] = {}
        if self.paged:
            for slot, is_ctx in [(s, True) for s in scheduled] + [(s, False) for s in rows]:
                r = self.shadow[slot]
                before = [len(x) for x in r.kv_block_ids]
                self.client.cover(r, is_ctx, extra=1 if rng.random() < 0.1 else 0)
                new = [list(x[n:]) for x, n in zip(r.kv_block_ids, before)]
                if not any(new):
                    if rng.random() < 0.1:
                        blocks[slot] = []  # nothing new, handed over all the same
                    continue
                if len(new) == 1 or rng.random() < 0.5:
                    blocks[slot] = new
                elif all(len(x) == len(new[0]) for x in new) and all(x == new[0] for x in new):
                    blocks[slot] = new[0]  # the same ids for every list
                else:
                    blocks[slot] = new
        self.ctx = [self.shadow[s] for s in scheduled]
        self.gen = [self.shadow[s] for s in rows]
        self.scheduled = scheduled
        self.drafts = {s: d for s, d in drafts.items()}
        return dict(
            tokens=tok if producers else None,
            accepted=accepted,
            drafts=drafts,
            chunks=chunks,
            blocks=blocks,
            generation=self.generation,
        )

    def ran(self) -> None:
        """The step ran: the context positions move on; finished prompts produce tokens."""
        for slot in self.scheduled:
            r = self.shadow[slot]
            chunk = r.context_chunk_size
            end = len(r.prompt) if chunk is None else int(r.context_position) + chunk
            r.context_chunk_size = None
            if end == len(r.prompt):
                self.waiting.remove(slot)
                self.completing.append(slot)
                self.drafts[slot] = list(r.draft_tokens or [])
                r.draft_tokens = []
            else:
                r.context_position = end
        for slot in self.rows:
            self.drafts.setdefault(slot, [])
        self.generated_last = self.generation

    def done(self) -> list[int]:
        """Slots to finish: generation requests that reached their length, and a few at random
        (cancelled, whatever their phase)."""
        out = [s for s in self.rows if len(self.shadow[s].generated[0]) >= self.target[s]]
        if self.shadow and self.rng.random() < 0.1:
            out.append(self.rng.choice(sorted(self.shadow)))
        return list(dict.fromkeys(out))


def _diff(a, b) -> list[str]:
    got, want = a.tensors, b.tensors
    return [
        name
        for name, d in a.decls.items()
        if not any(d.fill is h for h in HISTORY) and not torch.equal(got[name].cpu(), want[name])
    ]


def run_traffic(
    name: str,
    seed: int,
    steps: int = 40,
    device: str = "cpu",
    device_tokens: bool = False,
    double_buffered: bool = True,
) -> Counter:
    """Drive both paths (the requests in flight on `device`, with the sampled tokens as a
    tensor there off the CPU, or with `device_tokens`, gathered there; with one staging half
    unless `double_buffered`); returns what the traffic exercised."""
    rng = random.Random(seed)
    name, _, beams = name.partition(":")
    overrides = {"max_beam_width": int(beams)} if beams else {}
    traffic = Traffic(name, rng, **overrides)
    flight = make_buffers(
        name,
        device=device,
        device_tokens=device_tokens or None,
        double_buffered=double_buffered,
        **overrides,
    )
    stateless = make_buffers(name, **overrides)
    seen: Counter = Counter()
    in_place = flight._advance_step

    def counted(*args):  # a steady step (advance forms)
        seen["steady"] += 1
        return in_place(*args)

    flight._advance_step = counted
    for i in range(steps):
        for slot in traffic.done():
            seen["moved" if slot in traffic.rows[:-1] else "finished"] += 1
            flight.finish(slot)
            traffic.finish(slot)
        quiet = rng.random() < 0.5  # a step without arrivals
        for _ in range(0 if quiet else rng.randint(0, min(3, traffic.mbs - len(traffic.shadow)))):
            flight.add(traffic.arrival())
        if not traffic.shadow:
            continue
        args = traffic.plan()
        if not traffic.ctx and not traffic.gen:
            traffic.ran()
            continue  # nothing scheduled: every waiting request waits
        want = None
        if name in VARIANT:
            kv = (
                (traffic.c.max_blocks_per_seq, traffic.c.num_local_layers)
                if traffic.paged
                else None
            )
            want = reference_step(
                VARIANT[name],
                copy.deepcopy(traffic.ctx),
                copy.deepcopy(traffic.gen),
                vocab_size=traffic.c.vocab_size,
                kv=kv,
            )
        seen["accepted"] += bool(args["accepted"])
        seen["chunked"] += any(
            r.context_chunk_size is not None and r.context_chunk_size < len(r.prompt)
            for r in traffic.ctx
        )
        seen["beams"] += any(int(r.beam_width) > 1 for r in traffic.gen)
        seen["grown"] += bool(args["blocks"])
        if (device != "cpu" or device_tokens) and args["tokens"] is not None:
            args["tokens"] = torch.as_tensor(args["tokens"], device=device)
        step = flight.step(**args)
        ref = stateless.prepare_step(traffic.ctx, traffic.gen)
        traffic.ran()
        assert step.sizes == ref.sizes, (seed, i)
        for key, view in step.inputs.items():  # the step's views, on their devices
            assert torch.equal(view.cpu(), ref.inputs[key]), (key, seed, i)
        if not device_tokens or i % 2:  # else the next step() takes the tokens back itself
            assert _diff(flight, stateless) == [], (seed, i)
        assert step.scalars == ref.scalars, (seed, i)
        n = step.sizes.num_requests
        slots = flight.tensors["host_seq_slots"][:n].tolist()
        assert slots == traffic.scheduled + [r.seq_slot for r in traffic.gen], (seed, i)
        if want is not None:
            assert_matches_reference(step, want, paged=traffic.paged, where=(seed, i))
        seen["steps"] += 1
    return seen


@pytest.mark.parametrize("name", FAMILIES)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_in_flight_equals_stateless_steps(name: str, seed: int) -> None:
    run_traffic(name, seed)


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), device_tokens=st.booleans())
def test_one_staging_half_in_flight_equals_stateless_steps(
    name: str, seed: int, device_tokens: bool
) -> None:
    """double_buffered=False: every step written in place into the one staging half (the
    continue, advance and KV forms read the values they overwrite) equals the stateless step,
    with tokens on the host or gathered on the device."""
    run_traffic(name, seed, device_tokens=device_tokens, double_buffered=False)


@pytest.mark.parametrize("name", ("llama", "llama:1", "medusa", "mamba"))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_tokens_gathered_on_the_device_equal_host_tokens(name: str, seed: int) -> None:
    """The sampled tokens as a tensor on the buffers' device (device_tokens, here the CPU):
    the device writes the generation rows and the host tensors and state catch up one step
    later; every tensor still equals the stateless step's."""
    run_traffic(name, seed, device_tokens=True)


@pytest.mark.parametrize("few", (0, 1000))
def test_block_appends_one_by_one_or_at_once_equal_the_stateless_step(monkeypatch, few):
    """The blocks a step appends, past FEW_BLOCKS slots checked and written at once (their
    ids and encoded rows in the block table), else one by one: with 0 and 1000 every step
    takes one path, and equals the stateless step's tensors (beams sharing one list, and lists
    taken back by refused steps, included)."""
    monkeypatch.setattr(request_step, "FEW_BLOCKS", few)  # appends one by one or at once
    seen = Counter()
    for seed in range(4):
        seen += run_traffic("llama", seed)
    assert seen["grown"] and seen["moved"] and seen["beams"]


@pytest.mark.parametrize("few", (0, 1000))
@pytest.mark.parametrize("tokens_per_block", (1, 2))
def test_decode_steps_write_the_grown_lists(monkeypatch, few, tokens_per_block):
    """Decode steps in flight whose sequences enter a new KV block every step or every other
    step (the half written two steps back then lacks two blocks, or one, of each list), the
    appends written one by one or at once (FEW_BLOCKS): every row holds its list's encoded
    ids (K = id * 2 * num_local_layers, V = K + 1, 0 past the list)."""
    monkeypatch.setattr(request_step, "FEW_BLOCKS", few)
    b = make_buffers("llama", max_beam_width=1, tokens_per_block=tokens_per_block)
    c = b.config
    n, next_id = c.max_batch_size, iter(range(1, 10_000))
    lists = {s: [next(next_id) for _ in range(-(-2 // tokens_per_block))] for s in range(n)}
    for s in range(n):
        b.add(Request(seq_slot=s, prompt=[1, 2], kv_block_ids=[list(lists[s])]))
    b.step()
    tokens, length = np.full(n, 9, np.int64), 2
    for _ in range(6):
        length += 1  # each sequence's tokens after this step
        blocks = {}
        for s in range(n):
            if len(lists[s]) * tokens_per_block < length:
                blocks[s] = [next(next_id)]
                lists[s] += blocks[s]
        b.step(tokens, blocks=blocks)
        rows = b.tensors["host_kv_cache_block_offsets"][0, :n].numpy()
        slots = b.tensors["host_seq_slots"][:n].tolist()
        for row, slot in zip(rows, slots):
            k = np.zeros(c.max_blocks_per_seq, np.int64)
            k[: len(lists[slot])] = np.array(lists[slot]) * 2 * c.num_local_layers
            v = np.where(np.arange(len(k)) < len(lists[slot]), k + 1, 0)
            assert row[0].tolist() == k.tolist() and row[1].tolist() == v.tolist()


def test_a_decode_step_past_the_blocks_appended_in_its_run_is_refused() -> None:
    """A run of decode steps whose lists grew in the run: the step that takes a sequence one
    token past its blocks (as the block table counts them, appends of the run included) is
    refused, naming it, with nothing changed, and the same step with the block runs."""
    b = make_buffers("llama", max_beam_width=1, tokens_per_block=2)
    n = b.config.max_batch_size
    for s in range(n):
        b.add(Request(seq_slot=s, prompt=[1, 2], kv_block_ids=[[10 * s + 1]]))
    b.step()
    tokens = np.full(n, 9, np.int64)
    b.step(tokens, blocks={s: [10 * s + 2] for s in range(n)})  # 3 tokens (a full step)
    b.step(tokens)  # 4 tokens: a decode step
    b.step(tokens, blocks={s: [10 * s + 3] for s in range(n)})  # 5 tokens, the third block
    b.step(tokens)  # 6 tokens
    before = {k: v.clone() for k, v in b.tensors.items()}
    with pytest.raises(
        BatchError,
        match=r"seq_slot 0\): kv_block_ids holds 3 blocks, but its tokens after this step need 4",
    ):
        b.step(tokens, blocks={s: [10 * s + 4] for s in range(1, n)})
    assert all(torch.equal(before[k], v) for k, v in b.tensors.items())
    b.step(tokens, blocks={s: [10 * s + 4] for s in range(n)})
    assert b.tensors["host_sequence_lengths"][:n].tolist() == [7] * n


def test_traffic_exercises_every_change() -> None:
    """The simulation itself: steps in place and in full, rows moved by finishes, chunked
    prompts, accepted drafts, beams and grown block lists all occur."""
    seen = run_traffic("llama", 7, steps=80) + run_traffic("gpt", 3, steps=80)
    seen += run_traffic("llama:1", 5, steps=80)
    kinds = ("steady", "moved", "finished", "chunked", "accepted", "beams", "grown")
    for what in kinds:
        assert seen[what] >= 3, (what, seen)
    assert seen["steps"] >= 120


def test_an_out_of_range_token_on_the_device_is_not_written_and_then_refused() -> None:
    """A sampled token outside the vocabulary, gathered on the device: its row gets the pad
    token, the next step names the slot, and finishing that request clears it."""
    c = make_config("llama", max_beam_width=1)
    b = make_buffers("llama", device_tokens=True, max_beam_width=1)
    for slot in (0, 1):
        b.add(
            Request(
                seq_slot=slot,
                prompt=[5, 6, 7],
                kv_block_ids=[[3 * slot + 1, 3 * slot + 2, 3 * slot + 3]],
            )
        )
    b.step()
    tokens = torch.zeros(c.max_batch_size, dtype=torch.int64)
    tokens[0], tokens[1] = c.vocab_size, 42  # slot 0's token is one past the vocabulary
    step = b.step(tokens)
    assert step.inputs["input_ids"].tolist() == [0, 42]
    assert b.tensors["host_input_ids"][:2].tolist() == [0, 42]  # the host half caught up
    with pytest.raises(
        BatchError, match=rf"sampled token {c.vocab_size} for seq_slot 0, .*finish\(0\)"
    ):
        b.step(tokens)
    b.finish(0)
    tokens[1] = 43
    assert b.step(tokens).inputs["input_ids"].tolist() == [43]


def test_a_steady_step_with_tokens_on_the_device_copies_only_the_block_table() -> None:
    """Steady decode with the tokens on the device (device_tokens, here the CPU): input ids,
    positions and lengths are written on the device, so the only bytes copied up are the block
    table's used rows (it has no device form); with host tokens the whole arena goes up."""
    c = make_config("llama", max_beam_width=1)
    n = c.max_batch_size
    copied = {}
    for on_device in (True, False):
        b = make_buffers("llama", device_tokens=on_device, max_beam_width=1)
        for s in range(n):
            b.add(
                Request(seq_slot=s, prompt=[1, 2], kv_block_ids=[[3 * s + 1, 3 * s + 2, 3 * s + 3]])
            )
        b.step()
        tokens = torch.full((n,), 9, dtype=torch.int64)
        b.step(tokens if on_device else tokens.numpy())  # a full step: every row promoted
        before = b.bytes_to_device
        for _ in range(4):
            b.step(tokens if on_device else tokens.numpy())
        copied[on_device] = (b.bytes_to_device - before) // 4
        assert b.tensors["input_ids"][:n].tolist() == [9] * n
    kv = b.tensors["host_kv_cache_block_offsets"]
    assert kv.shape[0] == 1  # one pool: the used rows are one prefix
    assert copied[True] == n * 2 * kv.shape[-1] * kv.element_size()
    assert copied[False] > copied[True] + 3 * n * 4  # at least ids, positions, lengths


def _decoding(b) -> None:
    """Two requests in slots 0 and 1, their 3-token prompts computed: the next step decodes."""
    for slot in (0, 1):
        b.add(Request(seq_slot=slot, prompt=[5, 6, 7], kv_block_ids=[[slot + 1]]))
    b.step()


def _tokens() -> np.ndarray:
    return np.full(6, 9, np.int64)  # max_batch_size tokens, indexed by seq slot


def _decoded(b) -> None:  # one decode step: the next one needs a second 4-token block
    b.step(_tokens())


def _decoded_and_arrived(b) -> None:  # the same, and a request arrives: a full step
    _decoded(b)
    b.add(Request(seq_slot=2, prompt=[1, 2], kv_block_ids=[[20]]))


def _with_prompt(b) -> None:  # a 9-token prompt arrives with one block: it needs three
    b.add(Request(seq_slot=2, prompt=list(range(1, 10)), kv_block_ids=[[20]]))


def _bad_token(b) -> None:
    tokens = _tokens()
    tokens[0] = 1000  # vocab_size
    b.step(tokens)


REFUSED = {  # case: (setup on both buffers, the refused call, its message, the good step after)
    "slot out of range": (
        None,
        lambda b: b.add(Request(seq_slot=9, prompt=[1])),
        r"request \(seq_slot 9\): seq_slot must be an integer in 0 \.\. 5",
        None,
    ),
    "slot taken": (
        None,
        lambda b: b.add(Request(seq_slot=0, prompt=[1], kv_block_ids=[[9]])),
        r"request \(seq_slot 0\): seq_slot 0 already holds a request in flight",
        None,
    ),
    "chunk on the request": (
        None,
        lambda b: b.add(
            Request(seq_slot=2, prompt=[1, 2], kv_block_ids=[[9]], context_chunk_size=1)
        ),
        r"request \(seq_slot 2\): in flight, context chunks are scheduled per step",
        None,
    ),
    "finish an empty slot": (
        None,
        lambda b: b.finish(4),
        r"finish\(\): seq_slot 4 holds no request in flight",
        None,
    ),
    "chunk of a decoding request": (
        None,
        lambda b: b.step(_tokens(), chunks={0: 1}),
        r"step\(\): chunks\[0\]: that seq slot holds no request in its context phase",
        None,
    ),
    "chunk past the prompt": (
        lambda b: b.add(Request(seq_slot=2, prompt=[1, 2, 3], kv_block_ids=[[20]])),
        lambda b: b.step(_tokens(), chunks={2: 4}),
        r"step\(\): chunks\[2\] = 4, not a chunk size in 1 \.\. 3 \(the prompt tokens left\)",
        None,
    ),
    "blocks for an empty slot": (
        None,
        lambda b: b.step(_tokens(), blocks={4: [30]}),
        r"step\(\): blocks\[4\]: that seq slot holds no request",
        None,
    ),
    "tokens missing": (
        None,
        lambda b: b.step(),
        r"step\(\): the last step produced tokens; pass them",
        None,
    ),
    "token outside the vocabulary": (
        None,
        _bad_token,
        r"step\(\): token 1000 of a request in flight is outside 0 \.\. 999",
        None,
    ),
    "generation list too short (steady)": (
        _decoded,
        lambda b: b.step(_tokens()),
        r"generation request 0 \(seq_slot 0\): kv_block_ids holds 1 blocks, but its tokens "
        r"after this step need 2; allocate the blocks before scheduling",
        lambda b: b.step(_tokens(), blocks={0: [40], 1: [41]}),
    ),
    "generation list too short (churn)": (
        _decoded_and_arrived,
        lambda b: b.step(_tokens()),
        r"generation request 0 \(seq_slot 0\): kv_block_ids holds 1 blocks, but its tokens "
        r"after this step need 2; allocate the blocks before scheduling",
        lambda b: b.step(_tokens(), blocks={0: [40], 1: [41]}),
    ),
    "appended block outside the pool (steady)": (
        _decoded,
        lambda b: b.step(_tokens(), blocks={0: [40], 1: [64]}),
        r"step\(\): blocks\[1\]: KV block id 64 is outside 0 \.\. 63 \(num_kv_blocks=64\)",
        lambda b: b.step(_tokens(), blocks={0: [40], 1: [41]}),
    ),
    "appended block outside the pool (churn)": (
        _decoded_and_arrived,
        lambda b: b.step(_tokens(), blocks={0: [40], 1: [64]}),
        r"step\(\): blocks\[1\]: KV block id 64 is outside 0 \.\. 63 \(num_kv_blocks=64\)",
        lambda b: b.step(_tokens(), blocks={0: [40], 1: [41]}),
    ),
    "appended blocks past the width": (
        _decoded,
        lambda b: b.step(_tokens(), blocks={1: [41], 0: list(range(30, 46))}),
        r"step\(\): blocks\[0\]: 17 KV blocks exceed max_blocks_per_seq=16",
        lambda b: b.step(_tokens(), blocks={0: [40], 1: [41]}),
    ),
    "appended block id a bool": (
        _decoded,
        lambda b: b.step(_tokens(), blocks={1: [41], 0: [True]}),
        r"step\(\): blocks\[0\]: kv_block_ids block 0 is True, not an integer",
        lambda b: b.step(_tokens(), blocks={0: [40], 1: [41]}),
    ),
    "context list too short": (
        _with_prompt,
        lambda b: b.step(_tokens()),
        r"context request 0 \(seq_slot 2\): kv_block_ids holds 1 blocks, but its tokens after "
        r"this step need 3",
        lambda b: b.step(_tokens(), blocks={2: [21, 22]}),
    ),
}


@pytest.mark.parametrize("few_blocks", (8, 0))
@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_call_names_the_culprit_and_changes_nothing(
    monkeypatch, case: str, few_blocks: int
) -> None:
    """Each refusal of add, finish and step, with its message; the state is as it was (blocks
    a refused step appended are taken back), so the next good step equals that of buffers that
    never saw the refused call. With FEW_BLOCKS at 0 the appends try the all-at-once path
    first, which leaves a bad one to the slot-by-slot path that names it."""
    monkeypatch.setattr(request_step, "FEW_BLOCKS", few_blocks)
    setup, refused, message, good = REFUSED[case]
    b, twin = make_buffers("llama", max_beam_width=1), make_buffers("llama", max_beam_width=1)
    for x in (b, twin):
        _decoding(x)
        if setup is not None:
            setup(x)
    with pytest.raises(BatchError, match=message):
        refused(b)
    for x in (b, twin):
        (good or (lambda y: y.step(_tokens())))(x)
    got, want = b.tensors, twin.tensors
    assert [n for n in got if not torch.equal(got[n], want[n])] == []


def test_a_sequence_past_the_attention_window_needs_only_the_window_in_flight() -> None:
    """llama's window is 16 blocks of 4 tokens: a 70-token prompt with 16 blocks, arriving
    beside a decoding request, is covered (the rows stay cyclic), in its context step and as
    it decodes, equal to the stateless steps; with 15 blocks it is refused, naming the blocks
    it needs."""
    prompt = [(7 * i) % 1000 for i in range(70)]
    flight, stateless = make_buffers("llama"), make_buffers("llama")
    first = Request(seq_slot=0, prompt=[5, 6, 7], kv_block_ids=[[20, 21]])
    flight.add(Request(seq_slot=0, prompt=[5, 6, 7], kv_block_ids=[[20, 21]]))
    flight.step()
    stateless.prepare_step([first], [])
    flight.add(Request(seq_slot=3, prompt=prompt, kv_block_ids=[list(range(16))]))
    long = Request(seq_slot=3, prompt=prompt, kv_block_ids=[list(range(16))])
    first.generated, ctx, sampled = [[9]], [long], 9
    for token in (11, 12, 13):  # what each step samples
        step = flight.step(np.full(6, sampled, np.int64))
        want = stateless.prepare_step(ctx, [first] if ctx else [first, long])
        for key, view in step.inputs.items():
            assert torch.equal(view, want.inputs[key]), (key, token)
        ctx, sampled = [], token
        for r in (first, long):
            r.generated = [[*(r.generated[0] if r.generated else []), token]]
    short = make_buffers("llama")
    short.add(Request(seq_slot=0, prompt=[5, 6, 7], kv_block_ids=[[20, 21]]))
    short.step()
    short.add(Request(seq_slot=3, prompt=prompt, kv_block_ids=[list(range(15))]))
    with pytest.raises(
        BatchError, match=r"holds 15 blocks, but its tokens after this step need 16"
    ):
        short.step(np.full(6, 9, np.int64))
