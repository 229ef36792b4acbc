"""The FlashAttention/vLLM family (llama_flash) against its loop-by-loop reference, and what its
contract promises: the bucket pads, the window check, the block ids checked on arrival."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from conftest import batch, cover_blocks, make_buffers
from fuzz_compare import bucket_index_problems
from hypothesis import HealthCheck, given, settings
from reference_flash import reference_flash, reference_flashinfer

from bufc.errors import BatchError
from bufc.requests import batch as batch_module
from bufc.runtime import Request

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TPB = 4
NAMES = {  # engine name -> the host mirror bound beside it, if any
    "input_ids": None,
    "positions": None,
    "query_start_loc": "query_start_loc_cpu",
    "seq_lens": "seq_lens_cpu",
    "block_table": None,
    "slot_mapping": None,
    "logits_indices": None,
    "cu_seqlens_k": "cu_seqlens_k_cpu",
    "row_slots": "row_slots_cpu",
    "produces_token": "produces_token_cpu",
}


READ_TOKENS = 1 << 16  # the read index's capacity: more than any random step's KV tokens


def buffers(tpb: int = TPB):
    # a 4096-token window of 4-token blocks: no random sequence outgrows it
    return make_buffers("llama_flash", tokens_per_block=tpb, max_kv_read_tokens=READ_TOKENS)


def assert_flash_step(step, want: dict, where: object = None) -> None:
    got = {name: view.tolist() for name, view in step.inputs.items()}
    for name, mirror in NAMES.items():
        assert got[name] == want[name], (name, where)
        if mirror is not None:
            assert got[mirror] == want[name], (mirror, where)
    assert step.scalars == want["scalars"], where
    assert list(step.outputs["logits"].shape)[0] == len(want["logits_indices"]), where
    read, n = got["kv_read_index"], len(want["kv_read_index"])
    assert read[:n] == want["kv_read_index"], where
    assert set(read[n:]) <= {-1}, where  # past cu_seqlens_k[-1]: the pad


@SETTINGS
@given(batch("gpt"), batch("gpt"))
def test_random_batches_match_the_reference(first, second) -> None:
    """Context chunks (with drafts on a last chunk), generation beams (one list shared or one
    per beam), drafts and explicit positions: every tensor and scalar equals the reference,
    over two steps of the same buffers (no stale values)."""
    _match_the_reference(first, second)


def _match_the_reference(first, second, tpb: int = TPB) -> None:
    b = buffers(tpb)
    width = b.config.max_blocks_per_seq
    for start, (ctx, gen) in ((0, first), (5000, second)):
        cover_blocks(ctx, gen, tpb, start=start)
        want = reference_flash(
            copy.deepcopy(ctx), copy.deepcopy(gen), tokens_per_block=tpb, width=width
        )
        assert_flash_step(b.prepare_step(ctx, gen), want)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch("gpt"), batch("gpt"))
def test_a_block_size_that_is_no_power_of_two_matches_the_reference(first, second) -> None:
    """Blocks of 3 tokens: the slot mapping divides positions by the block size where it cannot
    shift them (a power of two shifts), and equals the reference either way."""
    _match_the_reference(first, second, tpb=3)


@pytest.mark.parametrize("few", (0, 1000))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch("gpt"), batch("gpt"))
def test_context_positions_by_range_or_by_gather_match_the_reference(few, first, second) -> None:
    """The context tokens' positions (and the slot mapping from them) written a range per chunk
    (up to FEW_RANGES chunks) or by one gather over every token: both equal the reference."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batch_module, "FEW_RANGES", few)
        _match_the_reference(first, second)


FLASHINFER = {  # engine name -> the host mirror bound beside it, if any
    "input_ids": None,
    "positions": None,
    "slot_mapping": None,
    "logits_indices": None,
    "row_slots": "row_slots_cpu",
    "produces_token": "produces_token_cpu",
    "qo_indptr": "qo_indptr_cpu",
    "paged_kv_indptr": "paged_kv_indptr_cpu",
    "paged_kv_last_page_len": "paged_kv_last_page_len_cpu",
}


