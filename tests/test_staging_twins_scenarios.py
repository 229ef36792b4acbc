"""Targeted scenarios for in-flight steps, on the battery's twins (staging_twins.py):
refusals between steps, CUDA-graph captures, slots finished and
reused, chunked prompts and computed prefixes, alternating paths, token forms, many block
appends and the window, drafts, stateless steps between runs in flight, failed fills. After
every call both twins agree, and each scenario checks the path it targets was taken.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from fuzz_configs import make_buffers
from staging_twins import (
    FAMILIES,
    Traffic,
    Twins,
    _arrive,
    _diff,
    _grow,
    _serving,
)

from bufc.runtime import Request


@pytest.mark.parametrize("name", FAMILIES)
def test_refusals_between_in_flight_steps(name: str) -> None:
    """Every kind of refusal in a run of in-flight steps: each changes nothing (on both
    twins) and the next step equals the twin's."""
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
        tw.step(tokens, blocks=blocks, expect="full")


@pytest.mark.parametrize("name", FAMILIES)
def test_refused_twice_then_in_flight(name: str) -> None:
    """Two refusals in a row (blocks appended then taken back, twice), then in-flight steps
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
        tw.step(tokens, blocks=blocks, expect="full")


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("arrivals", [False, True])
def test_cuda_graph_capture_then_steps(name: str, arrivals: bool) -> None:
    """prepare_for_cuda_graph after a generation-only step (full or steady), then
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
    assert "full" in tw.paths, tw.paths


@pytest.mark.parametrize("name", FAMILIES)
def test_capture_after_a_in_flight_generation_only_step(name: str) -> None:
    """An in-flight step without context rows (a finish refilled a row), captured, then a
    full step again two steps on (the captured half written again)."""
    tw = _serving(name, rows=6)
    tw.step(tw.tokens(seed=2), blocks=_grow(tw), expect="full")
    tw.finish(1)
    tw.step(tw.tokens(seed=3), blocks=_grow(tw), expect="full")
    for b in (tw.ours, tw.full):
        b.prepare_for_cuda_graph(5)
    tw.check()
    for i, expect in enumerate(["full", "full", "full", "full"]):
        tw.finish(int(tw.full._flight.rows[0]))  # row 0 refilled by the last row
        tw.step(tw.tokens(seed=4 + i), blocks=_grow(tw), expect=expect)  # after a capture: full


@pytest.mark.parametrize("name", FAMILIES)
def test_same_slot_finished_and_reused(name: str) -> None:
    """The same slot finished and taken again by add() before each of many in-flight steps:
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
        tw.step(tw.tokens(seed=i), blocks=_grow(tw), expect="full")
        tw.check()


@pytest.mark.parametrize("name", FAMILIES)
def test_finish_while_waiting_or_just_completed(name: str) -> None:
    """A request finished while its prompt waits (chunked, partly computed), and one finished
    right after its prompt completed, between in-flight steps."""
    tw = _serving(name)
    tw.add(tw.request(6, list(range(1, 13))))  # 12 tokens, chunked 3 a step
    _arrive(tw, 7)
    tw.step(tw.tokens(seed=2), chunks={6: 3}, blocks=_grow(tw), expect="full")  # 7 waits
    tw.step(tw.tokens(seed=3), chunks={6: 3}, blocks=_grow(tw), expect="full")
    tw.finish(6)  # mid-prompt
    tw.step(tw.tokens(seed=4), chunks={7: 3}, blocks=_grow(tw), expect="full")
    tw.finish(7)  # its prompt just completed: it never joins the generation rows
    _arrive(tw, 8)
    tw.step(tw.tokens(seed=5), blocks=_grow(tw), expect="full")
    _arrive(tw, 7)
    tw.step(tw.tokens(seed=6), blocks=_grow(tw), expect="full")


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
            expect="full" if i == 0 else "full",
        )
    tw.add(tw.request(8, [3] * 6))
    tw.add(tw.request(9, [4] * 7))
    tw.step(tw.tokens(seed=9), chunks={8: 4, 9: 1}, blocks=_grow(tw), expect="full")
    tw.step(tw.tokens(seed=10), chunks={8: 2}, blocks=_grow(tw), expect="full")
    tw.step(tw.tokens(seed=11), chunks={9: 2}, blocks=_grow(tw), expect="full")
    tw.step(tw.tokens(seed=12), chunks={9: 2}, blocks=_grow(tw), expect="full")
    tw.step(tw.tokens(seed=13), blocks=_grow(tw), expect="full")  # its last 2
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
        tw.step(tw.tokens(seed=i), blocks=_grow(tw), expect="full")


@pytest.mark.parametrize("name", FAMILIES)
def test_alternating_paths(name: str) -> None:
    """full, full (another layout), steady (generation only, nothing changed),
    full (a refill) ... with `tensors` read between steps."""
    tw = _serving(name, tpb=1)
    for i in range(4):
        _arrive(tw, Traffic(tw, random.Random(0)).free()[0])
        tw.step(tw.tokens(seed=10 * i), blocks=_grow(tw), expect="full")
        tw.check()
        tw.step(tw.tokens(seed=10 * i + 1), blocks=_grow(tw), expect="full")  # 6 joins
        tw.step(tw.tokens(seed=10 * i + 2), blocks=_grow(tw), expect="steady")
        tw.check()
        tw.step(tw.tokens(seed=10 * i + 3), blocks=_grow(tw), expect="steady")
        tw.finish(0)
        tw.step(tw.tokens(seed=10 * i + 4), blocks=_grow(tw), expect="full")
        tw.finish(int(tw.full._flight.rows[tw.full._flight.n_rows - 1]))  # the last row
        tw.step(tw.tokens(seed=10 * i + 5), blocks=_grow(tw), expect="full")
        free = Traffic(tw, random.Random(0)).free()
        tw.add(tw.request(free[0], [4, 4, 4]))
        tw.step(tw.tokens(seed=10 * i + 6), blocks=_grow(tw), expect="full")  # another layout
        tw.check()


@pytest.mark.parametrize("name", FAMILIES)
def test_token_forms(name: str) -> None:
    """The sampled tokens as numpy arrays of other integer dtypes, lists, [slots, k] tables,
    longer arrays and torch CPU tensors, in in-flight steps."""
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
        tw.step(form(tokens), blocks=_grow(tw), expect="full", full_tokens=tokens)


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
    """Tokens as a tensor on the buffers' device (CPU, device_tokens=True) in in-flight
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
            expect="full" if i == 0 else "full",
        )
        tw.check()


