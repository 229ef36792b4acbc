"""Steps built at a CUDA-graph bucket (``bucket=(tokens, rows)``): every tensor laid out at the
bucket's sizes whatever its layout (several KV pools or groups, LoRA's [modules, layers,
sequences], ChatGLM's [2, tokens]), each bucket view holding its unpadded twin's values and its
declared pad elsewhere; a bucket the layout would misplace is refused by views()."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from conftest import batch, make_buffers
from fuzz_compare import bucket_pad_problems
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_features import MODULES, lora_batch

from bufc.errors import BatchError
from bufc.runtime import Request

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TPB = 4
WINDOWS = [8, 64, 8]  # per layer: two KV pools (TensorRT-LLM) or groups (FlashAttention)


def _moved(b, sizes, layout) -> list[str]:
    return b._relayout.moved(sizes, layout)  # noqa: SLF001 - what the bucket lays out anew


def _same_step(twin, padded, ctx, gen, extra: tuple[int, int]) -> None:
    """One step through the unpadded twin and through `padded` at a bucket `extra` larger:
    the bucket's views hold the twin's values, and their pads past them."""
    want = twin.prepare_step(copy.deepcopy(ctx), copy.deepcopy(gen))
    s = want.sizes
    rows = min(extra[1], twin.config.max_batch_size - s.num_requests)  # a padded row: a request
    bucket = (s.num_tokens + extra[0], s.num_sequences + rows)
    got = padded.prepare_step(ctx, gen, bucket=bucket)
    layout = s.padded(*bucket)
    assert got.sizes == s and got.scalars == want.scalars
    assert bucket_pad_problems(padded, want, layout) == []
    views, _ = padded.views(layout)
    assert all(views[n] is v or views[n].equal(v) for n, v in got.inputs.items())


@SETTINGS
@given(lora_batch(), lora_batch(), st.tuples(st.integers(0, 5), st.integers(1, 3)))
def test_lora_steps_at_a_bucket_equal_their_twin(first, second, extra) -> None:
    twin, padded = (make_buffers("gpt_lora", lora_modules=MODULES) for _ in range(2))
    for ctx, gen in (first, second):
        _same_step(twin, padded, ctx, gen, extra)


@SETTINGS
@given(batch("chatglm"), batch("chatglm"), st.tuples(st.integers(1, 5), st.integers(0, 3)))
def test_chatglm_steps_at_a_bucket_equal_their_twin(first, second, extra) -> None:
    twin, padded = (make_buffers("chatglm") for _ in range(2))
    for ctx, gen in (first, second):
        _same_step(twin, padded, ctx, gen, extra)


def _windowed(family: str):
    return make_buffers(
        family,
        max_beam_width=1,
        max_draft_tokens=0,
        num_layers=3,
        attention_windows=WINDOWS,
        tokens_per_block=TPB,
        max_attention_window=64,
    )


@pytest.mark.parametrize("family", ["llama", "llama_flash"])
@pytest.mark.parametrize("seed", range(4))
def test_two_window_steps_in_flight_at_a_bucket_equal_their_twin(family: str, seed: int) -> None:
    """Two windows, each its own block lists: the pools' (or groups') rows at the bucket's
    sequences, over arrivals, chunks, decode steps, block appends, finishes and slot reuse;
    a step at no bucket between them reads as before."""
    rng = random.Random(seed)
    twin, padded = _windowed(family), _windowed(family)
    windows = twin.config.attention_window_sizes
    assert len(windows) == 2
    lists: dict[int, dict[int, list[int]]] = {}
    counts: dict[int, int] = {}
    next_block = [1]

    def new_blocks(n: int) -> list[int]:
        out = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        rng.shuffle(out)
        return out

    def arrive(slot: int) -> None:
        n = rng.randint(1, 9)
        lists[slot] = {w: new_blocks(-(-(n + 1) // TPB)) for w in windows}
        counts[slot] = n
        prompt = [rng.randrange(100) for _ in range(n)]
        for b in (twin, padded):
            b.add(
                Request(slot, prompt, kv_block_ids={w: [list(x)] for w, x in lists[slot].items()})
            )

    for slot in range(3):
        arrive(slot)
    tokens = None
    moved = set()
    for i in range(10):
        blocks: dict = {}
        if tokens is not None:
            for slot in list(counts):
                counts[slot] += 1
                need = -(-(counts[slot] + 1) // TPB)
                for w in windows:
                    if need > len(lists[slot][w]):
                        grown = new_blocks(need - len(lists[slot][w]))
                        lists[slot][w] += grown
                        blocks.setdefault(slot, {})[w] = grown
        want = twin.step(tokens, blocks=copy.deepcopy(blocks))
        s = want.sizes
        if i % 4 == 3:  # now and then a step at no bucket
            padded.step(tokens, blocks=blocks)
        else:
            bucket = (s.num_tokens + rng.randint(0, 3), s.num_sequences + rng.randint(1, 3))
            got = padded.step(tokens, blocks=blocks, bucket=bucket)
            layout = s.padded(*bucket)
            moved |= set(_moved(padded, s, layout))
            assert got.sizes == s and got.scalars == want.scalars
            assert bucket_pad_problems(padded, want, layout) == [], i
        tokens = np.zeros(twin.config.max_batch_size, np.int64)
        tokens[list(counts)] = [rng.randrange(100) for _ in counts]
        if rng.random() < 0.4:
            slot = rng.choice(sorted(counts))
            for b in (twin, padded):
                b.finish(slot)
            del counts[slot], lists[slot]
            arrive(slot)
    assert moved  # the pools' or groups' rows did not lead: they were laid out anew


def test_a_bucket_the_layout_would_misplace_is_refused_by_views() -> None:
    """Views at sizes the step was not built at stay refused where the rows do not lead, with
    a message naming the call that builds a step at its bucket."""
    b = _windowed("llama_flash")
    b.add(Request(0, [1, 2, 3], kv_block_ids={8: [[1]], 64: [[2]]}))
    step = b.step()
    with pytest.raises(ValueError, match=r"step\(\.\.\., bucket=\(tokens, rows\)\)"):
        b.views(step.sizes.padded(8, 4))
    step = b.step([5] + [0] * 7, bucket=(8, 4))
    assert b.views(step.sizes.padded(8, 4))[0]["group_block_tables"].shape[1] == 4


def test_a_step_over_its_bucket_is_refused_before_a_byte_is_written() -> None:
    b = make_buffers("chatglm")
    ctx, gen = [Request(0, [1, 2, 3, 4])], []
    before = {n: t.clone() for n, t in b.tensors.items()}
    with pytest.raises(
        BatchError,
        match=r"^the step has 4 tokens and 1 sequences, more than its bucket \(tokens, rows\) = "
        r"\(3, 1\): pick a larger bucket$",
    ):
        b.prepare_step(ctx, gen, bucket=(3, 1))
    with pytest.raises(BatchError, match=r"^bucket must be \(tokens, rows\), two non-negative"):
        b.prepare_step(ctx, gen, bucket=[8, 2])
    assert all(b.tensors[n].equal(t) for n, t in before.items())


def test_a_bucket_beyond_a_capacity_is_refused() -> None:
    b = make_buffers("chatglm")
    ctx = [Request(0, [1, 2, 3, 4])]
    rows = b.config.max_num_sequences + 1
    with pytest.raises(
        BatchError, match=r"^at the bucket \w+ would be \[.*\], beyond its capacity"
    ):
        b.prepare_step(ctx, [], bucket=(8, rows))


def test_an_unbound_tensor_keeps_the_steps_layout_at_a_bucket() -> None:
    """The beam-search copy lists (bound to no engine name: the decoder reads them at the
    step's sizes, [3, num_generation_requests]) are not moved by a bucket; a bucket may be
    given as numpy integers."""
    twin, padded = (make_buffers("llama", max_beam_width=2, tokens_per_block=4) for _ in range(2))
    gen = [
        Request(s, [1, 2, 3], generated=[[4], [5]], beam_width=2, kv_block_ids=[[1 + s, 9 + s]])
        for s in (0, 1)
    ]
    want = twin.prepare_step([], copy.deepcopy(gen))
    got = padded.prepare_step([], gen, bucket=(np.int64(6), np.int64(6)))
    n = want.sizes.num_generation_requests
    for name in ("host_cache_indirection_copies", "host_cache_indirection_decoder_copies"):
        rows = want.sizes.num_requests if "decoder" in name else n
        assert (
            padded.tensors[name]
            .flatten()[: 3 * rows]
            .equal(twin.tensors[name].flatten()[: 3 * rows])
        ), name
    assert got.sizes == want.sizes