@SETTINGS
@given(batch("gpt"), batch("gpt"))
def test_random_batches_match_flashinfers_reference(first, second) -> None:
    """llama_flashinfer's arrays, page by page: qo_indptr, paged_kv_indptr, the first pages of
    each sequence in paged_kv_indices (the rest the null page) and the last-page lengths."""
    b = make_buffers("llama_flashinfer", tokens_per_block=TPB)
    width = b.config.max_blocks_per_seq
    for start, (ctx, gen) in ((0, first), (5000, second)):
        cover_blocks(ctx, gen, TPB, start=start)
        want = reference_flashinfer(
            copy.deepcopy(ctx), copy.deepcopy(gen), tokens_per_block=TPB, width=width
        )
        step = b.prepare_step(ctx, gen)
        got = {name: view.tolist() for name, view in step.inputs.items()}
        for name, mirror in FLASHINFER.items():
            assert got[name] == want[name], name
            if mirror is not None:
                assert got[mirror] == want[name], mirror
        indices, n = got["paged_kv_indices"], len(want["paged_kv_indices"])
        assert indices[:n] == want["paged_kv_indices"]
        assert not any(indices[n:])  # the null page past the step's pages
        assert step.scalars == want["scalars"]


def test_a_worked_step() -> None:
    """One context chunk and two decode sequences, every value written out (docs/contract.md
    shows the same step)."""
    b = make_buffers("llama_flash", tokens_per_block=4, max_beam_width=1)
    b.add(Request(seq_slot=0, prompt=[11, 12, 13, 14, 15, 16], kv_block_ids=[[7, 3]]))
    b.add(Request(seq_slot=1, prompt=[21, 22, 23], kv_block_ids=[[5]]))
    b.add(Request(seq_slot=2, prompt=[31, 32, 33, 34, 35], kv_block_ids=[[9, 2]]))
    b.step(chunks={1: 3, 2: 5})  # slots 1 and 2 run their prompts; slot 0 waits
    tokens = [0] * 8
    tokens[1], tokens[2] = 24, 36
    step = b.step(tokens, chunks={0: 4}, blocks={1: [6]})
    got = {name: view.tolist() for name, view in step.inputs.items()}
    assert got["input_ids"] == [11, 12, 13, 14, 24, 36]
    assert got["positions"] == [0, 1, 2, 3, 3, 5]
    assert got["query_start_loc"] == [0, 4, 5, 6]
    assert got["seq_lens"] == [4, 4, 6]
    assert [row[:2] for row in got["block_table"]] == [[7, 3], [5, 6], [9, 2]]
    assert got["slot_mapping"] == [28, 29, 30, 31, 23, 9]
    assert got["logits_indices"] == [3, 4, 5]
    assert step.scalars == {"max_query_len": 4, "max_seq_len": 6, "num_actual_tokens": 6}


def test_a_padded_bucket_holds_the_declared_pads() -> None:
    """A CUDA-graph bucket past the step: query_start_loc repeats its last value (zero-length
    queries, never negative), seq_lens 0, the null block 0, slot -1 (the write skips it), and
    a logit row that reads a real token."""
    b = make_buffers("llama_flash", tokens_per_block=4, max_beam_width=1)
    b.add(Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids=[[4]]))
    b.add(Request(seq_slot=1, prompt=[5, 6], kv_block_ids=[[8]]))
    b.step()  # the prompts: a longer step first, so the bucket's rows held other values
    step = b.step([7, 9] + [0] * 6)
    inputs, _ = b.views(step.sizes.generation_bucket(4))
    assert inputs["query_start_loc"].tolist() == [0, 1, 2, 2, 2]
    assert inputs["seq_lens"].tolist() == [4, 3, 0, 0]
    assert inputs["block_table"][:, 0].tolist() == [4, 8, 0, 0]
    assert inputs["slot_mapping"].tolist() == [19, 34, -1, -1]
    assert inputs["logits_indices"].tolist() == [0, 1, 0, 0]
    assert inputs["input_ids"].tolist() == [7, 9, 0, 0]


