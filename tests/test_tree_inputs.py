"""The drafting families' tree inputs are bound as TensorRT-LLM's runtimes bind them:
spec_decoding_position_offsets at the step's longest generation length (EagleBuffers,
ExplicitDraftTokensBuffers and LookaheadRuntimeBuffers setFromInputs; the attention plugin
reads that dimension as the generation input length), and Eagle's paths one per decoding token
(its engine declares draft_paths [-1, max_draft_len + 1, num_eagle_layers + 1])."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import make_buffers

from bufc.generated import eagle
from bufc.runtime import Request

TREE_FAMILIES = ("eagle", "lookahead", "redrafter")
K = 5  # max_draft_tokens 4


def _buffers(name: str):
    paths = {
        "eagle": {"max_draft_path_len": 3},
        "redrafter": {"num_draft_paths": 2, "max_draft_path_len": 2},
    }
    return make_buffers(
        name, max_beam_width=1, max_draft_tokens=K - 1, tokens_per_block=4, **paths.get(name, {})
    )


@pytest.mark.parametrize("name", TREE_FAMILIES)
def test_position_offsets_are_bound_at_the_longest_generation_length(name: str) -> None:
    b = _buffers(name)
    a = Request(0, [1, 2, 3], generated=[[4]], kv_block_ids=[[1, 2]], draft_tokens=[7])
    c = Request(1, [1, 2], generated=[[4]], kv_block_ids=[[3, 4]], draft_tokens=[7, 8, 9])
    step = b.prepare_step([], [a, c])
    assert tuple(step.inputs["spec_decoding_position_offsets"].shape) == (2, 4)  # 1 + 3 drafts
    assert step.sizes.max_generation_length == 4
    step = b.prepare_step([], [dataclasses.replace(a, draft_tokens=[])])
    assert tuple(step.inputs["spec_decoding_position_offsets"].shape) == (1, 1)
    # no generation request: Eagle's and ReDrafter's runtimes fall back to max_decoding_tokens
    step = b.prepare_step([Request(2, [1, 2, 3], kv_block_ids=[[5]])], [])
    assert tuple(step.inputs["spec_decoding_position_offsets"].shape) == (0, K)


@pytest.mark.parametrize("name", TREE_FAMILIES)
def test_in_flight_steps_bind_the_offsets_at_their_own_drafts(name: str) -> None:
    b = _buffers(name)
    for slot in (0, 1, 2):
        b.add(Request(slot, [1, 2, 3], kv_block_ids=[list(range(slot * 4, slot * 4 + 4))]))
    step = b.step()
    assert tuple(step.inputs["spec_decoding_position_offsets"].shape) == (0, K)
    tokens = np.full(b.config.max_batch_size, 9, np.int64)
    step = b.step(tokens, drafts={0: [1, 2], 2: [3]})
    assert tuple(step.inputs["spec_decoding_position_offsets"].shape) == (3, 3)
    step = b.step(tokens, accepted={0: 1, 2: 0}, drafts={1: [4, 5, 6, 7]})
    assert tuple(step.inputs["spec_decoding_position_offsets"].shape) == (3, K)
    step = b.step(tokens, accepted={1: 4})
    assert tuple(step.inputs["spec_decoding_position_offsets"].shape) == (3, 1)


def test_eagle_has_one_path_per_decoding_token() -> None:
    fields = {f.name for f in dataclasses.fields(eagle.Config) if f.init}
    assert "num_draft_paths" not in fields  # derived: max_draft_tokens + 1
    b = _buffers("eagle")
    for name in ("eagle_draft_paths", "eagle_next_draft_tokens", "eagle_next_draft_paths"):
        assert tuple(b.tensors[name].shape) == (b.config.max_batch_size, K, 4)
    with pytest.raises(TypeError, match="num_draft_paths"):
        eagle.Config(max_batch_size=2, max_num_tokens=8, vocab_size=8, num_layers=1,
                     max_attention_window=8, max_draft_tokens=2, max_draft_path_len=2,
                     num_draft_paths=3)  # fmt: skip
