"""prepare_step and advance() are airtight: a batch is either prepared exactly as a fresh
RuntimeBuffers would prepare it, or rejected with a BatchError that leaves every tensor and all
state as they were.

An adversarial fuzz (tests/fuzz_batches.py: realistic traffic with about half of the calls
mutated into invalid ones) over gpt, llama, gpt_lora, enc_dec, medusa and mamba, and one named
regression test per behaviour. `pytest -s` prints the fuzz counts.
"""

from __future__ import annotations

import copy
import zlib

import numpy as np
import pytest
import torch
from fuzz_batches import Fuzzer
from fuzz_compare import diff_step, diff_tensors, diff_tensors_exact
from fuzz_configs import LORA_MODULES, make_buffers

from bufc.runtime import BatchError, Request

# (family, calls): about 1 ms a call on the 2-core development machine
FUZZ = [
    ("gpt", 1500),
    ("llama", 1500),
    ("llama_flash", 800),
    ("llama_flashinfer", 500),
    ("gpt_lora", 1000),
    ("enc_dec", 1000),
    ("medusa", 1000),
    ("mamba", 500),
]


@pytest.mark.parametrize(("name", "calls"), FUZZ)
def test_fuzz_mixed_valid_and_invalid_batches(name, calls):
    counts = Fuzzer(name, seed=zlib.crc32(name.encode())).run(calls)
    print("\n" + counts.line())
    assert counts.invalid_rejected > calls // 5 and counts.valid_accepted > calls // 5
    assert counts.bad == 0, "\n" + counts.report()


# ------------------------------------------------------------------------------ helpers
def rejects(buffers, call, match: str | None = None) -> BatchError:
    """`call()` raises a BatchError (nothing else) and leaves every tensor as it was."""
    before = {k: v.clone() for k, v in buffers.tensors.items()}
    with pytest.raises(BatchError, match=match) as exc:
        call()
    changed = diff_tensors_exact(buffers, before)
    assert not changed, changed
    return exc.value


def assert_as_fresh(buffers, step, context, generation) -> None:
    """`step` and every tensor equal a fresh RuntimeBuffers that prepared only this batch."""
    ref = type(buffers)(buffers.config)
    ref_step = ref.prepare_step(copy.deepcopy(context), copy.deepcopy(generation))
    problems = diff_step(step, ref_step) + diff_tensors(buffers, ref, ref_step.sizes)
    assert not problems, problems


def ctx(slot=0, n=10, **kw):
    return Request(seq_slot=slot, prompt=list(range(100, 100 + n)), **kw)


def gen(slot=1, n=5, generated=((7, 8),), **kw):
    return Request(
        seq_slot=slot,
        prompt=list(range(200, 200 + n)),
        generated=[list(g) for g in generated],
        beam_width=len(generated),
        **kw,
    )


def kv(n=1):
    return {"kv_block_ids": [list(range(1, n + 1))]}


def warm(name: str, **config):
    """Buffers that ran one good step (so there is state a bad batch could damage)."""
    b = make_buffers(name, **config)
    paged = "kv_cache_block_offsets" in b.decls
    extra = kv(4) if paged else {}
    b.prepare_step([ctx(2, **extra)], [gen(3, **extra)])
    return b


# ---------------------------------------------------------------------------- values and types
@pytest.mark.parametrize("position", [2**31, 2**32 + 1, 2**63, 2**64])
def test_a_position_id_beyond_int32_leaves_the_buffers_untouched(position):
    b = warm("gpt")
    r = ctx(0, 3, position_ids=[0, 1, position])
    rejects(b, lambda: b.prepare_step([r], []), "position_ids")


def test_a_str_token_is_rejected():
    b = warm("gpt")
    r = Request(seq_slot=0, prompt=[1, "2", 3])
    rejects(b, lambda: b.prepare_step([r], []))


def test_a_none_token_is_rejected():
    b = warm("gpt")
    rejects(b, lambda: b.prepare_step([], [gen(1, generated=((5, None),))]))


def test_a_prompt_token_at_2_64_is_rejected():
    b = warm("gpt")
    r = Request(seq_slot=0, prompt=[1, 2**64, 3])
    rejects(b, lambda: b.prepare_step([r], []))


def test_a_context_position_that_is_a_float_is_rejected():
    b = warm("gpt")
    r = ctx(0, 10, context_position=2.0)
    rejects(b, lambda: b.prepare_step([r], []), "context_position")


def test_numpy_integers_are_accepted_like_ints():
    b = warm("llama", tokens_per_block=4)
    i = np.int64
    r0 = Request(
        seq_slot=i(0),
        prompt=[i(t) for t in range(1, 11)],
        context_position=i(2),
        context_chunk_size=i(5),
        position_ids=[i(p) for p in range(10, 20)],
        kv_block_ids=[[i(3), i(4)]],
    )
    r1 = Request(
        seq_slot=np.int32(1),
        prompt=[1, 2, 3],
        beam_width=i(2),
        generated=[[i(5)], [np.int32(6)]],
        kv_block_ids=[[i(9)]],
    )
    step = b.prepare_step([r0], [r1])
    assert_as_fresh(b, step, [r0], [r1])


