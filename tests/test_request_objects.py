"""The caller's own request objects: `rules/request.py` says any object with the fields works.
A request class that compares by value (a plain dataclass) must read as well as bufc's own
`Request`, also where its fields are numpy arrays, whose `==` has no single truth value."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from fuzz_configs import make_buffers


@dataclasses.dataclass
class OwnRequest:  # a dataclass compares its fields by value (eq=True by default)
    seq_slot: int
    prompt: np.ndarray
    generated: list
    kv_block_ids: list
    beam_width: int = 1
    context_position: int = 0
    context_chunk_size: int | None = None
    draft_tokens: list = dataclasses.field(default_factory=list)
    position_ids: list | None = None


@pytest.mark.parametrize("name", ("llama", "llama_flash", "gpt"))
@pytest.mark.parametrize("same_values", (False, True))
def test_a_slot_reused_by_a_request_that_compares_by_value(name, same_values) -> None:
    """Slot 0 decodes, then a new request object takes it in the next step (one equal to the
    last in every field, or one with other values): the step equals that of buffers that never
    saw the first one (a tuple comparison of the two steps' requests raised on the numpy
    prompts: the batch was refused as malformed)."""
    overrides = dict(max_beam_width=1, tokens_per_block=4)
    buffers, twin = make_buffers(name, **overrides), make_buffers(name, **overrides)
    first = OwnRequest(0, np.array([1, 2, 3]), [[4]], [[5]])
    buffers.prepare_step([], [first])
    if same_values:
        new = OwnRequest(0, np.array([1, 2, 3]), [[4]], [[5]])
    else:
        new = OwnRequest(0, np.array([7, 8, 9]), [[4, 6]], [[6, 7]])
    got, want = buffers.prepare_step([], [new]), twin.prepare_step([], [new])
    for key, value in want.inputs.items():
        assert torch.equal(got.inputs[key], value), key
