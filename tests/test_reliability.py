"""The request layer's reliability findings (issue 24), one test each: every value is checked
by the call that hands it over, nothing accepted is refused later, a refused call changes
nothing, and the caller's own objects cannot change what was accepted.

Each test failed on the runtime before the fix; the message each refusal gives is asserted.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from fuzz_configs import make_buffers

from bufc.requests import batch
from bufc.rules import adapters, core, encoder_decoder, features, kv_rows
from bufc.runtime import BatchError, Request

LORA_ROW = ("attn_qkv", 0, 4096, 8192, None, 8)  # gpt_lora: modules attn_qkv, attn_dense, ...


def _tokens(value: int = 9) -> np.ndarray:
    return np.full(6, value, np.int64)  # max_batch_size tokens, indexed by seq slot


def _decoding(b) -> None:
    """Requests in slots 0 and 1 with their 3-token prompts computed: the next step decodes."""
    for slot in (0, 1):
        b.add(Request(seq_slot=slot, prompt=[5, 6, 7], kv_block_ids=[[slot + 1, slot + 10]]))
    b.step()


def _same(b, twin) -> list[str]:
    got, want = b.tensors, twin.tensors
    return [n for n in got if not torch.equal(got[n], want[n])]


# ------------------------------------------------------------------ add checks everything
BAD_ARRIVALS = {
    "a bool in the prompt": (
        "llama",
        dict(kv_block_ids=[[3]], prompt=[True, 5]),
        r"request \(seq_slot 2\): prompt\[0\] must be an integer, got True",
    ),
    "a bool in a long prompt that starts with token 1 (BOS)": (
        "llama",
        dict(kv_block_ids=[[3]], prompt=[1] + [7] * 40 + [False] + [9] * 20),
        r"request \(seq_slot 2\): prompt\[41\] must be an integer, got False",
    ),
    "a bool among the drafts": (
        "llama",
        dict(kv_block_ids=[[3]], draft_tokens=[4, True]),
        r"request \(seq_slot 2\): draft_tokens\[1\] must be an integer, got True",
    ),
    "a bool among the positions": (
        "llama",
        dict(kv_block_ids=[[3]], position_ids=[0, True, 2]),
        r"request \(seq_slot 2\): position_ids\[1\] must be an integer, got True",
    ),
    "no KV block lists": (
        "llama",
        dict(kv_block_ids=None),
        r"request \(seq_slot 2\): kv_block_ids needs one block list \(shared by all beams\) "
        r"or one per beam, got None",
    ),
    "a negative KV block id": (
        "llama",
        dict(kv_block_ids=[[-1]]),
        r"request \(seq_slot 2\): KV block id -1 is outside 0 \.\. 63 \(num_kv_blocks=64\)",
    ),
    "a KV block id past the pool": (
        "llama",
        dict(kv_block_ids=[[64]]),
        r"request \(seq_slot 2\): KV block id 64 is outside 0 \.\. 63 \(num_kv_blocks=64\)",
    ),
    "a KV block id that is no integer": (
        "llama",
        dict(kv_block_ids=[["a"]]),
        r"request \(seq_slot 2\): kv_block_ids block 0 is 'a', not an integer",
    ),
    "a one-token ChatGLM prompt": (
        "chatglm",
        dict(prompt=[5]),
        r"request \(seq_slot 2\): a ChatGLM prompt ends with its \[gMASK\] and <sop> tokens",
    ),
    "explicit positions for GLM": (
        "glm",
        dict(position_ids=[0, 1, 2]),
        r"request \(seq_slot 2\): explicit position_ids are not supported by the ChatGLM/GLM",
    ),
    "a LoRA module the engine lacks": (
        "gpt_lora",
        dict(kv_block_ids=[[3]], lora_weights=[("nope", 0, 1, 2, None, 8)]),
        r"request \(seq_slot 2\): LoRA module 'nope' is not one of the engine's lora_modules",
    ),
    "a LoRA layer past the model": (
        "gpt_lora",
        dict(kv_block_ids=[[3]], lora_weights=[("attn_qkv", 99, 1, 2, None, 8)]),
        r"request \(seq_slot 2\): LoRA layer 99 is outside 0\.\.3 \(num_layers=4\)",
    ),
}


@pytest.mark.parametrize("case", BAD_ARRIVALS)
def test_add_refuses_a_bad_request_and_keeps_nothing(case: str) -> None:
    """A request the step could not run is refused by add() (before: accepted, and then every
    step failed for the whole batch until it was finished); the slot stays free and the other
    requests run on, equal to buffers that never saw it."""
    name, fields, message = BAD_ARRIVALS[case]
    b, twin = make_buffers(name, max_beam_width=1), make_buffers(name, max_beam_width=1)
    for x in (b, twin):
        _decoding(x)
    request = Request(seq_slot=2, prompt=[1, 2, 3])
    for k, v in fields.items():
        setattr(request, k, v)
    with pytest.raises(BatchError, match=message):
        b.add(request)
    for x in (b, twin):
        x.step(_tokens())
        x.add(Request(seq_slot=2, prompt=[1, 2], kv_block_ids=[[5]]))  # the slot is free
        x.step(_tokens())
    assert _same(b, twin) == []


PROMPT = dict(max_prompt_embedding_table_size=8 * 5, hidden_size=4)  # 5 rows per request
MROPE = dict(PROMPT, max_position_embeddings=6, rotary_embedding_dim=2)
_MROPE_GOOD = dict(mrope_rotary_cos_sin=torch.zeros(12), mrope_position_deltas=0)
FEATURE_ARRIVALS = {
    "a prompt table of the wrong width": (
        "gpt_prompt_tuning",
        PROMPT,
        {},
        dict(prompt_table=torch.zeros(3, 3)),
        r"request \(seq_slot 2\): prompt_table must be \[vocab, hidden_size=4\], got \[3, 3\]",
    ),
    "a prompt id past its table": (
        "gpt_prompt_tuning",
        PROMPT,
        {},
        dict(prompt=[1, 1000 + 3], prompt_table=torch.zeros(2, 4, dtype=torch.float16)),
        r"request \(seq_slot 2\): token 1003 reads prompt-table row 3, but its table has 2 rows",
    ),
    "an M-RoPE table of the wrong size": (
        "qwen2_vl",
        MROPE,
        _MROPE_GOOD,
        dict(mrope_rotary_cos_sin=torch.zeros(5), mrope_position_deltas=0),
        r"request \(seq_slot 2\): mrope_rotary_cos_sin needs max_position_embeddings \* "
        r"rotary_embedding_dim = 12 values, got 5 values",
    ),
    "no M-RoPE position delta": (
        "qwen2_vl",
        MROPE,
        _MROPE_GOOD,
        dict(mrope_position_deltas=None),
        r"request \(seq_slot 2\): a request in flight needs mrope_position_deltas",
    ),
}


@pytest.mark.parametrize("case", FEATURE_ARRIVALS)
def test_add_refuses_a_bad_feature_field(case: str) -> None:
    """A prompt table or an M-RoPE table no step could read is refused by add() (before:
    accepted, then every step refused the whole batch until that request was finished)."""
    name, config, good, fields, message = FEATURE_ARRIVALS[case]
    b = make_buffers(name, max_beam_width=1, **config)
    twin = make_buffers(name, max_beam_width=1, **config)
    for x in (b, twin):
        for slot in (0, 1):
            x.add(Request(seq_slot=slot, prompt=[5, 6, 7], kv_block_ids=[[slot + 1]], **good))
        x.step()
    request = Request(seq_slot=2, prompt=[1, 2, 3], kv_block_ids=[[3]], **good)
    for k, v in fields.items():
        setattr(request, k, v)
    with pytest.raises(BatchError, match=message):
        b.add(request)
    for x in (b, twin):
        x.step(_tokens())
    assert _same(b, twin) == []


def test_add_accepts_a_good_lora_request() -> None:
    b = make_buffers("gpt_lora", max_beam_width=1)
    b.add(Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids=[[0]], lora_weights=[LORA_ROW]))
    b.step()


# -------------------------------------------------------- step checks what it is handed
def test_tokens_with_a_bool_are_refused() -> None:
    b = make_buffers("llama", max_beam_width=1)
    _decoding(b)
    tokens = [9] * 6
    tokens[1] = True
    with pytest.raises(BatchError, match=r"step\(\) needs integer tokens indexed by seq slot"):
        b.step(tokens)
    b.step([9] * 6)


def test_drafts_with_a_bool_are_refused() -> None:
    b = make_buffers("llama", max_beam_width=1)
    _decoding(b)
    with pytest.raises(BatchError, match=r"step\(\): drafts\[0\] must be a list of token ids"):
        b.step(_tokens(), drafts={0: [True, 4]})


def test_blocks_for_a_waiting_request_are_checked_by_that_step() -> None:
    """Blocks handed to a request that waits in this step are checked by this step (before:
    accepted, and the next step was refused, blaming a later call); the refused step changes
    nothing, and good blocks for a waiting request are kept for its turn."""
    b, twin = make_buffers("llama", max_beam_width=1), make_buffers("llama", max_beam_width=1)
    for x in (b, twin):
        _decoding(x)
        x.add(Request(seq_slot=2, prompt=[1, 2, 3], kv_block_ids=[[30]]))
    with pytest.raises(BatchError, match=r"KV block id 64 is outside 0 \.\. 63"):
        b.step(_tokens(), chunks={}, blocks={2: [64]})
    for x in (b, twin):
        x.step(_tokens(), chunks={}, blocks={2: [31]})
        x.step(_tokens())
    assert _same(b, twin) == []


def test_medusa_drafts_are_a_fixed_tree_in_both_entry_points() -> None:
    """The family's own request check (requests.checks: fixed_drafts): every generation
    request carries max_draft_tokens drafts; fewer are refused by the step, which changes
    nothing, in flight and stateless alike."""
    b, twin = make_buffers("medusa"), make_buffers("medusa")
    for x in (b, twin):
        _decoding(x)
    message = (
        r"generation request 0 \(seq_slot 0\): Medusa verifies a fixed tree, so every "
        r"generation request carries max_draft_tokens=3 draft tokens; got 2"
    )
    with pytest.raises(BatchError, match=message):
        b.step(_tokens(), drafts={0: [4, 5], 1: [4, 5, 6]})
    for x in (b, twin):
        x.step(_tokens(), drafts={0: [4, 5, 6], 1: [4, 5, 6]})
    assert _same(b, twin) == []
    stateless = make_buffers("medusa")
    gen = Request(seq_slot=0, prompt=[5, 6, 7], generated=[[9]], draft_tokens=[1, 2])
    gen.kv_block_ids = [[1]]
    with pytest.raises(BatchError, match=message):
        stateless.prepare_step([], [gen])


@pytest.mark.parametrize("value", [None, 0, 1, "yes", np.bool_(True)])
def test_generation_must_be_a_bool(value) -> None:
    """generation=None used to run no generation rows, silently."""
    b = make_buffers("llama", max_beam_width=1)
    _decoding(b)
    with pytest.raises(BatchError, match=r"step\(\): generation must be True or False, got"):
        b.step(_tokens(), generation=value)
    b.step(_tokens(), generation=True)


def test_a_stateless_prompt_with_a_bool_is_refused() -> None:
    b = make_buffers("llama", max_beam_width=1)
    with pytest.raises(BatchError, match=r"prompt\[1\] must be an integer, got True"):
        b.prepare_step([Request(seq_slot=0, prompt=[3, True], kv_block_ids=[[1]])], [])


# ---------------------------------------------------- the caller's objects after the call
def test_a_prompt_array_edited_after_add_changes_nothing() -> None:
    """An int64 numpy prompt was kept by reference: edited after add() it was written
    unchecked and wrapped in int32 (input_ids [5, 6, -727379968, 8])."""
    b = make_buffers("llama", max_beam_width=1)
    prompt = np.array([5, 6, 7, 8], np.int64)
    positions = np.array([0, 1, 2, 3], np.int64)
    b.add(Request(seq_slot=0, prompt=prompt, position_ids=positions, kv_block_ids=[[1]]))
    prompt[2] = 2**32 + 5
    positions[3] = -4
    step = b.step()
    assert step.inputs["input_ids"].tolist() == [5, 6, 7, 8]
    assert step.inputs["position_ids"].tolist() == [0, 1, 2, 3]


def test_block_lists_edited_after_add_change_nothing() -> None:
    b = make_buffers("llama", max_beam_width=1)
    blocks = [[3, 4]]
    b.add(Request(seq_slot=0, prompt=[5, 6, 7], kv_block_ids=blocks))
    blocks[0][0] = "x"
    blocks.append([1])
    b.step()
    assert b.tensors["host_kv_cache_block_offsets"][0, 0, 0, :2].tolist() == [3 * 8, 4 * 8]


def test_a_stateless_prompt_refilled_in_place_is_read_again() -> None:
    """The stateless path reads every request: a prompt list refilled in place between two
    chunks is read (and checked) again; it used to keep its old tokens."""
    b = make_buffers("llama", max_beam_width=1)
    r = Request(seq_slot=0, prompt=[1, 2, 3, 4], kv_block_ids=[[1]], context_chunk_size=2)
    b.prepare_step([r], [])
    r.prompt[:] = [11, 12, 13, 14]
    r.context_position = 2
    step = b.prepare_step([r], [])
    assert step.inputs["input_ids"].tolist() == [13, 14]
    r.prompt[3] = 1000  # vocab_size
    with pytest.raises(BatchError, match=r"prompt\[3\] = 1000 is outside 0\.\.999"):
        b.prepare_step([r], [])


# -------------------------------------------------------------------- the calls themselves
def test_advance_after_requests_in_flight_is_refused() -> None:
    """advance(tokens) continued the in-flight state's last step even once every request was
    finished; it continues only a stateless step."""
    b = make_buffers("llama", max_beam_width=1)
    _decoding(b)
    b.step(_tokens())
    b.finish(0)
    b.finish(1)
    with pytest.raises(BatchError, match=r"advance\(\) continues a prepare_step or advance step"):
        b.advance([9, 9])
    b.prepare_step([], [Request(seq_slot=0, prompt=[5], generated=[[9]], kv_block_ids=[[1]])])
    b.advance([9])


def test_a_call_while_a_step_fills_is_refused() -> None:
    """finish() called while a step fills (from a rule, or another thread) left a generation
    row for an empty slot, which the next step ran; now any call into the buffers while one
    runs is refused with a BatchError, and the running step is unaffected."""
    b, twin = make_buffers("llama", max_beam_width=1), make_buffers("llama", max_beam_width=1)
    for x in (b, twin):
        _decoding(x)
    fill, seen = b._fill, []

    def reentrant(targets, checked):
        for call in (
            lambda: b.finish(0),
            lambda: b.step(_tokens()),
            lambda: b.add(Request(seq_slot=3, prompt=[1])),
        ):
            try:
                call()
            except BatchError as exc:
                seen.append(str(exc))
        return fill(targets, checked)

    b._fill = reentrant
    b.add(Request(seq_slot=2, prompt=[1, 2], kv_block_ids=[[5]]))
    b.step(_tokens())
    del b._fill
    twin.add(Request(seq_slot=2, prompt=[1, 2], kv_block_ids=[[5]]))
    twin.step(_tokens())
    assert len(seen) == 3
    assert all("another call into these buffers is running" in m for m in seen)
    for x in (b, twin):
        x.step(_tokens())
    assert _same(b, twin) == []


def test_calls_from_two_threads_never_interleave() -> None:
    b = make_buffers("llama", max_beam_width=1, max_batch_size=6)
    for slot in (0, 1):  # 16 blocks of 4 tokens: room for every step below
        b.add(
            Request(
                seq_slot=slot, prompt=[5, 6, 7], kv_block_ids=[range(16 * slot, 16 * slot + 16)]
            )
        )
    b.step()
    errors: list[str] = []
    start = threading.Barrier(2)

    def steps() -> None:
        start.wait()
        for _ in range(40):
            try:
                b.step(_tokens())
            except BatchError as exc:
                errors.append(str(exc))

    def views() -> None:
        start.wait()
        for _ in range(40):
            try:
                assert b.tensors
            except BatchError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=steps), threading.Thread(target=views)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [m for m in errors if "another call into these buffers is running" not in m] == []


def test_the_view_cache_is_bounded() -> None:
    """A view was cached for every distinct shape (5,602 after 2,000 steps): the cache keeps
    the shapes of a bounded number of recent step sizes."""
    b = make_buffers("gpt", max_beam_width=1, max_batch_size=6, max_num_tokens=96)
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 90))
        b.prepare_step(
            [Request(seq_slot=0, prompt=list(range(1, n + 1)), kv_block_ids=[[1, 2]])], []
        )
    assert b.cached_views <= 2 * len(b.tensors) * b.VIEW_CACHE


# ------------------------------------------------- block lists are ordered sequences
UNORDERED = {
    "a set": {40, 3, 17},
    "a frozenset": frozenset({3, 17}),
    "a dict": {3: 0, 17: 0},
    "bytes": b"\x03\x11",
    "a bytearray": bytearray(b"\x03\x11"),
    "a str": "ab",
}


def _not_a_list(where: str, field: str, value) -> str:
    return rf"{where}: {field} must be a list of block ids \(.*\), got a {type(value).__name__}"


@pytest.mark.parametrize("case", UNORDERED)
def test_an_unordered_block_list_is_refused_by_add_and_step(case: str) -> None:
    """A set was taken as a block list in its hash order ({40, 3, 17} became [40, 17, 3]), a
    dict as its keys, bytes as their byte values: a block list is an ordered sequence (a list,
    tuple, range or 1-D array), and add() and step(blocks=) refuse anything else, naming the
    slot, the field and the type; the refused calls change nothing."""
    value = UNORDERED[case]
    b, twin = make_buffers("llama", max_beam_width=1), make_buffers("llama", max_beam_width=1)
    for x in (b, twin):
        _decoding(x)
    with pytest.raises(
        BatchError, match=_not_a_list(r"request \(seq_slot 2\)", r"kv_block_ids\[0\]", value)
    ):
        b.add(Request(seq_slot=2, prompt=[1, 2, 3], kv_block_ids=[value]))
    if not isinstance(value, dict):  # a dict is {window: ids}, refused for its windows
        with pytest.raises(
            BatchError, match=_not_a_list(r"step\(\): blocks\[0\]", "kv_block_ids", value)
        ):
            b.step(_tokens(), blocks={0: value})
    if not isinstance(value, str):  # ["ab"]: an id that is not an integer
        with pytest.raises(
            BatchError, match=_not_a_list(r"step\(\): blocks\[0\]", r"kv_block_ids\[0\]", value)
        ):
            b.step(_tokens(), blocks={0: [value]})
    for x in (b, twin):
        x.step(_tokens(), blocks={0: [20]})
    assert _same(b, twin) == []


def test_an_unordered_set_of_block_lists_is_refused() -> None:
    b = make_buffers("llama", max_beam_width=2)
    message = (
        r"request \(seq_slot 0\): kv_block_ids must be a list of block lists \(.*\), got a set"
    )
    with pytest.raises(BatchError, match=message):
        b.add(Request(seq_slot=0, prompt=[1, 2, 3], beam_width=2, kv_block_ids={(3,), (4,)}))
    with pytest.raises(BatchError, match=message.replace(r"request \(", r"context request 0 \(")):
        b.prepare_step([Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids={(3, 4)})], [])


@pytest.mark.parametrize("case", UNORDERED)
def test_an_unordered_block_list_is_refused_by_prepare_step(case: str) -> None:
    value = UNORDERED[case]
    b = make_buffers("llama", max_beam_width=1)
    ctx = Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids=[value])
    with pytest.raises(
        BatchError,
        match=_not_a_list(r"context request 0 \(seq_slot 0\)", r"kv_block_ids\[0\]", value),
    ):
        b.prepare_step([ctx], [])
    gen = Request(seq_slot=1, prompt=[1, 2, 3], generated=[[4]], kv_block_ids=[value])
    with pytest.raises(
        BatchError,
        match=_not_a_list(r"generation request 0 \(seq_slot 1\)", r"kv_block_ids\[0\]", value),
    ):
        b.prepare_step([], [gen])
    # a dict of lists was read as {0: ids}: the ids of its key 0
    with pytest.raises(
        BatchError, match=r"kv_block_ids must be a list of block lists .*got a dict"
    ):
        b.prepare_step([Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids={0: [3, 4]})], [])
    b.prepare_step([Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids=[[3]])], [])


def _enc_dec_request(slot: int, cross) -> Request:
    r = Request(seq_slot=slot, prompt=[1, 2], kv_block_ids=[[slot]], cross_kv_block_ids=cross)
    r.encoder_input_length = 3
    r.encoder_output = torch.zeros(3, 8, dtype=torch.float16)
    return r


ENC = dict(max_input_length=16, max_encoder_length=16, encoder_hidden_size=8, tokens_per_block=4)


def test_an_unordered_cross_attention_block_list_is_refused() -> None:
    b = make_buffers("enc_dec", max_beam_width=1, **ENC)
    message = _not_a_list(r"seq_slot 0\)", r"cross_kv_block_ids\[0\]", {3})
    with pytest.raises(BatchError, match=message):
        b.add(_enc_dec_request(0, [{3}]))
    with pytest.raises(BatchError, match=message):
        b.prepare_step([_enc_dec_request(0, [{3}])], [])
    b.prepare_step([_enc_dec_request(1, [range(3, 4)])], [])
    b.add(_enc_dec_request(0, [(3,)]))


def test_ordered_block_lists_of_every_kind_are_taken_in_their_order() -> None:
    """Lists, tuples, ranges and 1-D arrays (numpy, torch), as a request's lists and as the
    ids a step appends (one list, or one per list)."""
    b = make_buffers("llama", max_beam_width=1)
    given = [
        (9, 3),
        [range(5, 7)],
        [np.array([12, 2])],
        [torch.tensor([30, 1])],
        np.array([[8, 4]]),
    ]
    for slot, lists in enumerate(given):
        b.add(Request(seq_slot=slot, prompt=[1, 2, 3], kv_block_ids=lists if slot else [lists]))
    b.step()
    blocks = {
        0: range(40, 41),
        1: [torch.tensor([41])],
        2: (42,),
        3: np.array([43]),
        4: [range(44, 45)],
    }
    b.step(_tokens(), blocks=blocks)
    assert [b._flight.kv.lists_of(s)[0] for s in range(5)] == [
        [9, 3, 40],
        [5, 6, 41],
        [12, 2, 42],
        [30, 1, 43],
        [8, 4, 44],
    ]


# ------------------------------------------------------------ attention window keys
def test_window_keys_are_integers_in_add_and_step() -> None:
    """{window: lists} refused numpy integer windows at add() (type(k) is int) while
    step(blocks=) took a float window (8.0 == 8): both take Python and numpy integers and
    refuse floats, bools and strings, naming the key."""
    b = make_buffers(
        "llama",
        max_beam_width=1,
        max_draft_tokens=0,
        attention_windows=[8, 64],
        max_attention_window=64,
    )
    b.add(Request(0, [1, 2, 3], kv_block_ids={np.int64(8): [[1]], np.int32(64): [[2]]}))
    keys = (8.0, True, "8")
    for key in keys:
        bad = rf"window key {key!r} is a {type(key).__name__}, not an integer"
        with pytest.raises(BatchError, match=rf"request \(seq_slot 1\): kv_block_ids {bad}"):
            b.add(Request(1, [1, 2, 3], kv_block_ids={key: [[3]], 64: [[4]]}))
    b.step()
    for key in keys:
        bad = rf"window key {key!r} is a {type(key).__name__}, not an integer"
        with pytest.raises(BatchError, match=rf"step\(\): blocks\[0\]: {bad}"):
            b.step(_tokens(), blocks={0: {key: [5]}})
    b.step(_tokens(), blocks={0: {np.int64(8): [5]}})
    assert [t.lists_of(0) for _, t in b._flight.kv_windows] == [[[1, 5]], [[2]]]


# ------------------------------------------------- fields the family does not read
UNREAD = {
    "LoRA rows on llama_flash": ("llama_flash", "lora_weights", [LORA_ROW]),
    "an encoder output on llama": ("llama", "encoder_output", torch.zeros(3, 8)),
    "cross-attention blocks on gpt_lora": ("gpt_lora", "cross_kv_block_ids", [[1]]),
    "a prompt table on llama": ("llama", "prompt_table", torch.zeros(2, 4)),
    "an M-RoPE delta on llama": ("llama", "mrope_position_deltas", 0),
    "a language adapter on llama": ("llama", "language_adapter_uid", 0),
    "an Eagle threshold on gpt_lora": ("gpt_lora", "eagle_posterior_threshold", 0.5),
    "skipping cross attention on llama": ("llama", "skip_cross_attn_blocks", True),
    "a GLM mask position on llama": ("llama", "mask_position", 3),
}


@pytest.mark.parametrize("case", UNREAD)
def test_a_field_the_family_does_not_read_is_refused(case: str) -> None:
    """lora_weights on llama_flash, encoder_output on llama, ... were accepted and ignored:
    add() and prepare_step() refuse a field set on a family that never reads it."""
    name, field, value = UNREAD[case]
    b = make_buffers(name, max_beam_width=1)
    r = Request(seq_slot=2, prompt=[1, 2, 3], kv_block_ids=[[3]])
    setattr(r, field, value)
    message = rf"{field} is set, but the {name} family does not read it"
    with pytest.raises(BatchError, match=rf"request \(seq_slot 2\): {message}"):
        b.add(r)
    with pytest.raises(BatchError, match=rf"context request 0 \(seq_slot 2\): {message}"):
        b.prepare_step([r], [])
    r.generated = [[5]]
    with pytest.raises(BatchError, match=rf"generation request 0 \(seq_slot 2\): {message}"):
        b.prepare_step([], [r])
    setattr(r, field, False if field == "skip_cross_attn_blocks" else None)
    b.prepare_step([], [r])


def test_the_fields_a_family_reads_are_those_its_step_program_reads() -> None:
    def unread(name: str, **config) -> set[str]:
        return {f for f, _ in make_buffers(name, **config).limits.unread}

    optional = {
        "mask_position",
        "encoder_input_ids",
        "encoder_input_length",
        "encoder_output_length",
        "encoder_output",
        "cross_kv_block_ids",
        "cross_attention_mask",
        "skip_cross_attn_blocks",
        "lora_weights",
        "prompt_table",
        "mrope_rotary_cos_sin",
        "mrope_position_deltas",
        "language_adapter_uid",
        "eagle_posterior_threshold",
    }
    assert unread("llama") == optional
    assert unread("gpt_lora") == optional - {"lora_weights"}
    assert unread("glm", max_beam_width=1) == optional - {"mask_position"}
    encoder = {f for f in optional if f.startswith(("encoder_", "cross_", "skip_cross"))}
    assert unread("enc_dec", **ENC) == optional - encoder
    # each reader a field names is a function of bufc.rules (or the encoder sizes)
    readers = {r for f in dataclasses.fields(Request) for r in f.metadata.get("read_by", ())}
    modules = (core, features, encoder_decoder, adapters, kv_rows, batch)
    assert {r for r in readers if not any(callable(getattr(m, r, None)) for m in modules)} == set()
    assert {f.name for f in dataclasses.fields(Request) if f.metadata.get("read_by")} == optional


def test_what_the_caller_changes_after_add_does_not_reach_a_step() -> None:
    """A request in flight keeps its own copies of the fields its family reads, taken by add:
    reassigning the caller's field, or changing its list in place, reaches no step."""
    b = make_buffers("eagle", max_beam_width=1, max_draft_path_len=3)
    blocks = [[1, 2, 3, 4]]
    r = Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids=blocks, eagle_posterior_threshold=0.5)
    b.add(r)
    r.eagle_posterior_threshold = 0.9  # the caller's later changes
    blocks[0][0] = 7
    b.step()
    assert b.tensors["host_eagle_posterior_thresholds"][0].item() == 0.5
    assert b.tensors["host_kv_cache_block_offsets"].reshape(-1)[0].item() == 1 * 2 * (
        b.config.num_local_layers
    )
    entry = b._flight.entries[0]
    assert not hasattr(entry, "request")  # the caller's object is not kept
    with pytest.raises(AttributeError):
        entry.lora_weights  # noqa: B018 - a field eagle never reads is not there
