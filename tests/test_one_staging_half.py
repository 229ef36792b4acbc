"""RuntimeBuffers(double_buffered=False): one staging half, each step written in place.

The differential tests of every path run with one half too (test_in_flight, test_staging_twins,
test_advance). Here: what the option changes (one host arena, one fill target per tensor), and
what a step that fails after it started writing leaves: the next steps equal those of buffers
that never saw it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fuzz_configs import make_buffers

from bufc.rules import core
from bufc.runtime import BatchError, Request
from bufc.runtime.staging import Staging

TPB = 2


def _buffers(double_buffered: bool):
    return make_buffers(
        "llama",
        max_beam_width=1,
        tokens_per_block=TPB,
        num_kv_blocks=0,
        double_buffered=double_buffered,
    )


def test_one_half_is_one_arena_with_one_target_per_tensor() -> None:
    one, two = _buffers(False), _buffers(True)
    assert one._staging.host[0] is one._staging.host[1]
    assert two._staging.host[0] is not two._staging.host[1]
    for name, target in vars(one._targets[0]).items():
        assert vars(one._targets[1])[name] is target, name
    assert vars(two._targets[0])["host_input_ids"] is not vars(two._targets[1])["host_input_ids"]


class _Serving:
    """A serving churn: each step the oldest decoding request finishes, a
    3-token prompt arrives in its slot, every decoding sequence gets a token and, where its
    next token starts a block, the block."""

    def __init__(self, slots: int) -> None:
        self.slots, self.next_id = slots, 1
        self.length: dict[int, int] = {}  # slot -> tokens after the last step
        self.blocks: dict[int, int] = {}
        self.decoding: list[int] = []
        self.waiting: list[int] = []

    def _ids(self, n: int) -> list[int]:
        self.next_id += n
        return list(range(self.next_id - n, self.next_id))

    def calls(self, i: int) -> tuple[list[int], list[Request], dict]:
        finished = [self.decoding.pop(0)] if len(self.decoding) > 3 else []
        for slot in finished:
            del self.length[slot]
        free = [s for s in range(self.slots) if s not in self.length]
        arrived = []
        for slot in free[: 1 if i else 4]:
            self.length[slot], self.blocks[slot] = 0, 2
            arrived.append(Request(seq_slot=slot, prompt=[5, 6, 7], kv_block_ids=[self._ids(2)]))
            self.waiting.append(slot)
        blocks = {}
        for slot in self.decoding:
            if self.blocks[slot] * TPB < self.length[slot] + 1:  # its next token needs a block
                blocks[slot] = self._ids(1)
                self.blocks[slot] += 1
        return finished, arrived, blocks

    def ran(self) -> None:
        for slot in self.decoding:
            self.length[slot] += 1
        for slot in self.waiting:
            self.length[slot] = 3
        self.decoding += self.waiting
        self.waiting = []


def _raising_after(real):
    def writes_then_raises(*args, **kwargs):
        real(*args, **kwargs)
        raise ZeroDivisionError("injected")

    return writes_then_raises


@pytest.mark.parametrize(
    "where, at",
    [("fill", 1), ("fill", 4), ("fill", 5), ("copy", 1), ("copy", 5)],
)
def test_a_failed_step_in_one_half_is_noted_and_the_next_steps_are_right(
    monkeypatch, where: str, at: int
) -> None:
    one, twin = _buffers(False), _buffers(True)
    serving = _Serving(one.config.max_batch_size)
    tokens = np.full(one.config.max_batch_size, 9)
    failed = False
    for i in range(10):
        finished, arrived, blocks = serving.calls(i)
        for b in (one, twin):
            for slot in finished:
                b.finish(slot)
            for r in arrived:
                b.add(r)
        given = tokens if serving.decoding else None
        a = None
        if i == at:
            with monkeypatch.context() as mp:
                if where == "fill":
                    mp.setattr(core, "last_token_ids", _raising_after(core.last_token_ids))
                else:
                    mp.setattr(Staging, "copy", _raising_after(Staging.copy))
                try:
                    a = one.step(given, blocks=dict(blocks))
                except BatchError as exc:
                    failed = True
                    assert "one staging half" in "".join(getattr(exc, "__notes__", ())), exc
        if a is None:  # the step (again, after it failed)
            a = one.step(given, blocks=dict(blocks))
        b = twin.step(given, blocks=dict(blocks))
        serving.ran()
        assert a.sizes == b.sizes, i
        for name, t in twin.tensors.items():
            assert torch.equal(one.tensors[name], t), (name, i)
        for name, view in b.inputs.items():
            assert torch.equal(a.inputs[name], view), (name, i)
    assert failed