def test_a_mixed_step_pads_to_a_token_and_batch_bucket() -> None:
    """A step with a context chunk, padded to 8 tokens and 4 sequences (a mixed step's CUDA
    graph): the step's values stay in place and the rows past it hold the pads, so that a
    padded token belongs to no sequence (query_start_loc ends at the step's tokens)."""
    b = make_buffers("llama_flash", tokens_per_block=4, max_beam_width=1)
    b.add(Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids=[[4]]))
    b.step()
    b.add(Request(seq_slot=1, prompt=[5, 6], kv_block_ids=[[8]]))
    step = b.step([7] + [0] * 7)
    assert step.sizes.num_tokens == 3 and step.sizes.num_sequences == 2
    inputs, outputs = b.views(step.sizes.padded(8, 4))
    assert inputs["input_ids"].tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert inputs["positions"].tolist() == [0, 1, 3, 0, 0, 0, 0, 0]
    assert inputs["query_start_loc"].tolist() == [0, 2, 3, 3, 3]
    assert inputs["seq_lens"].tolist() == [2, 4, 0, 0]
    assert inputs["block_table"][:, 0].tolist() == [8, 4, 0, 0]
    assert inputs["slot_mapping"].tolist() == [32, 33, 19, -1, -1, -1, -1, -1]
    assert inputs["logits_indices"].tolist() == [1, 2, 0, 0]
    assert outputs["logits"].shape[0] == 4
    with pytest.raises(ValueError, match=r"padded\(2, 4\): a step of 3 tokens"):
        step.sizes.padded(2, 4)
    with pytest.raises(ValueError, match="a generation bucket needs a generation-only step"):
        step.sizes.generation_bucket(4)


def test_a_sequence_past_its_block_table_row_is_refused() -> None:
    """This contract has no cyclic window: a sequence whose KV would outgrow
    max_blocks_per_seq blocks is refused before a byte is written."""
    b = make_buffers("llama_flash", tokens_per_block=4, max_attention_window=8, max_beam_width=1)
    b.add(Request(seq_slot=0, prompt=list(range(1, 9)), kv_block_ids=[[1, 2]]))
    b.step()
    with pytest.raises(
        BatchError,
        match=r"generation request 0 \(seq_slot 0\): its 9 tokens after this step exceed "
        r"max_blocks_per_seq x tokens_per_block = 8",
    ):
        b.step([5] + [0] * 7)


def test_a_step_whose_kv_tokens_overflow_the_read_index_is_refused() -> None:
    """The read index holds max_kv_read_tokens entries: a step whose sequences hold more KV
    tokens after it is refused before a byte is written, and the last step stays current."""
    b = make_buffers("llama_flash", tokens_per_block=4, max_beam_width=1, max_kv_read_tokens=10)
    b.add(Request(seq_slot=0, prompt=list(range(1, 7)), kv_block_ids=[[1, 2]]))
    b.add(Request(seq_slot=1, prompt=list(range(1, 6)), kv_block_ids=[[3, 4]]))
    step = b.step(chunks={0: 6})
    assert step.inputs["kv_read_index"].tolist()[:7] == [4, 5, 6, 7, 8, 9, -1]
    with pytest.raises(
        BatchError,
        match=r"the step's sequences hold 12 KV tokens after it, more than the read index "
        r"holds \(max_kv_read_tokens=10\): schedule fewer or shorter sequences, or raise "
        r"max_kv_read_tokens",
    ):
        b.step([7] + [0] * 7, chunks={1: 5})
    after = b.step([7] + [0] * 7, chunks={}).inputs["kv_read_index"].tolist()
    assert after[:8] == [4, 5, 6, 7, 8, 9, 10, -1]  # slot 1 waits: slot 0 decodes alone


