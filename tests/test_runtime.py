"""The generated modules' API: construction, step views, bad input, pipeline roles."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import BASE, family, make_buffers, make_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bufc import runtime as rt
from bufc.runtime import BatchError, ConfigError, Request


def snapshot(buffers) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in buffers.tensors.items()}


def assert_unchanged(before, buffers) -> None:
    for name, t in buffers.tensors.items():
        assert torch.equal(before[name], t), name


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


# ------------------------------------------------------------------------------ construction
def test_config_is_frozen_and_has_exactly_the_family_parameters(family_name):
    config = make_config(family_name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_size = 3
    fields = {f.name for f in dataclasses.fields(config) if f.init}
    assert fields == {
        *(k for k in BASE if k != "hidden_size"),  # only pipeline ranks exchange hidden states
        "tp_size",
        "pp_size",
        "pp_rank",
        "sink_token_length",
        "logits_dtype",
        "gather_context_logits",
        "gather_generation_logits",
        "attention_windows",
        "attention_layer_period",  # held at 1: only recurrent families interleave layers
        *(
            ["tokens_per_block", "num_kv_blocks", "kv_heads_per_layer"]
            if family_name == "llama"
            else []
        ),
    }
    assert config.vocab_size_padded == config.vocab_size and config.max_num_logits == 8 * 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be at least 1, got 0"),
        ({"max_batch_size": 2.0}, "max_batch_size must be an int, got 2.0"),
        ({"max_batch_size": True}, "max_batch_size must be an int, got True"),
        (
            {"pp_size": 2, "pp_rank": 2},
            "pp_rank must be below pp_size (buffers.yaml: pp_rank < pp_size)",
        ),
        ({"num_layers": 3, "pp_size": 2}, "num_layers must split evenly over the pipeline ranks"),
        ({"logits_dtype": "float17"}, "logits_dtype must be a torch.dtype or one of"),
        ({"pp_size": 2}, "this family has no pipeline-parallel buffers; use its pipeline-parallel"),
        ({"gather_context_logits": 1}, "gather_context_logits must be True or False, got 1"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=None) as exc:
        make_config(
            "gpt_pp" if "pp_rank" in overrides or "num_layers" in overrides else "gpt", **overrides
        )
    assert message in str(exc.value)


def test_unknown_config_field_is_a_type_error():
    with pytest.raises(TypeError):
        make_config("gpt", use_lora=True)


def test_everything_is_allocated_at_capacity():
    b = make_buffers("gpt")
    assert b.tensors["input_ids"].shape == (512,)
    assert b.tensors["logits"].shape == (32, 1000)
    assert b.tensors["logits"].dtype == torch.float32
    assert b.tensors["host_context_lengths"].shape == (24,)
    assert "host_chatglm_position_ids" not in b.tensors  # no trace of other families' tensors
    assert b.tensors["host_max_attention_window_sizes"].tolist() == [4096] * 4
    assert b.tensors["host_sink_token_length"].tolist() == [0]


def test_generated_module_has_no_trace_of_other_families():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(family("gpt")))
    flags = set(family("gpt").FLAGS)
    for n in ast.walk(tree):  # no run-time flag checks: a condition reads the Config alone
        if isinstance(n, (ast.If, ast.IfExp)):
            read = [x for x in ast.walk(n.test) if isinstance(x, (ast.Name, ast.Attribute))]
            assert {x.id for x in read if isinstance(x, ast.Name)} == {"c"}, ast.unparse(n.test)
            assert not {x.attr for x in read if isinstance(x, ast.Attribute)} & flags
    names = {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    assert not any("chatglm" in n or n == "model_variant ==" for n in names)


# ---------------------------------------------------------------------------------- steps
def test_step_views_are_fixed_addresses_every_step_and_bucket():
    """Device tensors (what a CUDA graph captures) never move; staged host tensors alternate
    between the two halves of the double-buffered staging arena."""
    b = make_buffers("llama")
    batches = [
        ([ctx(0, kv_block_ids=[[1]])], []),
        ([], [gen(1, kv_block_ids=[[2]])]),
        (
            [ctx(0, 30, kv_block_ids=[[3]])],
            [gen(1, kv_block_ids=[[2]]), gen(2, kv_block_ids=[[4]])],
        ),
        ([], [gen(i, kv_block_ids=[[i]]) for i in range(8)]),
    ] * 2
    seen: dict[str, set[int]] = {}
    for ctx_reqs, gen_reqs in batches:
        step = b.prepare_step(ctx_reqs, gen_reqs)
        for views in (step.inputs, step.outputs):
            for name, view in views.items():
                if view.numel():  # an empty view has no address
                    seen.setdefault(name, set()).add(view.data_ptr())
    # host tensors a rule fills alternate between two storages, like the staging arena
    staged = {
        bind.engine_name
        for d in b.decls.values()
        if d.memory != rt.DEVICE
        and not isinstance(d.fill, (rt.Mirror, rt.Constant))
        and d.fill not in (rt.ENGINE, rt.EXTERNAL, rt.STATIC)
        for bind in d.inputs
    }
    assert {"host_context_lengths", "host_kv_cache_block_offsets"} <= staged
    for name, ptrs in seen.items():
        assert len(ptrs) == (2 if name in staged else 1), name
    for name in (
        "input_ids",
        "position_ids",
        "context_lengths",
        "kv_cache_block_offsets",
        "logits",
    ):
        assert len(seen[name]) == 1


def test_engine_io_names():
    b = make_buffers("chatglm")
    step = b.prepare_step([ctx(0, 4)], [gen(1)])
    assert sorted(step.inputs) == sorted(
        [
            "input_ids",
            "position_ids",
            "host_context_lengths",
            "context_lengths",
            "sequence_length",
            "host_request_types",
            "host_past_key_value_lengths",
            "last_token_ids",
            "host_max_attention_window_sizes",
            "host_sink_token_length",
            "host_context_progress",
            "cache_indirection",
            "host_beam_widths",  # max_beam_width 3: the width of each generation request
            "row_slots",  # the row map, in every contract
            "row_slots_cpu",
        ]
    )
    assert step.inputs["host_beam_widths"].tolist() == [1]
    assert list(step.outputs) == ["logits"]
    assert step.inputs["position_ids"].tolist() == [[0, 1, 2, 2, 3], [0, 0, 0, 1, 3]]


def test_empty_step():
    step = make_buffers("gpt").prepare_step([], [])
    assert step.inputs["input_ids"].shape == (0,)
    assert step.outputs["logits"].shape == (0, 1000)
    assert step.max_kv_cache_length_rounded == 0


def test_rows_past_a_smaller_step_hold_their_pad_value():
    b = make_buffers("gpt")
    b.prepare_step([ctx(0, 20)], [gen(1), gen(2), gen(3)])
    b.prepare_step([], [gen(1)])
    # staged (double-buffered) and plain host tensors alike
    assert b.tensors["host_past_key_value_lengths"][1:6].tolist() == [0] * 5
    assert b.tensors["host_request_types"][1:6].tolist() == [0] * 5
    assert b.tensors["host_input_ids"][1:25].tolist() == [0] * 24
    assert b.tensors["input_ids"][1:25].tolist() == [0] * 24  # the device copy too


def test_max_kv_cache_length_rounding_and_cuda_graph_preparation():
    b = make_buffers("gpt")
    long_gen = Request(seq_slot=3, prompt=list(range(300)), generated=[[1] * 10])
    step = b.prepare_step([], [gen(1), long_gen])
    assert step.max_kv_cache_length_rounded == 512  # ceil(309 / 256) * 256
    b.prepare_for_cuda_graph(max_sequence_length=400)
    assert b.tensors["host_past_key_value_lengths"][:2].tolist() == [399, 399]
    b.prepare_for_cuda_graph(max_sequence_length=4096)
    assert b.tensors["host_past_key_value_lengths"][:2].tolist() == [512, 512]


def test_a_scalar_a_family_lacks_is_named_with_those_it_has():
    step = make_buffers("mamba", max_beam_width=1).prepare_step([], [])
    assert step.scalars == {}
    with pytest.raises(AttributeError, match=r"no attribute or scalar 'max_kv_cache_length_"):
        step.max_kv_cache_length_rounded  # noqa: B018
    gpt = make_buffers("gpt").prepare_step([], [])
    with pytest.raises(AttributeError, match=r"\(scalars: max_kv_cache_length_rounded\)"):
        gpt.max_kv_length  # noqa: B018


def test_the_rounded_kv_length_follows_advance_past_a_rounding_boundary():
    b = make_buffers("gpt")
    step = b.prepare_step([], [Request(seq_slot=3, prompt=list(range(250)), generated=[[1] * 6])])
    assert step.max_kv_cache_length_rounded == 256  # 255 tokens before the step
    step = b.advance([2])
    assert step.max_kv_cache_length_rounded == 256  # 256
    step = b.advance([2])
    assert step.max_kv_cache_length_rounded == 512  # 257


def test_cuda_graph_preparation_needs_a_generation_only_step():
    b = make_buffers("gpt")
    with pytest.raises(BatchError, match="needs a prepared step"):
        b.prepare_for_cuda_graph(100)
    b.prepare_step([ctx(0)], [gen(1)])
    with pytest.raises(
        BatchError, match="needs a generation-only step; the last step had 1 context"
    ):
        b.prepare_for_cuda_graph(100)


def test_glm_stores_the_mask_position_on_the_request_and_uses_it_in_generation():
    b = make_buffers("glm")
    r = Request(seq_slot=0, prompt=[5, 6, 50263, 7])
    b.prepare_step([r], [])
    assert r.mask_position == 2
    r.generated = [[9]]
    step = b.prepare_step([], [r])
    assert step.inputs["position_ids"].tolist() == [[2], [2]]


# ------------------------------------------------------------------------------ bad input
BAD = [
    ([ctx(0, 600)], [], "num_context_tokens = 600 exceeds its capacity 512"),
    ([ctx(i, 2) for i in range(9)], [], "num_context_requests = 9 exceeds its capacity 8"),
    (
        [ctx(0, context_position=4, context_chunk_size=7)],
        [],
        "context request 0 (seq_slot 0): context_chunk_size 7 at context_position 4 runs past the prompt of 10 tokens",
    ),
    (
        [ctx(0, context_position=10)],
        [],
        "context request 0 (seq_slot 0): context_position 10 is outside 0..9 (a prompt of 10 tokens)",
    ),
    (
        [],
        [gen(1, generated=((1,), (2,)), draft_tokens=[5])],
        "generation request 0 (seq_slot 1): draft tokens need beam_width 1, got 2",
    ),
    (
        [ctx(0, beam_width=2, draft_tokens=[5])],
        [],
        "context request 0 (seq_slot 0): draft tokens need beam_width 1, got 2",
    ),
    (
        [],
        [Request(seq_slot=1, prompt=[1, 2], generated=[[]])],
        "a generation request needs at least one generated token per beam",
    ),
    ([], [Request(seq_slot=1, prompt=[1, 2])], "'generated' has 0 beams, beam_width is 1"),
    ([ctx(0, generated=[[3]])], [], "a context request must not have generated tokens"),
    ([ctx(-1)], [], "context request 0 (seq_slot -1): seq_slot -1 is outside 0..7"),
    ([ctx(8)], [], "context request 0 (seq_slot 8): seq_slot 8 is outside 0..7"),
    (
        [ctx(3)],
        [gen(3)],
        "generation request 0 (seq_slot 3): seq_slot 3 is also used by context request 0 (seq_slot 3)",
    ),
    ([ctx(None)], [], "seq_slot must be an integer, got None"),
    ([ctx(0, draft_tokens=[1, 2, 3, 4])], [], "4 draft tokens exceed max_draft_tokens=3"),
    ([], [gen(1, generated=((1,),) * 4)], "beam_width 4 is outside 1..3 (max_beam_width)"),
    ([ctx(0, position_ids=[1, 2])], [], "2 position_ids for a prompt of 10 tokens"),
    ([Request(seq_slot=0, prompt=[])], [], "the prompt is empty"),
]


@pytest.mark.parametrize(("context", "generation", "message"), BAD)
def test_bad_batches_raise_and_leave_the_buffers_as_they_were(context, generation, message):
    b = make_buffers("gpt")
    b.prepare_step([ctx(5, 7)], [gen(6)])
    before = snapshot(b)
    with pytest.raises(BatchError) as exc:
        b.prepare_step(context, generation)
    assert message in str(exc.value)
    assert_unchanged(before, b)


@pytest.mark.parametrize("name", ["chatglm", "glm"])
def test_explicit_position_ids_are_rejected_by_two_row_families(name):
    b = make_buffers(name)
    before = snapshot(b)
    with pytest.raises(
        BatchError, match="explicit position_ids are not supported by the ChatGLM/GLM"
    ):
        b.prepare_step([ctx(0, position_ids=list(range(10)))], [])
    assert_unchanged(before, b)


def test_glm_generation_without_a_mask_position_is_rejected():
    with pytest.raises(BatchError, match="mask_position is unset"):
        make_buffers("glm").prepare_step([], [gen(1)])


def test_logits_capacity_is_enforced():
    b = make_buffers(
        "gpt", max_beam_width=1, max_draft_tokens=1, max_batch_size=2, max_num_tokens=64
    )
    with pytest.raises(BatchError, match="num_generation_requests = 3 exceeds its capacity 2"):
        b.prepare_step([], [gen(1), gen(2), gen(3)])


# ----------------------------------------------------------------------- pipeline roles
def io(name, **cfg):
    b = make_buffers(name, **cfg)
    kv = {"kv_block_ids": [[1]]} if "kv_cache_block_offsets" in b.decls else {}
    step = b.prepare_step([ctx(0, **kv)], [gen(1, **kv)])
    return step, b


def test_single_rank_binds_input_ids_and_logits():
    step, b = io("gpt")
    assert "input_ids" in step.inputs and "logits" in step.outputs
    assert "hidden_states" not in b.tensors


def test_first_middle_and_last_pipeline_ranks():
    first, _ = io("gpt_pp", pp_size=4, pp_rank=0)
    middle, mb = io("gpt_pp", pp_size=4, pp_rank=1)
    last, _ = io("gpt_pp", pp_size=4, pp_rank=3)
    assert "input_ids" in first.inputs and "hidden_states_input" not in first.inputs
    assert list(first.outputs) == ["hidden_states_output"]
    assert "input_ids" not in middle.inputs and "host_input_ids" not in mb.tensors
    assert "hidden_states_input" in middle.inputs and list(middle.outputs) == [
        "hidden_states_output"
    ]
    # on middle ranks one tensor is both the input and the output, as in the reference
    assert (
        middle.inputs["hidden_states_input"].data_ptr()
        == middle.outputs["hidden_states_output"].data_ptr()
    )
    assert middle.inputs["hidden_states_input"].shape == (11, 32)
    assert middle.inputs["hidden_states_input"].dtype == torch.float16
    assert "hidden_states_input" in last.inputs and list(last.outputs) == ["logits"]
    assert mb.tensors["host_max_attention_window_sizes"].shape == (1,)  # 4 layers over 4 ranks


def test_vocabulary_is_padded_to_the_world_size():
    step, _ = io("gpt_pp", vocab_size=1001, tp_size=2, pp_size=2, pp_rank=1)
    assert step.outputs["logits"].shape == (2, 1004)


# -------------------------------------------------------------------------- paged KV cache
def test_kv_block_offsets_encode_block_layer_and_k_or_v():
    b = make_buffers("llama", num_layers=4, tokens_per_block=16, max_attention_window=64)
    assert b.config.max_blocks_per_seq == 4
    r0 = ctx(0, 20, kv_block_ids=[[7, 3]])
    r1 = gen(1, generated=((1,), (2,)), kv_block_ids=[[5], [6, 9]])
    step = b.prepare_step([r0], [r1])
    offsets = step.inputs["kv_cache_block_offsets"]
    assert offsets.shape == (1, 3, 2, 4)
    assert offsets[0].tolist() == [
        [[56, 24, 0, 0], [57, 25, 0, 0]],  # block * 4 layers * 2 (+1 for V)
        [[40, 0, 0, 0], [41, 0, 0, 0]],
        [[48, 72, 0, 0], [49, 73, 0, 0]],
    ]
    assert torch.equal(step.inputs["host_kv_cache_block_offsets"], offsets)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (ctx(0), "context request 0 (seq_slot 0): kv_block_ids needs one block list"),
        (ctx(0, kv_block_ids=[list(range(65))]), "65 KV blocks exceed max_blocks_per_seq=64"),
    ],
)
def test_kv_block_id_errors(request_, message):
    b = make_buffers("llama")
    before = snapshot(b)
    with pytest.raises(BatchError) as exc:
        b.prepare_step([request_], [])
    assert message in str(exc.value)
    assert_unchanged(before, b)


def test_steady_decoding_reuses_request_columns_and_stays_exact():
    from conftest import VARIANT  # noqa: F401  (same helpers as the differential test)
    from reference import reference_step

    b = make_buffers("gpt")
    reqs = [gen(1, generated=((7, 8),)), gen(2, n=9, generated=((1,), (2,))), gen(3, n=3)]
    for k in range(4):
        step = b.prepare_step([], reqs)  # the same list of the same objects every step
        want = reference_step("gpt", [], reqs, vocab_size=1000)
        assert step.inputs["input_ids"].tolist() == want["input_ids"]
        assert step.inputs["position_ids"].tolist() == want["position_ids"]
        assert step.inputs["sequence_length"].tolist() == want["sequence_length"]
        for r in reqs:
            for beam in r.generated:
                beam.append(100 + k)
        reqs[0].draft_tokens = [5, 6] if k % 2 == 0 else []


def test_kv_rows_kept_between_steps_follow_lists_changed_in_place():
    from reference import reference_step

    b = make_buffers("llama", num_layers=2, tokens_per_block=4, max_attention_window=64)
    kv = (b.config.max_blocks_per_seq, b.config.num_local_layers)
    blocks = [[1, 2], [3, 8], [4, 5, 6]]  # prompt 5 + 2 generated: two blocks of 4 tokens
    reqs = [gen(i, kv_block_ids=[blocks[i]]) for i in range(3)]
    edits = [
        lambda: None,  # the same lists: rows kept
        lambda: blocks[1].append(9),  # a new block
        lambda: blocks[0].__setitem__(1, 80),  # an id changed in place, same length
        lambda: reqs[2].__setattr__("kv_block_ids", [[7, 10]]),  # a new list object
        lambda: reqs.pop(0),  # the rows shift
    ]
    for edit in edits:
        edit()
        for context in ([], [ctx(5, kv_block_ids=[[11, 12, 13]])]):  # with and without context rows
            step = b.prepare_step(context, reqs)
            want = reference_step("gpt", context, reqs, vocab_size=1000, kv=kv)
            got = step.inputs["kv_cache_block_offsets"].tolist()
            assert got == want["kv_cache_block_offsets"]


def test_bucket_views_past_the_batch_hold_pad_values_on_the_device_side():
    b = make_buffers("llama")
    big = [
        gen(i, n=20 + i, generated=((5 + i, 6 + i),), kv_block_ids=[[i + 1, i + 9]])
        for i in range(8)
    ]
    b.prepare_step([], big)
    b.prepare_step([], big[:5])  # the other staging half
    step = b.prepare_step([], big[:3])
    bucket = step.sizes.generation_bucket(8)
    inputs, _ = b.views(bucket)
    for name in ("input_ids", "position_ids", "context_lengths", "sequence_length"):
        assert inputs[name][3:].tolist() == [0] * 5, name
        assert inputs[name][:3].tolist() == step.inputs[name].tolist(), name
    # 1-based and cumulative: the rows past the batch repeat its last token (a constant 0 would
    # point them at row -1), after steps of 8 and 5 rows wrote more
    assert inputs["last_token_ids"].tolist() == [1, 2, 3, 3, 3, 3, 3, 3]
    assert inputs["kv_cache_block_offsets"][0, 3:].abs().sum() == 0
    assert inputs["input_ids"].data_ptr() == step.inputs["input_ids"].data_ptr()


def test_a_capacity_the_machine_cannot_hold_is_a_config_error_with_the_bytes():
    config = make_config("gpt", max_num_tokens=2**40)  # a valid Config, an absurd capacity
    with pytest.raises(ConfigError, match=r"these buffers need [\d,]+ bytes of host memory, more"):
        family("gpt").RuntimeBuffers(config)


# ------------------------------------------------- adversarial review: each case once failed
def test_a_rejected_batch_stays_rejected_when_retried():
    b = make_buffers("llama")
    bad = Request(
        seq_slot=1, prompt=[1, 2, 3], generated=[[5]], kv_block_ids=[[1]], position_ids=[0, 1, -9]
    )
    for _ in range(2):  # the columns of a rejected batch are not kept for reuse
        with pytest.raises(BatchError, match=r"position_ids\[2\] = -9 is outside"):
            b.prepare_step([], [bad])


def test_odd_values_are_batch_errors_before_anything_is_written():
    import numpy as np

    pt = make_buffers("gpt_prompt_tuning", max_prompt_embedding_table_size=40, hidden_size=4)
    lang = make_buffers("gpt_language_adapter", num_languages=4)
    eagle = make_buffers("eagle", max_beam_width=1, max_draft_path_len=3)
    enc = make_buffers("encoder", max_input_length=16, max_encoder_length=16, encoder_hidden_size=8)
    table = torch.ones(2, 4, dtype=torch.float16)
    cases = [
        (
            pt,
            [Request(seq_slot=0, prompt=[1], kv_block_ids=[[1]], prompt_table=table.to_sparse())],
            [],
        ),
        (
            lang,
            [
                Request(
                    seq_slot=0,
                    prompt=[1],
                    kv_block_ids=[[1]],
                    language_adapter_uid=np.array([1, 2]),
                )
            ],
            [],
        ),
        (
            eagle,
            [
                Request(
                    seq_slot=0, prompt=[1], kv_block_ids=[[1]], eagle_posterior_threshold=10**400
                )
            ],
            [],
        ),
        (
            eagle,
            [Request(seq_slot=0, prompt=[1], kv_block_ids=[[1]], eagle_posterior_threshold=1e300)],
            [],
        ),
        (enc, [Request(seq_slot=0, prompt=[1], encoder_input_ids={1, 2})], []),
        (make_buffers("chatglm"), [Request(seq_slot=0, prompt=[7])], []),
    ]
    for b, context, generation in cases:
        before = snapshot(b)
        with pytest.raises(BatchError):
            b.prepare_step(context, generation)
        assert_unchanged(before, b)
    # numpy drafts are integers like any other (the prompt-table check once raised on them)
    drafts = Request(
        seq_slot=1, prompt=[1], generated=[[3]], draft_tokens=np.array([5, 6]), kv_block_ids=[[1]]
    )
    assert pt.prepare_step([], [drafts]).inputs["input_ids"].tolist() == [3, 5, 6]


def test_advance_turns_odd_inputs_into_batch_errors():
    b = make_buffers("llama", tokens_per_block=4)
    g = Request(seq_slot=0, prompt=[1, 2, 3], generated=[[5]], kv_block_ids=[[1]])
    b.prepare_step([], [g])
    with pytest.raises(BatchError, match="integer tokens"):
        b.advance(torch.tensor([7], dtype=torch.bfloat16))
    g.kv_block_ids = None  # the next token enters a new block, read from the request
    with pytest.raises(BatchError, match="could not be checked"):
        b.advance([7])


def test_static_values_the_dtype_cannot_hold_are_config_errors():
    import numpy as np

    b = make_buffers("recurrentgemma", max_beam_width=1)
    for bad in ([[1.5]] * 4, np.array([[2**63]] * 4, np.uint64), "abc", None):
        with pytest.raises(ConfigError):
            b.set_static("host_conv_state_pointers", bad)
    with pytest.raises(ConfigError, match="needs integers in -2147483648..2147483647"):
        b.set_static("host_kv_cache_pool_mapping", np.array([2**32 + 1, 2**32]))
    with pytest.raises(ConfigError, match="is not a static tensor"):
        make_buffers("gpt", static_inputs={"bogus": 1})


def test_cuda_graph_preparation_and_views_check_their_arguments():
    b = make_buffers("llama")
    step = b.prepare_step(
        [], [Request(seq_slot=0, prompt=[1, 2], generated=[[5]], kv_block_ids=[[1]])]
    )
    for bad in (0, -5, 10.5, "100"):
        with pytest.raises(BatchError, match="max_sequence_length"):
            b.prepare_for_cuda_graph(bad)
    with pytest.raises(ValueError, match="num_tokens must be a non-negative int, got -1"):
        b.views(dataclasses.replace(step.sizes, num_tokens=-1))
    with pytest.raises(ValueError, match="takes StepSizes"):
        b.views({"num_tokens": 1})


def test_views_refuses_every_step_size_that_is_not_a_non_negative_int():
    b = make_buffers("llama")
    step = b.prepare_step(
        [], [Request(seq_slot=0, prompt=[1, 2], generated=[[5]], kv_block_ids=[[1]])]
    )
    bucket = step.sizes.generation_bucket(4)
    for field in dataclasses.fields(bucket):
        for bad in (2.0, "2", None, True, False, -1, np.int64(-3), np.float32(1)):
            with pytest.raises(ValueError) as info:
                b.views(dataclasses.replace(bucket, **{field.name: bad}))
            assert str(info.value) == (
                f"views(): step size {field.name} must be a non-negative int, got {bad!r}"
            )
    # numpy integers are sizes as good as ints
    numpy_sizes = {f.name: np.int64(getattr(bucket, f.name)) for f in dataclasses.fields(bucket)}
    got, want = b.views(dataclasses.replace(bucket, **numpy_sizes)), b.views(bucket)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for name in g:
            assert g[name].shape == w[name].shape and torch.equal(g[name], w[name]), name


# ------------------------------------------------------------- KV rows under churn
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_kept_kv_rows_follow_their_sequences_when_requests_finish_and_arrive(data):
    """Requests finish, arrive and grow blocks every step, with beams and shared lists: the
    buffers that kept rows from earlier steps write what fresh buffers write for the step."""
    kept = make_buffers("llama", tokens_per_block=4)
    draw = data.draw
    live: list[Request] = []
    free = list(range(8))
    next_block = 0
    for _ in range(draw(st.integers(2, 7), label="steps")):
        for r in list(live):  # finishes
            if draw(st.booleans(), label="finish"):
                live.remove(r)
                free.append(r.seq_slot)
        for _ in range(draw(st.integers(0, min(3, len(free))), label="arrivals")):
            beams = draw(st.integers(1, 3), label="beams")
            prompt = draw(st.integers(1, 9), label="prompt")
            shared = draw(st.booleans(), label="shared")
            r = Request(seq_slot=free.pop(0), prompt=[1] * prompt, beam_width=beams, generated=[])
            n = -(-(prompt + 1) // 4) + 1
            ids = list(range(next_block, next_block + n))
            next_block += n
            r.kv_block_ids = [ids] if shared else [ids[:] for _ in range(beams)]
            live.append(r)
        for r in live:  # every in-flight request one token longer, blocks as needed
            r.generated = [list(g) + [5] for g in r.generated] or [[5] for _ in range(r.beam_width)]
            need = -(-(len(r.prompt) + len(r.generated[0]) + 1) // 4)
            for ids in r.kv_block_ids:
                while len(ids) < need:
                    ids.append(next_block)
                    next_block += 1
        order = draw(st.permutations(live), label="order") if live else []
        got = kept.prepare_step([], order)
        want = make_buffers("llama", tokens_per_block=4).prepare_step([], order)
        for name, t in want.inputs.items():
            assert torch.equal(got.inputs[name], t), name


def test_a_failed_fill_leaves_no_stale_repeat_last_tail(monkeypatch):
    """A fill that fails after writing a cumulative tensor's rows (more of them than the next
    step has) leaves no stale values in its repeated tail: the bucket rows past the next step
    repeat its last value, as on buffers that never saw the failure."""
    from bufc.rules import core

    def steps(b, fail: bool) -> list:
        few = [gen(i, n=10 + i, kv_block_ids=[[i + 1]]) for i in range(3)]
        b.prepare_step([], few)  # half 0
        b.prepare_step([], few)  # half 1
        if fail:  # half 0 again: 5 rows written, then the rule raises
            real = core.last_token_ids

            def writes_then_fails(out, batch):
                real(out, batch)
                raise ZeroDivisionError("after the writes")

            monkeypatch.setattr(core, "last_token_ids", writes_then_fails)
            more = few + [gen(i, n=10 + i, kv_block_ids=[[i + 1]]) for i in (3, 4)]
            with pytest.raises(BatchError, match="a fill failed after the checks passed"):
                b.prepare_step([], more)
            monkeypatch.setattr(core, "last_token_ids", real)
        step = b.prepare_step([], few)  # half 0, 3 rows
        return b.views(step.sizes.generation_bucket(8))[0]["last_token_ids"].tolist()

    assert steps(make_buffers("llama"), True) == steps(make_buffers("llama"), False)
    assert steps(make_buffers("llama"), False) == [1, 2, 3, 3, 3, 3, 3, 3]