# ---------------------------------------------------------------------------------- slots, beams
def test_slot_100_with_max_batch_size_4_is_rejected():
    b = warm("gpt", max_batch_size=4)
    rejects(b, lambda: b.prepare_step([ctx(100)], []), "seq_slot")


def test_slot_2_32_plus_1_is_rejected():
    b = warm("gpt")
    rejects(b, lambda: b.prepare_step([], [gen(2**32 + 1)]), "seq_slot")


def test_unequal_beams_are_rejected():
    b = warm("gpt")
    rejects(b, lambda: b.prepare_step([], [gen(1, generated=((1, 2), (3,)))]))


def test_beam_width_0_without_beams_is_a_batch_error():
    b = warm("gpt")
    r = Request(seq_slot=1, prompt=[1, 2], beam_width=0, generated=[])
    rejects(b, lambda: b.prepare_step([], [r]), "beam_width")


# ------------------------------------------------------------------------------------ paged KV
@pytest.mark.parametrize(
    ("blocks", "what"),
    [
        ([["1"]], "a str block id"),
        ([[]], "an uncovered block list"),
        ([[-1]], "a negative block id"),
        ([[2**31]], "a block id at 2**31"),
        ([[2**64]], "a block id at 2**64"),
    ],
)
def test_bad_block_lists_are_rejected(blocks, what):
    b = warm("llama", num_kv_blocks=0)  # ids bounded by the int32 block index alone
    rejects(b, lambda: b.prepare_step([ctx(0, 3, kv_block_ids=blocks)], []))


def test_a_block_list_cleared_in_place_is_rejected_on_the_steady_decoding_path():
    """The same request objects as the last step: the runtime reuses what it checked then, and
    must still see a block list emptied in place."""
    b = make_buffers("llama")
    reqs = [gen(1, **kv(2)), gen(2, **kv(2))]
    b.prepare_step([], reqs)
    reqs[1].kv_block_ids[0].clear()
    rejects(b, lambda: b.prepare_step([], reqs))
    reqs[1].kv_block_ids[0].extend([1, 2])
    assert_as_fresh(b, b.prepare_step([], reqs), [], reqs)


def test_a_block_list_equal_by_value_to_its_checked_copy_keeps_its_checked_row():
    """The KV rule keeps the generation rows with a copy of their lists and converts only the
    lists that changed, compared by value: an id replaced by an equal float or True is not read
    again, and the row keeps the checked integer ids (a fresh list with a float is refused)."""
    b = make_buffers("llama")
    reqs = [gen(1, **kv(2)), gen(2, **kv(2))]
    want = b.prepare_step([], reqs).inputs["kv_cache_block_offsets"].clone()
    for bad in (2.0, np.float64(2.0)):
        reqs[1].kv_block_ids[0][1] = bad
        assert torch.equal(b.prepare_step([], reqs).inputs["kv_cache_block_offsets"], want)
        reqs[1].kv_block_ids[0][:] = [1, 2]
    fresh = make_buffers("llama")
    reqs[1].kv_block_ids = [[1, 2.0]]
    rejects(fresh, lambda: fresh.prepare_step([], reqs), "kv_block_ids")


# -------------------------------------------------------------------------------------- advance
def test_an_out_of_vocabulary_token_in_advance_is_rejected():
    b = make_buffers("gpt")
    reqs = [gen(1), gen(2, generated=((3,), (4,)))]
    b.prepare_step([], reqs)
    for bad in ([1000, 1, 2], [-1, 1, 2], [2**64, 1, 2], ["5", 1, 2], [1.5, 1, 2]):
        rejects(b, lambda bad=bad: b.advance(bad))
    step = b.advance([7, 8, 9])  # the last good step is still the one advance continues
    reqs[0].generated[0].append(7)
    reqs[1].generated[0].append(8)
    reqs[1].generated[1].append(9)
    assert_as_fresh(b, step, [], reqs)


def test_advance_after_a_failed_prepare_step_continues_from_the_last_good_step():
    b = make_buffers("llama", tokens_per_block=4)
    reqs = [gen(1, n=6, generated=((7, 8),), **kv(2)), gen(2, n=2, generated=((9,),), **kv(1))]
    b.prepare_step([], reqs)
    bad = copy.deepcopy(reqs)
    bad[0].kv_block_ids = [[1, -5]]
    rejects(b, lambda: b.prepare_step([ctx(0, 3, **kv())], bad))
    reqs[0].kv_block_ids[0].append(3)  # its 9th token, advanced next, enters block 2
    step = b.advance([11, 12])
    for r, t in zip(reqs, (11, 12)):
        r.generated[0].append(t)
    assert_as_fresh(b, step, [], reqs)