@pytest.mark.parametrize("tpb", [1, 2])
def test_many_appends_and_the_window(tpb: int) -> None:
    """Ten decoding rows that each take a block every step or two (more than 8 slots: the
    appends checked and written at once), their lists growing to max_blocks_per_seq and
    staying there (the window); each step one prompt arrives (its layout repeats) and the
    one that joined the step before finishes (the last row: no refill)."""
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
        tw.step(tw.tokens(seed=i + 1), blocks=_grow(tw), expect="full")
        tw.finish(21 - slot)  # the prompt of the step before, now the last row
    counts = tw.full._flight.kv.count[:10]
    assert (counts == width).all(), counts
    assert tw.paths.count("full") > 20


def test_many_appends_one_block_each_and_lists() -> None:
    """Appends to more than 8 slots in one in-flight step in each form: one id each, several
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
        tw.step(tw.tokens(seed=i + 1), blocks=blocks, expect="full")


def test_a_prompt_longer_than_the_window() -> None:
    """Prompts longer than the attention window (their lists fill it) in in-flight steps."""
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
        tw.step(tw.tokens(seed=i + 1), blocks=_grow(tw), expect="full")


@pytest.mark.parametrize("name", FAMILIES)
def test_generation_false_with_no_producer(name: str) -> None:
    """A chunk of a prompt with generation=False, then a second such chunk (the rows sat out
    the step before: no request produced a token), then a third chunk with generation on:
    nothing produced, so the full step takes tokens=None."""
    tw = _serving(name)
    tw.add(tw.request(6, list(range(1, 13))))
    tw.step(tw.tokens(seed=2), chunks={6: 3}, blocks=_grow(tw), expect="full")
    tw.step(tw.tokens(seed=3), chunks={6: 3}, generation=False, expect="full")
    tw.step(None, chunks={6: 3}, generation=False, expect="full")  # nothing produced
    tw.step(None, chunks={6: 3}, blocks=_grow(tw))  # nothing to read: tokens=None


@pytest.mark.parametrize("name", FAMILIES)
def test_generation_false_with_no_producer_tokens_given(name: str) -> None:
    """As above, the caller passing a token array anyway."""
    tw = _serving(name)
    tw.add(tw.request(6, list(range(1, 13))))
    tw.step(tw.tokens(seed=2), chunks={6: 3}, blocks=_grow(tw), expect="full")
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
    """chunks naming a slot that holds no prompt in its context
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
    assert "full" in tw.paths


