"""TensorRT-LLM's KV-pool order, mapping and encoding (bufc.rules.pools) against the
loop-by-loop reference (tests/reference_pools.py), over random per-layer windows and KV head
counts, pipeline ranks included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from reference_pools import reference_offsets, reference_pools

from bufc.rules.pools import encode, kv_pools


@st.composite
def layouts(draw: st.DrawFn) -> tuple:
    pp = draw(st.integers(1, 4))
    local = draw(st.integers(1, 12))
    rank = draw(st.integers(0, pp - 1))
    windows = draw(st.lists(st.sampled_from([8, 16, 64, 4096]), max_size=6))
    heads = draw(st.lists(st.integers(1, 8), max_size=6))
    return windows, heads, 4096, rank * local, local


@settings(max_examples=300, deadline=None)
@given(layouts(), st.sampled_from([1, 1, 2, 3]))
def test_pools_match_the_reference(layout: tuple, period: int) -> None:
    """Every layer attention (period 1) or a hybrid's attention layers (RecurrentGemma's
    period 3): the pools hold the rank's attention layers alone."""
    windows, heads, default, first, local = layout
    want = reference_pools(windows, heads, default, first, local, period)
    got = kv_pools(windows, heads, default, first, local, period)
    assert list(got.mapping) == want["mapping"]
    assert list(got.layers) == want["layers_in_pool"]
    assert list(got.windows) == want["pool_window"]
    assert list(got.layer_windows) == want["layer_window"]
    # every pool's layers are indexed 0 .. n - 1 by the mapping
    for p, n in enumerate(got.layers):
        assert sorted(i for q, i in got.mapping if q == p) == list(range(n))


@settings(max_examples=100, deadline=None)
@given(layouts(), st.lists(st.lists(st.integers(0, 1000), max_size=5), min_size=1, max_size=4))
def test_encoding_matches_the_reference(layout: tuple, lists: list) -> None:
    pools = kv_pools(*layout)
    want = reference_offsets(lists, list(pools.layers), 5)
    for p, n_layers in enumerate(pools.layers):
        for s, blocks in enumerate(lists):
            for field in (0, 1):
                row = [encode(b, n_layers, field) for b in blocks] + [0] * (5 - len(blocks))
                assert row == want[p][s][field]


def test_the_pool_of_a_layer_encodes_with_its_own_layer_count() -> None:
    """Two windows over 6 layers, heads (2, 8) repeating: 4 pools, window ascending, then
    heads; the layers in a pool, not the model's 6, multiply a block id."""
    pools = kv_pools([16, 4096], [2, 2, 8], 4096, 0, 6)
    # layer: window, heads = 0: 16,2  1: 4096,2  2: 16,8  3: 4096,2  4: 16,2  5: 4096,8
    assert pools.windows == (16, 16, 4096, 4096)
    assert pools.heads == (2, 8, 2, 8)
    assert pools.layers == (2, 1, 2, 1)
    assert pools.mapping == ((0, 0), (2, 0), (1, 0), (2, 1), (0, 1), (3, 0))
    assert encode(7, pools.layers[0], 1) == 7 * 2 * 2 + 1
    assert pools.distinct_windows == (16, 4096)


# ------------------------------------------------- the TensorRT-LLM families' head-count pools
import random  # noqa: E402

import numpy as np  # noqa: E402
from conftest import make_buffers  # noqa: E402

from bufc.runtime import Request  # noqa: E402

TPB = 4


def _offsets(b, step) -> np.ndarray:
    s = step.sizes
    return (
        step.inputs["host_kv_cache_block_offsets"]
        .numpy()
        .copy()
        .reshape(b.config.num_kv_pools, s.num_sequences, 2, b.config.max_blocks_per_seq)
    )


