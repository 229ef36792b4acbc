"""The feature groups' host-side fills against their loop-by-loop references, on random batches
(chunked contexts, drafts, beams), with the core tensors checked against the core reference in
the same steps."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import reference_features as R
import torch
from conftest import assert_matches_reference, batch, cover_blocks, family, make_buffers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_step

from bufc.runtime import BatchError, Request

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODULES = ("attn_qkv", "attn_dense", "mlp_gate")
ENC = dict(max_input_length=16, max_encoder_length=16, encoder_hidden_size=8, tokens_per_block=4)
MROPE = dict(
    max_position_embeddings=6, rotary_embedding_dim=2, max_prompt_embedding_table_size=8 * 5
)
PROMPT = dict(max_prompt_embedding_table_size=8 * 5, hidden_size=4)  # 5 rows per request


def check_core(buffers, step, ctx, gen):
    c = buffers.config
    want = reference_step(
        "gpt",
        copy.deepcopy(ctx),
        copy.deepcopy(gen),
        vocab_size=c.vocab_size,
        kv=(c.max_blocks_per_seq, c.num_local_layers),
    )
    assert_matches_reference(step, want, paged=True)


@st.composite
def enc_dec_batch(draw):
    ctx, gen = draw(batch("gpt"))
    cover_blocks(ctx, gen, ENC["tokens_per_block"], start=draw(st.integers(0, 100)))
    for r in ctx + gen:
        n_in = draw(st.integers(1, 16))
        if draw(st.booleans()):
            r.encoder_input_length = n_in
        else:
            r.encoder_input_ids = [7] * n_in
        r.encoder_output_length = draw(st.none() | st.integers(1, 16))
        beams = 1 if r in ctx else r.beam_width
        need = -(-R.enc_out(r) // ENC["tokens_per_block"])  # blocks covering the encoder output
        r.cross_kv_block_ids = [
            draw(st.lists(st.integers(0, 500), min_size=need, max_size=4))
            for _ in range(draw(st.sampled_from([1, beams])))
        ]
        if draw(st.booleans()):
            rows = draw(st.integers(1, 60))
            cols = draw(st.integers(1, n_in))
            r.cross_attention_mask = np.asarray(
                draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
            ).reshape(rows, cols)
        r.skip_cross_attn_blocks = draw(st.booleans())
    for r in ctx:
        r.encoder_output = torch.randn(R.enc_out(r), 8, dtype=torch.float16)
    return ctx, gen


@SETTINGS
@given(st.lists(enc_dec_batch(), min_size=1, max_size=2))
def test_encoder_decoder_fills(batches):
    b = make_buffers("enc_dec", **ENC)
    for ctx, gen in batches:
        step = b.prepare_step(ctx, gen)
        check_core(b, step, ctx, gen)
        sizes = R.encoder_sizes(ctx, gen)
        assert {k: getattr(step.sizes, k) for k in sizes} == sizes
        i = step.inputs
        assert i["encoder_input_lengths"].tolist() == R.encoder_output_lengths(ctx, gen)
        assert i["encoder_max_input_length"].shape == (sizes["max_encoder_input_length"],)
        want = torch.cat([r.encoder_output for r in ctx]) if ctx else torch.zeros(0, 8)
        assert torch.equal(i["encoder_output"], want.to(i["encoder_output"].dtype))
        assert i["cross_kv_cache_block_offsets"].tolist() == R.cross_kv_offsets(
            ctx, gen, b.config.max_cross_blocks_per_seq, b.config.num_local_layers
        )
        assert torch.equal(
            i["host_cross_kv_cache_block_offsets"], i["cross_kv_cache_block_offsets"]
        )
        assert i["cross_attention_mask"].tolist() == R.cross_attention_mask(ctx, gen)
        assert i["skip_cross_attn_blocks"].tolist() == R.skip_cross_attn_blocks(ctx, gen)


@st.composite
def lora_batch(draw):
    ctx, gen = draw(batch("gpt"))
    for r in ctx + gen:
        if draw(st.booleans()):
            r.lora_weights = draw(
                st.lists(
                    st.tuples(
                        st.sampled_from(MODULES),
                        st.integers(0, 3),
                        st.integers(1, 2**40),
                        st.integers(1, 2**40),
                        st.none() | st.integers(1, 2**40),
                        st.integers(1, 64),
                    ),
                    min_size=1,
                    max_size=6,
                    unique_by=lambda row: row[:2],
                )
            )
    return ctx, gen


@SETTINGS
@given(lora_batch())
def test_lora_fills_one_row_per_sequence(case):
    ctx, gen = case
    b = make_buffers("gpt_lora", lora_modules=MODULES)
    step = b.prepare_step(ctx, gen)
    check_core(b, step, ctx, gen)
    c = b.config
    ptrs, ranks = R.lora(ctx, gen, list(MODULES), c.first_local_layer, c.num_local_layers)
    for m, module in enumerate(MODULES):
        for layer in range(c.num_local_layers):
            name = f"{module}_lora_weights_pointers_{c.first_local_layer + layer}"
            assert step.inputs[name].tolist() == ptrs[m][layer], name
            assert (
                step.inputs[f"{module}_lora_ranks_{c.first_local_layer + layer}"].tolist()
                == (ranks[m][layer])
            )


@st.composite
def prompt_batch(draw):
    ctx, gen = draw(batch("gpt"))
    for r in ctx + gen:
        if draw(st.booleans()):
            rows = draw(st.integers(1, 5))
            r.prompt_table = (
                torch.arange(rows * 4, dtype=torch.float16).reshape(rows, 4) + r.seq_slot
            )
    return ctx, gen


@SETTINGS
@given(prompt_batch())
def test_prompt_tuning_fills(case):
    ctx, gen = case
    b = make_buffers("gpt_prompt_tuning", **PROMPT)
    step = b.prepare_step(ctx, gen)
    check_core(b, step, ctx, gen)
    assert step.inputs["tasks"].tolist() == R.prompt_tasks(ctx, gen)
    assert step.inputs["prompt_vocab_size"].tolist() == [5]
    table = step.inputs["prompt_embedding_table"]
    for i, r in enumerate(ctx + gen):
        if r.prompt_table is not None:
            rows = r.prompt_table.shape[0]
            assert torch.equal(table[i * 5 : i * 5 + rows], r.prompt_table)


def without(case, *fields: str) -> tuple[list, list]:
    """Copies of the case's requests with `fields` at their default (a family refuses a
    field it does not read)."""
    return tuple([dataclasses.replace(r, **dict.fromkeys(fields)) for r in reqs] for reqs in case)


@st.composite
def adapter_batch(draw):
    ctx, gen = draw(batch("gpt"))
    for r in ctx:
        r.mrope_rotary_cos_sin = torch.full((12,), float(r.seq_slot))
    for r in ctx + gen:
        r.mrope_position_deltas = draw(st.integers(-50, 50))
        r.language_adapter_uid = draw(st.integers(0, 3))
    return ctx, gen


@SETTINGS
@given(adapter_batch())
def test_mrope_and_language_adapter_fills(case):
    ctx, gen = case
    b = make_buffers("qwen2_vl", **MROPE)
    step = b.prepare_step(*without(case, "language_adapter_uid"))  # a field it does not read
    check_core(b, step, ctx, gen)
    assert step.inputs["mrope_position_deltas"].tolist() == R.mrope_position_deltas(ctx, gen)
    cos_sin = step.inputs["mrope_rotary_cos_sin"]
    for i, r in enumerate(ctx):
        assert torch.equal(cos_sin[i], r.mrope_rotary_cos_sin)
    b = make_buffers("gpt_language_adapter", num_languages=4)
    step = b.prepare_step(*without(case, "mrope_rotary_cos_sin", "mrope_position_deltas"))
    check_core(b, step, ctx, gen)
    assert step.inputs["language_adapter_routings"].tolist() == R.language_adapter_routings(
        ctx, gen
    )


@SETTINGS
@given(batch("gpt", max_beam=1, slots=8))
def test_recurrent_state_slot_mapping(case):
    ctx, gen = case
    for r in ctx:  # a recurrent model takes whole prompts, context and generation apart
        r.context_position, r.context_chunk_size = 0, None
    for r in ctx + gen:  # and no drafts
        r.draft_tokens = []
    b = make_buffers("mamba", max_beam_width=1)
    for c, g in ((ctx, []), ([], gen)):
        step = b.prepare_step(c, g)
        assert step.inputs["slot_mapping"].tolist() == R.slot_mapping(c, g)
        assert "position_ids" not in step.inputs
        assert "host_past_key_value_lengths" not in step.inputs


@pytest.mark.parametrize("name", ["mamba", "recurrentgemma"])
def test_recurrent_families_reject_chunks_and_mixed_steps_and_advance(name):
    b = make_buffers(name, max_beam_width=1)
    kv = {"kv_block_ids": [[1]]} if name == "recurrentgemma" else {}
    whole = Request(seq_slot=0, prompt=[1, 2, 3], **kv)
    chunk = Request(seq_slot=1, prompt=[1, 2, 3], context_chunk_size=2, **kv)
    later = Request(seq_slot=1, prompt=[1, 2, 3], context_position=2, **kv)
    decode = Request(seq_slot=2, prompt=[4], generated=[[5]], **kv)
    for bad in ([chunk], [later]):
        with pytest.raises(BatchError, match="runs a prompt in one context step"):
            b.prepare_step(bad, [])
    with pytest.raises(BatchError, match="context and generation requests in separate steps"):
        b.prepare_step([whole], [decode])
    b.prepare_step([], [decode])
    step = b.advance([6])  # steady decoding: slot_mapping has an advance form
    assert step.inputs["slot_mapping"].tolist() == [2]


@SETTINGS
@given(batch("gpt", max_beam=1), st.lists(st.none() | st.floats(0, 1), min_size=8, max_size=8))
def test_eagle_fills(case, thresholds):
    ctx, gen = case
    for r, t in zip(ctx + gen, thresholds):
        r.eagle_posterior_threshold = t
    b = make_buffers("eagle", max_beam_width=1, max_draft_path_len=3)
    step = b.prepare_step(ctx, gen)
    check_core(b, step, ctx, gen)
    want_t, want_a = R.posterior(ctx, gen)
    assert step.inputs["posterior_threshold"].tolist() == pytest.approx(want_t)
    assert step.inputs["posterior_alpha"].tolist() == pytest.approx(want_a)
    assert step.inputs["chunked_context_next_tokens"].tolist() == R.chunked_context_next_tokens(
        ctx, gen
    )


@SETTINGS
@given(st.lists(batch("gpt"), min_size=1, max_size=3))
def test_beam_search_cache_indirection_copies(batches):
    b = make_buffers("llama")  # BASE: max_beam_width 3
    c = b.config
    for ctx, gen in batches:
        b.prepare_step(ctx, gen)
        t = b.tensors
        n, r = len(gen), len(ctx) + len(gen)
        got = t["cache_indirection_copies"].flatten()[: 3 * n].reshape(3, n).tolist()
        assert got == R.cache_indirection_copies(ctx, gen, c.max_beam_width, c.max_attention_window)
        got = t["cache_indirection_decoder_copies"].flatten()[: 3 * r].reshape(3, r).tolist()
        assert got == R.cache_indirection_decoder_copies(
            ctx, gen, c.max_beam_width, c.max_attention_window
        )


def test_cache_indirection_is_bound_at_the_steps_beam_width():
    """TensorRT-LLM's attention plugin reads the beam width from cache_indirection's second
    dimension: a step of width-2 requests under max_beam_width 3 binds [B, 2, window] (with the
    copies at that stride), a step with a width-3 request [B, 3, window], and a step without
    generation requests width 1."""
    b = make_buffers("llama")  # BASE: max_beam_width 3
    c = b.config

    def gen(slot, width):
        return Request(
            seq_slot=slot,
            prompt=[1, 2],
            beam_width=width,
            generated=[[3]] * width,
            kv_block_ids=[[slot]],
        )

    for widths, want in (((2, 2), 2), ((2, 3), 3), ((), 1)):
        ctx = [] if widths else [Request(seq_slot=7, prompt=[1, 2], kv_block_ids=[[9]])]
        step = b.prepare_step(ctx, [gen(i, w) for i, w in enumerate(widths)])
        assert tuple(step.inputs["cache_indirection"].shape) == (
            c.max_batch_size,
            want,
            c.max_attention_window,
        )
        n = len(widths)
        dst = b.tensors["cache_indirection_copies"].flatten()[n : 2 * n].tolist()
        assert dst == [i * want * c.max_attention_window for i in range(n)]


def test_encoder_engine_fills():
    b = make_buffers("encoder", max_input_length=16, max_encoder_length=16, encoder_hidden_size=8)
    reqs = [
        Request(seq_slot=3, prompt=[1], encoder_input_ids=[5, 6, 7]),
        Request(seq_slot=1, prompt=[1], encoder_input_ids=[8], encoder_output_length=2),
    ]
    step = b.prepare_step(reqs, [])
    want = R.encoder_engine(reqs)
    assert step.inputs["input_ids"].tolist() == want["input_ids"]
    assert step.inputs["position_ids"].tolist() == want["position_ids"]
    assert step.inputs["input_lengths"].tolist() == want["input_lengths"]
    assert step.inputs["max_input_length"].shape == (3,)
    assert step.outputs["encoder_output"].shape == (5, 8)
    assert set(step.inputs) == {"input_ids", "position_ids", "input_lengths", "max_input_length"}
    with pytest.raises(BatchError, match="the encoder engine runs context requests only"):
        b.prepare_step(
            [], [Request(seq_slot=0, prompt=[1], generated=[[2]], encoder_input_ids=[1])]
        )


def test_encoder_engine_sizes_come_from_the_encoder_inputs_alone():
    """The encoder engine never reads the decoder prompt: its token count is the encoder
    inputs', bounded by max_num_tokens (the reference's EncoderBuffers::setBufferSizes)."""
    b = make_buffers(
        "encoder",
        max_num_tokens=8,
        max_input_length=16,
        max_encoder_length=16,
        encoder_hidden_size=8,
    )
    long_prompt = Request(seq_slot=0, prompt=list(range(20)), encoder_input_ids=[5, 6, 7])
    step = b.prepare_step([long_prompt], [])
    assert step.sizes.num_tokens == 3 and step.inputs["input_ids"].tolist() == [5, 6, 7]
    no_prompt = Request(seq_slot=1, prompt=None, encoder_input_ids=[1, 2])
    assert b.prepare_step([no_prompt], []).inputs["input_lengths"].tolist() == [2]
    two = [Request(seq_slot=i, prompt=[1], encoder_input_ids=[3] * 12) for i in range(2)]
    with pytest.raises(BatchError, match="num_context_tokens = 24 exceeds its capacity 8"):
        b.prepare_step(two, [])
    with pytest.raises(BatchError, match="encoder_input_ids.1. must be an integer, got 'x'"):
        b.prepare_step([Request(seq_slot=0, prompt=[1], encoder_input_ids=[3, "x"])], [])


# ---------------------------------------------------------------- the checks that reject input
def kv(**kw):
    return {"kv_block_ids": [[1]], **kw}


@pytest.mark.parametrize(
    ("family", "config", "request_", "message"),
    [
        (
            "gpt_lora",
            {"lora_modules": MODULES},
            Request(seq_slot=0, prompt=[1], **kv(lora_weights=[("mlp_4h_to_h", 0, 1, 2, None, 8)])),
            "context request 0 (seq_slot 0): LoRA module 'mlp_4h_to_h' is not one of the engine's "
            "lora_modules (attn_qkv, attn_dense, mlp_gate)",
        ),
        (
            "gpt_lora",
            {"lora_modules": MODULES},
            Request(seq_slot=0, prompt=[1], **kv(lora_weights=[])),
            "lora_weights is empty; give None for no adapter",
        ),
        (
            "gpt_prompt_tuning",
            PROMPT,
            Request(
                seq_slot=0, prompt=[1], **kv(prompt_table=torch.zeros(6, 4, dtype=torch.float16))
            ),
            "its prompt table has 6 rows, more than max_prompt_vocab_size=5",
        ),
        (
            "gpt_prompt_tuning",
            PROMPT,
            Request(seq_slot=0, prompt=[1], **kv(prompt_table=torch.zeros(2, 4))),
            "prompt_table is torch.float32, the model dtype is torch.float16",
        ),
        (
            "gpt_prompt_tuning",
            PROMPT,
            Request(
                seq_slot=0,
                prompt=[1, 1002],
                **kv(prompt_table=torch.zeros(2, 4, dtype=torch.float16)),
            ),
            "context request 0 (seq_slot 0): token 1002 reads prompt-table row 2, but its "
            "table has 2 rows",
        ),
        (
            "gpt_prompt_tuning",
            PROMPT,
            Request(seq_slot=0, prompt=[1000], **kv()),
            "token 1000 reads prompt-table row 0, but the request has no prompt_table",
        ),
        (
            "qwen2_vl",
            MROPE,
            Request(seq_slot=0, prompt=[1], **kv(mrope_rotary_cos_sin=torch.zeros(5))),
            "mrope_rotary_cos_sin needs max_position_embeddings * rotary_embedding_dim = 12 "
            "values, got 5 values",
        ),
        (
            "gpt_language_adapter",
            {"num_languages": 2},
            Request(seq_slot=0, prompt=[1], **kv(language_adapter_uid=2)),
            "language_adapter_uid 2 is outside 0..1 (num_languages)",
        ),
        (
            "gpt_language_adapter",
            {"num_languages": 2},
            Request(seq_slot=0, prompt=[1], **kv()),
            "the language adapter needs the request's language_adapter_uid",
        ),
        (
            "mamba",
            {"max_beam_width": 1},
            Request(seq_slot=8, prompt=[1]),
            "context request 0 (seq_slot 8): seq_slot 8 is outside 0..7",
        ),
        (
            "enc_dec",
            ENC,
            Request(seq_slot=0, prompt=[1], **kv(cross_kv_block_ids=[[1]])),
            "context request 0 (seq_slot 0): an encoder-decoder request needs "
            "encoder_input_length or encoder_input_ids",
        ),
        (
            "enc_dec",
            ENC,
            Request(seq_slot=0, prompt=[1], **kv(encoder_input_length=3, cross_kv_block_ids=[[1]])),
            "a context request needs its encoder_output",
        ),
        (
            "enc_dec",
            ENC,
            Request(
                seq_slot=0,
                prompt=[1],
                **kv(encoder_input_length=3, cross_kv_block_ids=[[1]] * 2),
                encoder_output=torch.zeros(3, 8, dtype=torch.float16),
            ),
            "cross_kv_block_ids needs one block list (shared by all beams) or one per beam, "
            "got 2 lists",
        ),
        (
            "eagle",
            {"max_beam_width": 1, "max_draft_path_len": 3},
            Request(seq_slot=0, prompt=[1], **kv(eagle_posterior_threshold=-1.0)),
            "eagle_posterior_threshold -1.0 must be a number >= 0 (and finite in float32)",
        ),
    ],
)
def test_feature_checks_reject_bad_requests_before_writing(family, config, request_, message):
    b = make_buffers(family, **config)
    before = {k: v.clone() for k, v in b.tensors.items()}
    with pytest.raises(BatchError) as exc:
        b.prepare_step([request_], [])
    assert message in str(exc.value)
    for k, v in b.tensors.items():
        assert torch.equal(before[k], v), k


def test_spec_decoding_and_recurrent_families_need_beam_width_one():
    import dataclasses

    from bufc.runtime import ConfigError

    extra = dict(num_medusa_heads=2, num_draft_paths=2, max_draft_path_len=3)
    for name in ("medusa", "lookahead", "redrafter", "eagle", "mamba", "recurrentgemma"):
        fields = {f.name for f in dataclasses.fields(family(name).Config)}
        with pytest.raises(ConfigError, match="beam"):
            make_buffers(name, **{k: v for k, v in extra.items() if k in fields})


def test_lora_rows_edited_in_place_are_seen_on_the_next_step():
    b = make_buffers("gpt_lora", lora_modules=MODULES)
    rows = [("attn_qkv", 1, 10, 20, None, 8)]
    r = Request(seq_slot=0, prompt=[1, 2], generated=[[3]], kv_block_ids=[[1]], lora_weights=rows)
    assert b.prepare_step([], [r]).inputs["attn_qkv_lora_ranks_1"].tolist() == [8]
    rows[0] = ("attn_qkv", 1, 10, 20, None, 16)  # the same list, edited
    rows.append(("mlp_gate", 0, 30, 40, 50, 4))
    step = b.prepare_step([], [r])
    assert step.inputs["attn_qkv_lora_ranks_1"].tolist() == [16]
    assert step.inputs["mlp_gate_lora_weights_pointers_0"].tolist() == [[30, 40, 50]]


def test_model_dtype_is_limited_to_activation_dtypes():
    from bufc.runtime import ConfigError

    with pytest.raises(ConfigError, match="model_dtype must be one of float16, bfloat16, float32"):
        make_buffers(
            "redrafter",
            max_beam_width=1,
            num_draft_paths=2,
            max_draft_path_len=3,
            model_dtype="int8",
        )


@pytest.mark.parametrize(
    ("model_dtype", "given"),
    [
        (torch.float16, torch.float64),
        (torch.float16, torch.float32),
        (torch.float16, torch.bfloat16),
        (torch.float32, torch.float64),
        (torch.bfloat16, torch.float16),
    ],
)
def test_an_encoder_output_of_another_dtype_than_the_model_dtype_is_refused(model_dtype, given):
    b = make_buffers("enc_dec", **ENC, model_dtype=model_dtype)
    fine = Request(
        seq_slot=0,
        prompt=[1],
        **kv(encoder_input_length=3, cross_kv_block_ids=[[1]]),
        encoder_output=torch.ones(3, 8, dtype=model_dtype),
    )
    odd = Request(
        seq_slot=3,
        prompt=[2],
        **kv(encoder_input_length=2, cross_kv_block_ids=[[2]]),
        encoder_output=torch.ones(2, 8, dtype=given),
    )
    before = {k: v.clone() for k, v in b.tensors.items()}
    with pytest.raises(BatchError) as exc:
        b.prepare_step([fine, odd], [])
    assert str(exc.value) == (
        f"context request 1 (seq_slot 3): encoder_output is {given}, expected the model dtype "
        f"{model_dtype} (model_dtype); cast it with .to({model_dtype})"
    )
    for k, v in b.tensors.items():  # refused before a byte was written
        assert torch.equal(before[k], v), k
    odd.encoder_output = odd.encoder_output.to(model_dtype)  # as the message says
    step = b.prepare_step([fine, odd], [])
    assert step.inputs["encoder_output"].dtype == model_dtype
    assert step.inputs["encoder_output"].tolist() == [[1.0] * 8] * 5