def test_advance_never_writes_a_position_beyond_int32():
    """Explicit position ids continue past the prompt: prepare_step checks the positions it
    writes, and so must advance(), whose positions grow by one a step."""
    b = make_buffers("gpt")
    r = gen(1, n=3, generated=((5,),), position_ids=[0, 1, 2**31 - 3])
    b.prepare_step([], [r])  # writes position 2**31 - 2
    b.advance([6])  # 2**31 - 1
    r.generated[0].append(6)
    rejects(b, lambda: b.advance([7]))  # 2**31
    r.generated[0].append(7)
    rejects(b, lambda: b.prepare_step([], [r]), "position")


def test_advance_on_gpt_lora_names_the_rule_without_an_advance_form():
    b = make_buffers("gpt_lora")
    b.prepare_step([], [gen(1, **kv())])
    message = str(rejects(b, lambda: b.advance([5])))
    assert "lora" in message.lower(), message
    assert "generation-only step" not in message, message


# ------------------------------------------------------------------------------ family features
@pytest.mark.parametrize("name", ["chatglm", "glm"])
def test_chatglm_and_glm_reject_a_second_context_chunk(name):
    b = make_buffers(name, vocab_size=60000)  # GLM's mask tokens are ids 50260 .. 50264
    b.prepare_step([Request(seq_slot=3, prompt=[5, 6, 50263, 7])], [])
    r = Request(seq_slot=0, prompt=[1, 2, 50263, 4, 5, 6], context_position=3)
    rejects(b, lambda: b.prepare_step([r], []))


@pytest.mark.parametrize("layer", [4, -1, 2**63])
def test_a_lora_layer_outside_the_model_is_rejected(layer):
    b = warm("gpt_lora")
    assert b.config.num_layers == 4 and "attn_qkv" in LORA_MODULES
    r = ctx(0, 3, lora_weights=[("attn_qkv", layer, 10, 20, None, 8)], **kv())
    rejects(b, lambda: b.prepare_step([r], []), "layer")


@pytest.mark.parametrize(("field", "value"), [(1, 1.0), (2, 10.0), (5, 8.0), (1, True)])
def test_a_lora_value_edited_in_place_to_an_equal_float_is_rejected(field, value):
    """LoRA rows are parsed again only when they differ from the copy parsed last step, compared
    by value; but 8.0 == 8 and True == 1 in Python."""
    b = make_buffers("gpt_lora")
    rows = [("attn_qkv", 1, 10, 20, None, 8)]
    r = gen(1, lora_weights=rows, **kv())
    b.prepare_step([], [r])
    row = list(rows[0])
    row[field] = value
    rows[0] = tuple(row)
    rejects(b, lambda: b.prepare_step([], [r]))


def enc_request(slot=1, **kw):
    fields = dict(encoder_input_length=4, cross_kv_block_ids=[[1, 2, 3, 4]], **kv(2))
    return gen(slot, **{**fields, **kw})


def test_an_encoder_output_length_above_max_encoder_length_is_rejected():
    b = make_buffers("enc_dec")  # max_encoder_length 16, 4 tokens per block
    b.prepare_step([], [enc_request(3)])
    rejects(
        b,
        lambda: b.prepare_step([], [enc_request(encoder_output_length=17)]),
        "encoder_output_length",
    )


def test_a_negative_encoder_input_length_is_rejected():
    b = make_buffers("enc_dec")
    b.prepare_step([], [enc_request(3)])
    rejects(
        b,
        lambda: b.prepare_step([], [enc_request(encoder_input_length=-1)]),
        "encoder_input_length",
    )


def test_bucket_views_of_lora_tensors_are_refused():
    """views(bucket) for a CUDA graph gives the same storage at the bucket's sizes; the
    per-sequence LoRA tensors are laid out [modules, layers, sequences, ...], so at more
    sequences the step's values would sit at other offsets: views() refuses, naming them and
    the call that builds the step at its bucket (tests/test_buckets.py)."""
    b = make_buffers("gpt_lora")
    rows = [("attn_qkv", 1, 10, 20, None, 8), ("mlp_gate", 0, 30, 40, 50, 4)]
    step = b.prepare_step([], [gen(1, lora_weights=rows, **kv()), gen(2, **kv())])
    with pytest.raises(
        ValueError,
        match=r"attn_qkv_lora_ranks_1, .*build the step at its bucket instead: "
        r"step\(\.\.\., bucket=\(tokens, rows\)\)",
    ):
        b.views(step.sizes.generation_bucket(4))
    inputs, _ = b.views(step.sizes)  # the step's own sizes are fine
    assert torch.equal(inputs["attn_qkv_lora_ranks_1"], step.inputs["attn_qkv_lora_ranks_1"])
