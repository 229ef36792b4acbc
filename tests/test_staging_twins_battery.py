"""Adversarial scenarios for in-flight steps: two RuntimeBuffers of one family take identical
calls, one with two staging halves (or tokens on the device), the other with one half and host
tokens; after every call the two must agree (every tensor, the step's sizes, scalars and
views), a call refused by one must be refused by the other, and a refused call changes nothing
(on either). The messages are compared only where a test asks (``same_message``).

Each scenario also checks that the path it targets was taken (full or steady), so a scenario
that drifts off it is noticed.

Found by this battery when steps could continue the last one in place, and fixed: a step after
a generation=False step (whose rows produced no token) was continued as if every row had
produced one (test_*generation_false*, test_sat_out_*); a steady step took `chunks` for a slot
not in its context phase, which a full step refuses; a prompt finished right after its last
chunk kept the buffers "in flight" for prepare_step (test_staging_twins_scenarios.py:
test_a_steady_step_ignores_chunks, test_prepare_step_after_every_request_finished). The twins
and the battery's traffic are in staging_twins.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from staging_twins import (
    FAMILIES,
    Twins,
    _arrive,
    _grow,
    _sat_out,
    _serving,
    fuzz,
)

from bufc.runtime import BatchError


# ------------------------------------------------------------------------------------ basics
@pytest.mark.parametrize("name", FAMILIES)
def test_generation_false_then_in_flight(name: str) -> None:
    """A step with generation=False (the generation rows sit out, produce nothing), then a
    step of the same context layout: the rows that sat out produced no token, so their input
    is their last token and their length does not grow."""
    tw = Twins(name)
    tw.add(tw.request(0, [1, 2, 3]))
    tw.step(expect="full")
    tw.add(tw.request(1, [4, 5, 6]))
    tw.step(tw.tokens(seed=1), expect="full")  # slot 1's prompt, slot 0 joins
    tw.add(tw.request(2, [7, 8, 9]))
    tw.step(tw.tokens(seed=2), generation=False, expect="full")  # slot 0 sits out
    tw.add(tw.request(3, [1, 1, 1]))
    # slot 3's prompt (the layout of the last step), slots 0, 1 decode, slot 2 joins
    tw.step(tw.tokens(seed=3))
    tw.add(tw.request(4, [2, 2, 2]))
    tw.step(tw.tokens(seed=4))
    # the rows that sat out did not produce: that step and the next run in full
    assert tw.paths[-2:] == ["full", "full"], tw.paths


@pytest.mark.parametrize("name", FAMILIES)
def test_drafted_row_finished_then_in_flight(name: str) -> None:
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
def test_drafted_row_finished_then_arrival_in_flight(name: str) -> None:
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
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("seed", range(12))
def test_battery(name: str, seed: int) -> None:
    """Refusals, graph captures, chunked prompts, prefixes, drafts, token forms, same-slot
    reuse, finishes of waiting and just-completed prompts; no generation=False steps (see
    test_battery_generation_false)."""
    fuzz(name, seed)


def test_the_battery_takes_every_path() -> None:
    """The battery's traffic itself: it runs steps in full, refuses some and advances some."""
    from collections import Counter

    paths = Counter()
    for name in FAMILIES:
        for seed in range(4):
            paths.update(fuzz(name, seed))
    assert paths["full"] >= 40 and paths["refused"] >= 15 and paths["steady"] >= 3, paths


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("seed", range(6))
def test_battery_generation_false(name: str, seed: int) -> None:
    fuzz(name, 100 + seed, gen_false=True)


@pytest.mark.parametrize("seed", range(6))
def test_battery_device_tokens(seed: int) -> None:
    fuzz("llama", 200 + seed, device_tokens=True)


# ------------------------------------ generation=False, then a step of the same context layout
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
    tw.step(tw.tokens(seed=1), blocks={0: tw.ids(1)}, expect="full")  # slot 0: 4 tokens
    tw.add(tw.request(2, [7, 8, 9], extra=0))
    # slots 0 and 1 sit out (their tokens 5 and 4 are computed in a later step)
    tw.step(tw.tokens(seed=2), generation=False, expect="full")
    tw.add(tw.request(3, [1, 1, 1], extra=0))
    # slot 0 has 4 tokens + its sampled one = 5: one more block; slot 1 4: one more; slot 2 4
    blocks = {0: tw.ids(1), 1: tw.ids(1), 2: tw.ids(1)}
    tw.step(tw.tokens(seed=3), blocks=blocks)


@pytest.mark.parametrize("name", FAMILIES)
def test_sat_out_rows_with_device_tokens(name: str) -> None:
    """As test_generation_false_then_in_flight, both twins taking tokens on the device."""
    tw = Twins(name, both_on_device=True)
    tw.add(tw.request(0, [1, 2, 3]))
    tw.step(expect="full")
    tw.add(tw.request(1, [4, 5, 6]))
    tw.step(torch.as_tensor(tw.tokens(seed=1)), expect="full")
    tw.add(tw.request(2, [7, 8, 9]))
    tw.step(torch.as_tensor(tw.tokens(seed=2)), generation=False, expect="full")
    tw.add(tw.request(3, [1, 1, 1]))
    tw.step(torch.as_tensor(tw.tokens(seed=3)))
    tw.check()


@pytest.mark.parametrize("name", FAMILIES)
def test_two_bad_tokens(name: str) -> None:
    """Two tokens out of the vocabulary, a kept row's and a joining prompt's: both twins
    refuse (the messages name different ones: ours the first in row order, the full step
    the joining prompt's first), and the next in-flight step runs."""
    tw = _serving(name)
    _arrive(tw, 5)
    tokens, blocks = tw.tokens(seed=3), _grow(tw)
    bad = tokens.copy()
    bad[4] = tw.c.vocab_size + 4  # slot 4: the prompt the last step completed
    bad[0] = tw.c.vocab_size  # slot 0: a kept row
    tw.step(bad, blocks=blocks, expect="refused")
    tw.step(tokens, blocks=blocks, expect="full")