def _want(b, lists: list[list[int]]) -> list:
    return reference_offsets(lists, list(b.config.kv_pool_layers), b.config.max_blocks_per_seq)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(1, 8), min_size=1, max_size=5),  # kv heads per layer
    st.integers(0, 2**31 - 1),  # traffic seed
)
def test_every_pool_of_an_in_flight_step_matches_the_reference(heads: list, seed: int) -> None:
    """Requests arrive, decode (their block lists growing), finish and are replaced, through
    full and decode steps; each step's offsets of every pool equal the reference's encoding
    of the block table's lists, in the step's row order."""
    rng = random.Random(seed)
    b = make_buffers(
        "llama",
        max_beam_width=1,
        max_draft_tokens=0,
        num_layers=6,
        kv_heads_per_layer=heads,
        tokens_per_block=TPB,
        max_attention_window=64,
    )
    assert b.config.num_kv_pools == len(set(heads[i % len(heads)] for i in range(6)))
    lists: dict[int, list[int]] = {}
    counts: dict[int, int] = {}  # tokens of each slot's sequence after its last step
    next_block = [0]

    def new_blocks(n: int) -> list[int]:
        out = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        rng.shuffle(out)
        return out

    def arrive(slot: int) -> None:
        n = rng.randint(1, 9)
        lists[slot] = new_blocks(-(-(n + 1) // TPB))
        counts[slot] = n
        b.add(Request(slot, [rng.randrange(100) for _ in range(n)], kv_block_ids=[lists[slot]]))

    for slot in range(4):
        arrive(slot)
    tokens = None
    for _ in range(8):
        blocks = {}
        if tokens is not None:  # the last step's sequences decode one more token
            for slot in list(counts):
                counts[slot] += 1
                need = -(-(counts[slot] + 1) // TPB)
                if need > len(lists[slot]):
                    grown = new_blocks(need - len(lists[slot]))
                    lists[slot] += grown
                    blocks[slot] = grown
        step = b.step(tokens, blocks=blocks)
        got = _offsets(b, step)
        slots = b.tensors["host_seq_slots"][: step.sizes.num_sequences].tolist()
        assert got.tolist() == _want(b, [lists[s] for s in slots])
        tokens = np.zeros(b.config.max_batch_size, np.int64)
        if rng.random() < 0.4:  # one finishes, another arrives in its slot
            slot = rng.choice(sorted(counts))
            b.finish(slot)
            del counts[slot], lists[slot]
            step_tokens = tokens
            arrive(slot)
            tokens = step_tokens


def test_every_pool_of_a_stateless_step_matches_the_reference() -> None:
    b = make_buffers(
        "llama",
        max_beam_width=1,
        max_draft_tokens=0,
        num_layers=4,
        kv_heads_per_layer=[8, 2, 2, 4],
        tokens_per_block=TPB,
        max_attention_window=64,
    )
    assert b.config.kv_pool_layers == (2, 1, 1)  # heads 2, 4, 8
    assert b.static_inputs["host_kv_cache_pool_mapping"].tolist() == [
        [2, 0],
        [0, 0],
        [0, 1],
        [1, 0],
    ]
    ctx = Request(0, [1, 2, 3, 4, 5], kv_block_ids=[[7, 3]])
    gen = Request(1, [1, 2], generated=[[5, 6, 7]], kv_block_ids=[[11, 12]])
    step = b.prepare_step([ctx], [gen])
    assert _offsets(b, step).tolist() == _want(b, [[7, 3], [11, 12]])
    step = b.prepare_step([], [gen])
    assert _offsets(b, step).tolist() == _want(b, [[11, 12]])
    for token in (9, 10, 11, 12, 13):  # decode steps: advance() continues every pool
        gen.generated[0].append(token)
        if len(gen.prompt) + len(gen.generated[0]) > TPB * len(gen.kv_block_ids[0]):
            gen.kv_block_ids[0].append(40 + token)
        step = b.advance([token])
        assert _offsets(b, step).tolist() == _want(b, gen.kv_block_ids)


# ------------------------------------------------------- per-layer windows: a pool per window
import pytest  # noqa: E402

from bufc.errors import BatchError  # noqa: E402


def _windowed(windows: list, heads: list, layers: int = 6):
    return make_buffers(
        "llama",
        max_beam_width=1,
        max_draft_tokens=0,
        num_layers=layers,
        attention_windows=windows,
        kv_heads_per_layer=heads,
        tokens_per_block=TPB,
        max_attention_window=64,
    )


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.sampled_from([8, 16, 64]), min_size=1, max_size=4),  # windows per layer
    st.lists(st.integers(1, 4), max_size=3),  # kv heads per layer
    st.integers(0, 2**31 - 1),
)
def test_each_window_s_pools_take_its_own_block_lists(windows, heads, seed) -> None:
    """Several attention windows: a request carries {window: lists}, step(blocks=) appends
    per window, and every pool's rows are its window's lists encoded with its layer count
    (the reference's pool order), over arrivals, decode steps and finishes."""
    rng = random.Random(seed)
    b = _windowed(windows, heads)
    ref = reference_pools(windows, heads, 64, 0, 6)
    sizes = sorted(set(ref["pool_window"]))
    assert b.config.attention_window_sizes == tuple(sizes)
    assert b.static_inputs["host_kv_cache_pool_mapping"].tolist() == [
        list(m) for m in ref["mapping"]
    ]
    assert b.tensors["host_max_attention_window_sizes"].tolist() == ref["layer_window"]
    lists: dict[int, dict[int, list[int]]] = {}
    counts: dict[int, int] = {}
    next_block = [0]

    def new_blocks(n: int) -> list[int]:
        out = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        rng.shuffle(out)
        return out

    def arrive(slot: int) -> None:
        n = rng.randint(1, 9)
        lists[slot] = {w: new_blocks(-(-(n + 1) // TPB)) for w in sizes}
        counts[slot] = n
        prompt = [rng.randrange(100) for _ in range(n)]
        b.add(Request(slot, prompt, kv_block_ids={w: [x] for w, x in lists[slot].items()}))

    for slot in range(3):
        arrive(slot)
    tokens = None
    for _ in range(8):
        blocks: dict = {}
        if tokens is not None:
            for slot in list(counts):
                counts[slot] += 1
                need = -(-(counts[slot] + 1) // TPB)
                for w in sizes:
                    if need > len(lists[slot][w]):
                        grown = new_blocks(need - len(lists[slot][w]))
                        lists[slot][w] += grown
                        blocks.setdefault(slot, {})[w] = grown
        step = b.step(tokens, blocks=blocks)
        s = step.sizes
        slots = b.tensors["host_seq_slots"][: s.num_sequences].tolist()
        got = _offsets(b, step)
        width = b.config.max_blocks_per_seq
        for p, (layers, window) in enumerate(zip(ref["layers_in_pool"], ref["pool_window"])):
            want = reference_offsets([lists[x][window] for x in slots], [layers], width)[0]
            assert got[p].tolist() == want, (p, window)
        tokens = np.zeros(b.config.max_batch_size, np.int64)
        if rng.random() < 0.4:
            slot = rng.choice(sorted(counts))
            b.finish(slot)
            del counts[slot], lists[slot]
            arrive(slot)


def test_several_windows_refuse_what_does_not_name_them() -> None:
    b = _windowed([8, 64], [])
    with pytest.raises(BatchError, match=r"one set of block lists per attention window"):
        b.add(Request(0, [1, 2, 3], kv_block_ids=[[1]]))
    with pytest.raises(BatchError, match=r"got the windows \[8\]"):
        b.add(Request(0, [1, 2, 3], kv_block_ids={8: [[1]]}))
    with pytest.raises(BatchError, match=r"window 64: kv_block_ids block 0 is 'x'"):
        b.add(Request(0, [1, 2, 3], kv_block_ids={8: [[1]], 64: [["x"]]}))
    b.add(Request(0, [1, 2, 3], kv_block_ids={8: [[1]], 64: [[2]]}))
    with pytest.raises(BatchError, match=r"blocks\[0\]: with several attention windows"):
        b.step(blocks={0: [5]})
    with pytest.raises(BatchError, match="its block list of attention window 64 holds 0"):
        b.finish(0)
        b.add(Request(0, [1, 2, 3], kv_block_ids={8: [[1]], 64: [[]]}))
        b.step()
    with pytest.raises(BatchError, match="only requests in flight carry"):
        _windowed([8, 64], []).prepare_step([Request(0, [1], kv_block_ids=[[1]])], [])
    with pytest.raises(Exception, match="need beam width 1"):
        make_buffers("llama", max_beam_width=2, attention_windows=[8, 64], max_attention_window=64)
    with pytest.raises(Exception, match="at most max_attention_window"):
        make_buffers("llama", attention_windows=[8, 128], max_attention_window=64)


def test_a_pipeline_rank_maps_its_own_layers_to_its_pools() -> None:
    """Under pipeline parallelism the windows and head counts are the model's, per global layer;
    each rank's pools hold its own layers (gpt_pp's rank 1 of 2 holds layers 4 .. 7)."""
    windows, heads = [16, 64, 64], [2, 4]
    kw = dict(num_layers=8, pp_size=2, attention_windows=windows, kv_heads_per_layer=heads)
    kw |= dict(max_attention_window=64, max_beam_width=1, max_draft_tokens=0, hidden_size=32)
    b = make_buffers("gpt_pp", pp_rank=1, **kw)
    want = reference_pools(windows, heads, 64, 4, 4)
    assert b.config.kv_pool_layers == tuple(want["layers_in_pool"])
    assert b.static_inputs["host_kv_cache_pool_mapping"].tolist() == [
        list(m) for m in want["mapping"]
    ]
    # layer 4 + i: window windows[(4 + i) % 3], as host_max_attention_window_sizes says
    assert b.tensors["host_max_attention_window_sizes"].tolist() == [64, 64, 16, 64]


# ------------------------------------------- a hybrid model: the pool holds its attention layers
from bufc.errors import ConfigError  # noqa: E402
from bufc.generated import recurrentgemma  # noqa: E402


def _hybrid(**overrides) -> recurrentgemma.Config:
    values = dict(
        max_batch_size=2,
        max_num_tokens=16,
        vocab_size=256,
        num_layers=3,
        max_attention_window=8,
        tokens_per_block=4,
        num_kv_blocks=8,
        attention_layer_period=3,
    )
    return recurrentgemma.Config(**{**values, **overrides})


def test_a_hybrid_models_block_ids_are_encoded_with_its_attention_layers() -> None:
    """RecurrentGemma with one attention layer in three: TensorRT-LLM's pool holds that one
    layer (createKvCacheManager counts attention layers), so block b is b * 1 * 2 (+1 for V),
    not b * 3 * 2 as when every layer was counted."""
    b = recurrentgemma.RuntimeBuffers(_hybrid())
    b.add(Request(seq_slot=0, prompt=[1, 2, 3, 4, 5], kv_block_ids=[[5, 7]]))
    step = b.step(None, generation=False)
    assert step.inputs["kv_cache_block_offsets"].tolist() == [[[[10, 14], [11, 15]]]]
    stateless = recurrentgemma.RuntimeBuffers(_hybrid())
    step = stateless.prepare_step([Request(0, [1, 2, 3, 4, 5], kv_block_ids=[[5, 7]])], [])
    assert step.inputs["kv_cache_block_offsets"].tolist() == [[[[10, 14], [11, 15]]]]


def test_a_hybrid_models_pool_mapping_and_windows_cover_its_attention_layers() -> None:
    """Written at construction, as llama's: (0, a) for the a-th attention layer of the rank
    (getLayerToPoolMapping), one window per attention layer; before, the hybrid mapping was a
    static the caller had to set, and stayed zeros (both attention layers wrote layer 0)."""
    c = _hybrid(num_layers=7)  # attention layers 2 and 5
    b = recurrentgemma.RuntimeBuffers(c)
    assert c.kv_pool_layers == (2,) and c.num_local_attention_layers == 2
    assert b.static_inputs["host_kv_cache_pool_mapping"].tolist() == [[0, 0], [0, 1]]
    assert b.tensors["host_max_attention_window_sizes"].tolist() == [8, 8]
    b.add(Request(seq_slot=1, prompt=[1, 2, 3], kv_block_ids=[[3]]))
    step = b.step(None, generation=False)
    assert step.inputs["kv_cache_block_offsets"].tolist() == [[[[12, 0], [13, 0]]]]


def test_a_pipeline_ranks_pools_hold_its_own_attention_layers() -> None:
    """Eight layers, one attention layer in three (layers 2 and 5), over two ranks of four:
    rank 0 holds layer 2, rank 1 layer 5; windows repeat per attention layer of the model."""
    rank0 = kv_pools([16, 64], [], 64, 0, 4, 3)
    rank1 = kv_pools([16, 64], [], 64, 4, 4, 3)
    assert (rank0.layers, rank0.mapping, rank0.layer_windows) == ((1,), ((0, 0),), (16,))
    assert (rank1.layers, rank1.mapping, rank1.layer_windows) == ((1,), ((0, 0),), (64,))


def test_a_hybrid_models_block_ids_are_bounded_by_its_pool() -> None:
    """The int32 index of a pool of one layer encodes ids below 2**30 (b * 2 + 1); the bound
    once counted all three layers and refused ids from 2**31 // 6 up."""
    b = recurrentgemma.RuntimeBuffers(_hybrid(num_kv_blocks=0))
    b.add(Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids=[[2**30 - 1]]))
    assert b.step(None, generation=False).inputs["kv_cache_block_offsets"][0, 0, 1, 0] == 2**31 - 1
    with pytest.raises(BatchError, match="the int32 block index of a 1-layer KV pool"):
        b.add(Request(seq_slot=1, prompt=[1, 2, 3], kv_block_ids=[[2**30]]))


def test_attention_layer_period_is_a_recurrent_familys() -> None:
    with pytest.raises(ConfigError, match="only a recurrent family has layers without attention"):
        make_buffers("llama", attention_layer_period=2)
    with pytest.raises(ConfigError, match="this rank has no attention layer"):
        _hybrid(num_layers=2)


@pytest.mark.parametrize("name", ["attention_windows", "kv_heads_per_layer"])
def test_a_per_layer_list_longer_than_the_layers_is_refused(name: str) -> None:
    """Four layers and five values: the fifth would never be read (the list repeats when
    shorter, and is cut when longer), so the Config refuses it."""
    values = [16, 32, 64, 64, 64] if name == "attention_windows" else [2, 2, 4, 4, 8]
    with pytest.raises(ConfigError, match=f"{name} gives one .* per layer at most"):
        make_buffers("llama", num_layers=4, max_attention_window=64, **{name: values})