@pytest.mark.parametrize("name", ["llama"])
def test_a_bad_token_on_the_device(name: str) -> None:
    """A token outside the vocabulary, on the device, in an in-flight step: both twins
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
    tw.step(torch.as_tensor(bad), blocks=_grow(tw), expect="full")
    tw.check()
    tw.step(torch.as_tensor(tw.tokens(seed=3)), blocks=_grow(tw), expect="refused")
    tw.finish(2)
    tw.add(tw.request(2, [9] * 3))
    tw.step(torch.as_tensor(tw.tokens(seed=4)), blocks=_grow(tw), expect="full")
    tw.check()


def test_explicit_positions_leave_then_in_flight() -> None:
    """(gpt) A request with explicit position ids in flight keeps every step in full; once
    it finishes (its row refilled), the steps after it agree."""
    tw = _serving("gpt")
    r = tw.request(6, [5, 5, 5])
    r.position_ids = [10, 20, 30]
    tw.add(r)
    tw.step(tw.tokens(seed=2), expect="full")
    _arrive(tw, 7)
    tw.step(tw.tokens(seed=3), expect="full")
    tw.finish(6)
    _arrive(tw, 8)
    tw.step(tw.tokens(seed=4), expect="full")
    tw.finish(0)
    _arrive(tw, 9)
    tw.step(tw.tokens(seed=5), expect="full")


@pytest.mark.parametrize("name", FAMILIES)
def test_drafts_then_in_flight(name: str) -> None:
    """Draft tokens verified on two rows, some accepted, then in-flight steps (arrivals and
    refills): the kept rows' values follow the full steps that took the drafts."""
    tw = _serving(name, tpb=1, extra=8)
    tw.step(tw.tokens(seed=2), drafts={0: [4, 5], 3: [6]}, blocks=_grow(tw, 3), expect="full")
    tw.step(tw.tokens(seed=3), accepted={0: 2, 3: 0}, blocks=_grow(tw, 3), expect="full")
    _arrive(tw, 6)
    tw.step(tw.tokens(seed=4), blocks=_grow(tw, 3), expect="full")
    _arrive(tw, 7)
    tw.step(tw.tokens(seed=5), blocks=_grow(tw, 3), expect="full")
    tw.finish(1)
    _arrive(tw, 1)
    tw.step(tw.tokens(seed=6), blocks=_grow(tw, 3), expect="full")
    tw.step(tw.tokens(seed=7), drafts={3: [1, 2, 3]}, blocks=_grow(tw, 4), expect="full")
    tw.finish(3)  # its drafts verified, it leaves: no draft in flight
    _arrive(tw, 3)
    tw.step(tw.tokens(seed=8), blocks=_grow(tw, 3))
    _arrive(tw, 8)
    tw.step(tw.tokens(seed=9), blocks=_grow(tw, 3), expect="full")


@pytest.mark.parametrize("name", FAMILIES)
def test_stateless_steps_between_runs_in_flight(name: str) -> None:
    """A run in flight with in-flight steps, every request finished, stateless steps
    (prepare_step, advance) on both halves, then requests in flight again."""
    tw = _serving(name, tpb=1, extra=6)
    for i in range(3):
        _arrive(tw, 5 + i)
        tw.step(tw.tokens(seed=i), blocks=_grow(tw), expect="full")
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
        tw.step(tw.tokens(seed=10 + i), blocks=_grow(tw), expect="full" if i == 0 else "full")
        tw.finish(int(tw.full._flight.rows[0]))


@pytest.mark.parametrize("name", FAMILIES)
def test_block_keys_and_values_of_other_types(name: str) -> None:
    """blocks keyed by numpy integers, their ids numpy arrays or tuples, in in-flight
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
        tw.step(tw.tokens(seed=i), blocks=blocks, expect="full")
        tw.finish(10 + i % 2)


def test_prepare_step_after_every_request_finished() -> None:
    """Every request in flight finished, the last one right after
    its prompt completed: nothing is in flight, and prepare_step runs (the finish takes the
    prompt off the table's completing list)."""
    b = make_buffers("gpt", max_beam_width=1)
    b.add(Request(seq_slot=0, prompt=[1, 2, 3]))
    b.step()
    b.finish(0)
    assert all(e is None for e in b._flight.entries)
    b.prepare_step([Request(seq_slot=0, prompt=[1, 2])], [])


@pytest.mark.parametrize("name", FAMILIES)
def test_a_failed_fill_then_in_flight_steps(name: str) -> None:
    """A fill that raises after its checks passed (a bug, injected: the last rule) abandons
    the half it was writing on both; the steps after it (writing that half again) still
    agree. (Both have two staging halves: with one, the failed step's half is the last
    step's, partly written.)"""
    from bufc.rules import core

    tw = _serving(name, halves=2)
    _arrive(tw, 5)
    tw.step(tw.tokens(seed=2), blocks=_grow(tw), expect="full")
    _arrive(tw, 6)
    tokens, blocks = tw.tokens(seed=3), _grow(tw)

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core, "seq_slots", boom)
        tw.step(tokens, blocks=blocks, expect="refused", same_message=True)
    tw.step(tokens, blocks=blocks, expect="full")  # the step again, into that half
    for i in range(6):
        _arrive(tw, Traffic(tw, random.Random(0)).free()[0])
        if i % 2:
            tw.finish(int(tw.full._flight.rows[0]))
        tw.step(tw.tokens(seed=4 + i), blocks=_grow(tw), expect="full")
        tw.check()