@pytest.mark.parametrize(
    "tensor, pad, problem",
    [
        ("query_start_loc", 0, "bucket view query_start_loc: not non-decreasing from 0"),
        ("kv_slot_mapping", 0, "bucket view slot_mapping: a padded token writes to a live slot"),
        ("logits_indices", -1, "bucket view logits_indices: holds -1, outside 0 .. 3"),
    ],
)
def test_the_bucket_range_check_fails_on_a_wrong_pad_policy(tensor, pad, problem) -> None:
    """The fuzzer's range check of every index tensor in a bucket (fuzz_compare), run on
    llama_flash with its declared pads (no problem) and with one pad policy swapped for a wrong
    one (the generator refuses such a spec; here the runtime declarations are edited): the
    check names the tensor."""
    from bufc.generated import llama_flash

    good = make_buffers("llama_flash", tokens_per_block=4, max_beam_width=1)
    decls = [
        dataclasses.replace(d, pad=pad) if d.name in (tensor, f"host_{tensor}") else d
        for d in llama_flash.RuntimeBuffers.tensor_decls
    ]
    wrong = type("Wrong", (llama_flash.RuntimeBuffers,), {"tensor_decls": tuple(decls)})
    bad = wrong(good.config)
    for b in (good, bad):
        b.add(Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids=[[4]]))
        b.add(Request(seq_slot=1, prompt=[5, 6], kv_block_ids=[[8]]))
        b.step()
        step = b.step([7, 9] + [0] * 6)
    bucket = step.sizes.generation_bucket(4)
    assert bucket_index_problems(good, bucket, step.sizes.num_tokens) == []
    problems = bucket_index_problems(bad, bucket, step.sizes.num_tokens)
    assert problems and problems[0].startswith(problem), problems


def test_block_ids_are_bound_by_the_pool_and_the_int32_table_not_an_encoding() -> None:
    """This contract takes the allocator's ids as they are: without num_kv_blocks any id the
    int32 block table holds is taken (TensorRT-LLM's bound for encoded ids, 2**31 / (2 x the
    layers), does not apply); with it, the pool bounds them."""
    b = make_buffers("llama_flash", tokens_per_block=TPB, num_kv_blocks=0)
    top = 2**31 - 1
    b.add(Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids=[[top]]))
    step = b.step()
    assert step.inputs["block_table"][0, 0].item() == top
    assert step.inputs["slot_mapping"][:3].tolist() == [top * TPB, top * TPB + 1, top * TPB + 2]
    with pytest.raises(BatchError, match=r"outside 0 \.\. 2147483647 \(the int32 block table\)"):
        b.add(Request(seq_slot=1, prompt=[1, 2, 3], kv_block_ids=[[2**31]]))
    pooled = make_buffers("llama_flash", tokens_per_block=TPB, num_kv_blocks=100)
    with pytest.raises(BatchError, match=r"outside 0 \.\. 99 \(num_kv_blocks=100\)"):
        pooled.add(Request(seq_slot=0, prompt=[1, 2, 3], kv_block_ids=[[100]]))


def test_kv_tokens_past_cu_seqlens_k_s_int32_are_refused() -> None:
    """cu_seqlens_k is int32 (FlashAttention's): a step whose sequences together hold more KV
    tokens is refused by the check its step runs first (summed only past the proven bound)."""
    from types import SimpleNamespace

    import numpy as np

    from bufc.rules.paged_attention import check_kv_tokens

    big = SimpleNamespace(
        sizes=SimpleNamespace(num_sequences=2), seq_kv_tokens=np.array([2**30 + 5] * 2)
    )
    with pytest.raises(
        BatchError,
        match=r"^the step's sequences hold 2147483658 KV tokens after it, more than cu_seqlens_k's "
        r"int32 holds \(2147483647\): schedule fewer or shorter sequences$",
    ):
        check_kv_tokens(big, max_blocks_per_seq=2047, tokens_per_block=2**20, max_kv_read_tokens=0)
    check_kv_tokens(big, max_blocks_per_seq=1, tokens_per_block=4, max_kv_read_tokens=0)  # bound


def test_a_read_index_with_several_kv_cache_groups_is_refused() -> None:
    from bufc.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"the read index \(max_kv_read_tokens\) follows one KV-cache group; leave it 0 with "
        r"several attention windows",
    ):
        make_buffers("llama_flash", attention_windows=[8, 64], max_kv_read_tokens=64)
