"""Shared helpers: small configs for each family and hypothesis strategies for batches."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference.py

from bufc.runtime import Request  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("gpt", "chatglm", "glm", "llama")
VARIANT = {"gpt": "gpt", "chatglm": "chatglm", "glm": "glm", "llama": "gpt"}
GLM_MASK_IDS = (50260, 50263, 50264)
GLM_VOCAB = 50304

BASE = dict(
    max_batch_size=8,
    max_beam_width=3,
    max_num_tokens=512,
    max_draft_tokens=3,
    vocab_size=1000,
    hidden_size=32,
    num_layers=4,
    max_attention_window=4096,
)
TOKENS_PER_BLOCK = 64  # the default; BASE's window gives max_blocks_per_seq = 64
blocks = st.lists(st.lists(st.integers(0, 10_000), min_size=1, max_size=64), min_size=1, max_size=1)


def family(name: str):
    return importlib.import_module(f"bufc.generated.{name}")


# GLM's mask tokens (50260, 50263, 50264) must lie in its vocabulary; recurrent state cannot
# roll back rejected drafts
FAMILY_BASE = {
    "glm": {"vocab_size": GLM_VOCAB},
    "mamba": {"max_draft_tokens": 0},
    "recurrentgemma": {"max_draft_tokens": 0},
}


def make_config(name: str, **overrides):
    """The family's Config from BASE (the parameters it has) and `overrides` (all passed)."""
    mod = family(name)
    fields = {f.name for f in dataclasses.fields(mod.Config) if f.init}
    base = {**BASE, **FAMILY_BASE.get(name, {})}
    return mod.Config(**{**{k: v for k, v in base.items() if k in fields}, **overrides})


def make_buffers(
    name: str, device: str = "cpu", static_inputs=None, double_buffered: bool = True, **overrides
):
    mod = family(name)
    return mod.RuntimeBuffers(
        make_config(name, **overrides),
        device=device,
        static_inputs=static_inputs,
        double_buffered=double_buffered,
    )


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: one intra-op thread is as fast, and on a shared 2-core machine far faster
    (the real-model test modules use it: pytestmark = usefixtures("one_torch_thread"))."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=FAMILIES)
def family_name(request):
    return request.param


# --------------------------------------------------------------------------- strategies
def tokens_of(variant: str):
    """Token ids in the family's vocabulary (GLM's holds its mask tokens)."""
    if variant == "glm":
        return st.integers(0, GLM_VOCAB - 1) | st.sampled_from(GLM_MASK_IDS)
    return st.integers(0, BASE["vocab_size"] - 1)


@st.composite
def context_request(draw, variant: str, slot: int, max_beam: int = 3, max_drafts: int = 3):
    tokens = tokens_of(variant)
    # a ChatGLM prompt ends with [gMASK] <sop>: at least 2 tokens
    prompt = draw(st.lists(tokens, min_size=2 if variant == "chatglm" else 1, max_size=40))
    if variant in ("chatglm", "glm"):  # the two-row layouts take a prompt in one step
        begin, chunk = 0, None
    else:
        begin = draw(st.integers(0, len(prompt) - 1))
        chunk = draw(st.none() | st.integers(1, len(prompt) - begin))
    drafts = draw(st.lists(tokens, max_size=max_drafts))
    beam = 1 if drafts else draw(st.integers(1, max_beam))
    explicit = None
    if variant == "gpt" and draw(st.booleans()):
        explicit = draw(st.lists(st.integers(0, 5000), min_size=len(prompt), max_size=len(prompt)))
    return Request(
        seq_slot=slot,
        prompt=prompt,
        beam_width=beam,
        context_position=begin,
        context_chunk_size=chunk,
        draft_tokens=drafts,
        position_ids=explicit,
        kv_block_ids=draw(blocks),
    )


@st.composite
def generation_request(draw, variant: str, slot: int, max_beam: int = 3, max_drafts: int = 3):
    tokens = tokens_of(variant)
    prompt = draw(st.lists(tokens, min_size=2 if variant == "chatglm" else 1, max_size=30))
    drafts = draw(st.lists(tokens, max_size=max_drafts))
    beam = 1 if drafts else draw(st.integers(1, max_beam))
    n = draw(st.integers(1, 12))  # beams are of equal length
    generated = [draw(st.lists(tokens, min_size=n, max_size=n)) for _ in range(beam)]
    explicit = None
    if variant == "gpt" and draw(st.booleans()):
        explicit = draw(st.lists(st.integers(0, 5000), min_size=len(prompt), max_size=len(prompt)))
    mask = draw(st.integers(0, len(prompt))) if variant == "glm" else None
    per_beam = draw(st.booleans())
    kv = [draw(blocks)[0] for _ in range(beam)] if per_beam else draw(blocks)
    return Request(
        seq_slot=slot,
        prompt=prompt,
        beam_width=beam,
        generated=generated,
        kv_block_ids=kv,
        draft_tokens=drafts,
        position_ids=explicit,
        mask_position=mask,
    )


@st.composite
def batch(draw, variant: str, max_requests: int = 8, max_beam: int = 3, slots: int = 8):
    n_ctx = draw(st.integers(0, max_requests))
    n_gen = draw(st.integers(0, max_requests - n_ctx))
    picked = draw(st.permutations(range(slots)))[: n_ctx + n_gen]
    ctx = [draw(context_request(variant, picked[i], max_beam)) for i in range(n_ctx)]
    gen = [draw(generation_request(variant, picked[n_ctx + i], max_beam)) for i in range(n_gen)]
    return ctx, gen


def tokens_after_step(r, is_context: bool) -> list[int]:
    """Tokens of each of r's sequences once this step's inputs are appended."""
    drafts = len(r.draft_tokens or ())
    if is_context:
        n = len(r.prompt)
        chunk = n - r.context_position if r.context_chunk_size is None else r.context_chunk_size
        last = r.context_position + chunk == n
        return [r.context_position + chunk + (drafts if last else 0)]
    return [len(r.prompt) + len(g) + drafts for g in r.generated]


def cover_blocks(ctx, gen, tokens_per_block: int, start: int = 0) -> None:
    """Give every request kv_block_ids that cover its sequences' tokens (one list per beam)."""
    for is_context, reqs in ((True, ctx), (False, gen)):
        for r in reqs:
            lists = []
            for tokens in tokens_after_step(r, is_context):
                n = -(-tokens // tokens_per_block)
                lists.append(list(range(start, start + n)))
                start += n
            r.kv_block_ids = lists


ENGINE_INPUTS = (
    "input_ids",
    "position_ids",
    "context_lengths",
    "host_context_lengths",
    "sequence_length",
    "host_request_types",
    "host_past_key_value_lengths",
    "last_token_ids",
)


def assert_matches_reference(step, want: dict, *, paged: bool, where: object = None) -> None:
    """Every engine tensor of `step` equals the loop-by-loop reference's values `want`."""
    got = {key: v.tolist() for key, v in step.inputs.items()}
    for key in ENGINE_INPUTS:
        assert got[key] == want[key], (key, where)
    if paged:
        assert got["kv_cache_block_offsets"] == want["kv_cache_block_offsets"], where
        assert got["host_kv_cache_block_offsets"] == want["kv_cache_block_offsets"], where
    assert list(step.outputs["logits"].shape) == want["logits_shape"], where
    rounded = want["max_kv_cache_length_rounded"]
    assert step.scalars.get("max_kv_cache_length_rounded", 0) == rounded, where
