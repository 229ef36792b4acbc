"""Block ids appended in flight (`step(blocks=)`): written at once for many slots
(`BlockTable.append_many`, past `FEW_BLOCKS` slots) or slot by slot, every KV row equal to the
stateless step's. The random in-flight traffic covers both paths (tests/test_in_flight.py); here
the cases it reaches rarely."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fuzz_configs import make_buffers

from bufc.requests import step as request_step
from bufc.runtime import Request


@pytest.mark.parametrize("few", (0, 1000))
@pytest.mark.parametrize("name", ("llama", "llama_flash"))
def test_appends_of_no_block_and_of_two_blocks_in_one_step_equal_the_stateless_step(
    monkeypatch, few, name
):
    """Ten slots' appends in one step, one of them empty and one of two ids (as many ids as
    slots, but not one each), written at once or one by one: every KV row equals the stateless
    step's (the at-once path once paired each id with the next slot's row)."""
    monkeypatch.setattr(request_step, "FEW_BLOCKS", few)
    n = 10
    overrides = dict(max_beam_width=1, max_batch_size=n, max_num_tokens=200, tokens_per_block=4)
    flight, stateless = make_buffers(name, **overrides), make_buffers(name, **overrides)
    requests = []
    for s in range(n):
        ids = [1, 2] if s == 0 else [3 * s + 1]  # slot 0 holds its second block already
        flight.add(Request(seq_slot=s, prompt=[1, 2, 3, 4], kv_block_ids=[list(ids)]))
        requests.append(Request(seq_slot=s, prompt=[1, 2, 3, 4], kv_block_ids=[list(ids)]))
    flight.step()  # the 4-token prompts: every next token enters a second block
    blocks = {s: [3 * s + 2] for s in range(n)}
    blocks[0], blocks[1] = [], [5, 6]
    step = flight.step(np.full(n, 7, np.int64), blocks=blocks)
    for s, r in enumerate(requests):
        r.kv_block_ids = [r.kv_block_ids[0] + blocks[s]]
        r.generated = [[7]]
    want = stateless.prepare_step([], requests)
    for key, value in want.inputs.items():
        assert torch.equal(step.inputs[key], value), key
