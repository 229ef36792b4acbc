"""In-flight steps on two stagings: two RuntimeBuffers of one family take the same calls, one
with the staging it is asked for (two halves, one half, sampled tokens on the device), the other
with the other number of halves and host tokens; after each step every tensor (at capacity,
pads included), the step's sizes, scalars and views must be equal. The other in-flight tests
hold these steps to the stateless step and the reference.

The traffic is serving churn: each step some generation requests finish (their rows refilled
by the last), prompts arrive, the last step's prompts join the generation rows, every sequence
gets its sampled token and, where it needs one, a new KV block; now and then a chunked prompt.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from fuzz_configs import make_buffers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bufc.requests import step as request_step
from bufc.runtime import BatchError, Request

FAMILIES = ("llama", "gpt", "gpt_outputs", "gpt_pp")
# Config values a family needs beyond the fuzz configs' (gpt_pp: the last of two ranks)
EXTRA = {"gpt_outputs": dict(hidden_size=16), "gpt_pp": dict(hidden_size=16, pp_size=2, pp_rank=1)}


def _pair(
    name: str,
    tokens_per_block: int,
    device_tokens: bool = False,
    device: str = "cpu",
    double_buffered: bool = True,
    twin_double_buffered: bool | None = None,
):
    """Ours, and its twin: by default the other number of staging halves, tokens on the host."""
    kw = dict(
        max_batch_size=12,
        max_beam_width=1,
        tokens_per_block=tokens_per_block,
        num_kv_blocks=0,
        **EXTRA.get(name, {}),
    )
    if name == "llama":
        kw["max_attention_window"] = 32 * tokens_per_block  # sequences may fill the window
    ours = make_buffers(
        name, device, device_tokens=device_tokens, double_buffered=double_buffered, **kw
    )
    if twin_double_buffered is None:
        twin_double_buffered = not double_buffered
    full = make_buffers(
        name, device, device_tokens=False, double_buffered=twin_double_buffered, **kw
    )
    return ours, full


class Churn:
    """The caller's side: slots, each sequence's tokens and block lists, its row order."""

    def __init__(self, rng: random.Random, config, paged: bool) -> None:
        self.rng, self.c, self.paged = rng, config, paged
        self.tpb = getattr(config, "tokens_per_block", 1)
        self.width = getattr(config, "max_blocks_per_seq", 0)
        self.next_id = 1
        self.tokens: dict[int, int] = {}  # slot -> tokens after the last step (0: waiting)
        self.prompt: dict[int, int] = {}
        self.blocks: dict[int, int] = {}  # slot -> blocks held
        self.decoding: list[int] = []  # slots that produce a token in the next step

    def _ids(self, n: int) -> list[int]:
        out = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return out

    def arrive(self, slot: int, length: int) -> Request:
        self.prompt[slot], self.tokens[slot] = length, 0
        n = min(-(-length // self.tpb), self.width) if self.paged else 0
        self.blocks[slot] = n + self.rng.randint(0, 1) if self.paged and n < self.width else n
        ids = [self._ids(self.blocks[slot])] if self.paged else None
        prompt = [self.rng.randrange(self.c.vocab_size) for _ in range(length)]
        return Request(seq_slot=slot, prompt=prompt, kv_block_ids=ids)

    def grow(self) -> dict[int, list[int]]:
        """The blocks each decoding sequence needs for its next token."""
        out = {}
        for slot in self.decoding:
            need = -(-(self.tokens[slot] + 1) // self.tpb)
            if self.paged and self.blocks[slot] < min(need, self.width):
                k = min(need, self.width) - self.blocks[slot]
                out[slot] = self._ids(k)
                self.blocks[slot] += k
        return out


def _same(ours, full, a, b, where, host: bool = True) -> None:
    assert a.sizes == b.sizes, where
    for name, view in a.inputs.items():
        assert torch.equal(view.cpu(), b.inputs[name].cpu()), (name, where)
    if host:  # (with device tokens, reading the host tensors takes the tokens back now)
        assert a.scalars == b.scalars, where
        for name, t in ours.tensors.items():
            assert torch.equal(t, full.tensors[name]), (name, where)


def run_churn(
    name: str,
    seed: int,
    steps: int = 30,
    device_tokens: bool = False,
    device: str = "cpu",
    double_buffered: bool = True,
) -> int:
    """The churn through both buffers on `device` (`device_tokens`: ours takes the sampled
    tokens as a tensor there, gathered there; `double_buffered` False: ours has one staging
    half, written in place); returns the steps the twins took."""
    rng = random.Random(seed)
    ours, full = _pair(name, rng.choice((1, 2, 4)), device_tokens, device, double_buffered)
    c = ours.config
    traffic = Churn(rng, c, paged=hasattr(c, "max_blocks_per_seq"))
    length, per_step = rng.randint(1, 6), rng.randint(1, 2)
    waiting: list[int] = []
    computed: dict[int, int] = {}  # prompt tokens computed of each waiting request
    for i in range(steps):
        free = [s for s in range(c.max_batch_size) if s not in traffic.tokens]
        # finishes: some decoding requests leave
        for slot in list(traffic.decoding):
            if rng.random() < 0.15:
                for b in (ours, full):
                    b.finish(slot)
                traffic.decoding.remove(slot)
                del traffic.tokens[slot]
                free.append(slot)
        k = per_step if rng.random() < 0.8 else rng.randint(0, 2)  # else the layout breaks
        chunks = None
        for slot in rng.sample(free, min(k, len(free))):
            r = traffic.arrive(slot, length)
            for b in (ours, full):
                b.add(r)
            waiting.append(slot)
        left = {s: traffic.prompt[s] - computed.get(s, 0) for s in waiting}
        if waiting and rng.random() < 0.1:  # a chunked prompt: another layout
            chunks = dict(left)
            chunks[waiting[0]] = rng.randint(1, left[waiting[0]])
        tokens = None
        if traffic.decoding:
            tokens = np.array([rng.randrange(c.vocab_size) for _ in range(c.max_batch_size)])
        blocks = traffic.grow()
        given = tokens
        if device_tokens and tokens is not None:
            given = torch.as_tensor(tokens, device=device)
        a = ours.step(given, chunks=chunks, blocks=dict(blocks))
        b = full.step(tokens, chunks=chunks, blocks=dict(blocks))
        _same(ours, full, a, b, (seed, i), host=not device_tokens or i % 2 == 1)
        for slot in traffic.decoding:
            traffic.tokens[slot] += 1
        ran = left if chunks is None else chunks
        for s in waiting:
            computed[s] = computed.get(s, 0) + ran[s]
        done = [s for s in waiting if computed[s] == traffic.prompt[s]]
        for s in done:
            traffic.tokens[s] = traffic.prompt[s]
            traffic.decoding.append(s)
            del computed[s]
        waiting = [s for s in waiting if s not in done]
    return steps


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_an_in_flight_step_equals_its_twin(name: str, seed: int) -> None:
    run_churn(name, seed)


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), device_tokens=st.booleans())
def test_a_step_in_one_staging_half_equals_its_twin(
    device: str, name: str, seed: int, device_tokens: bool
) -> None:
    """double_buffered=False: every step is written over the values of the last (the KV rows
    changed since the last step only), against two halves; on CUDA each step waits for the
    last one's copy and the tokens it copied back."""
    run_churn(
        name,
        seed,
        device_tokens=device_tokens and name == "llama",
        device=device,
        double_buffered=False,
    )


@pytest.mark.parametrize(
    "device",
    [
        "cpu",  # the CPU emulates the device path; on CUDA it runs there (by hand on the H200)
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_a_step_with_tokens_on_the_device_equals_its_twin(device: str, seed: int) -> None:
    """The sampled tokens as a tensor on the buffers' device: a step gathers them into its
    generation rows there, and equals the twin's with host tokens (on the same device)."""
    run_churn("llama", seed, device_tokens=True, device=device)


def _churning():
    """Buffers two steps in (two tokens a block): three decoding requests of 4 tokens (slot 1
    finished, its row refilled), slot 4's prompt done in the last step, and slot 5 arriving
    with a prompt as long."""
    b, _ = _pair("llama", 2)
    ids = iter(range(1, 10_000))
    for s in range(4):
        b.add(Request(seq_slot=s, prompt=[1, 2, 3], kv_block_ids=[[next(ids), next(ids)]]))
    b.step()
    tokens = np.full(b.config.max_batch_size, 7)
    b.add(Request(seq_slot=4, prompt=[4, 5, 6], kv_block_ids=[[next(ids), next(ids)]]))
    b.step(tokens)
    b.finish(1)
    b.add(Request(seq_slot=5, prompt=[8, 9, 1], kv_block_ids=[[next(ids), next(ids)]]))
    return b, tokens, ids


def test_a_refused_step_changes_nothing_and_the_next_one_runs() -> None:
    b, tokens, ids = _churning()
    before = {k: v.clone() for k, v in b.tensors.items()}
    bad = tokens.copy()
    bad[4] = b.config.vocab_size
    with pytest.raises(BatchError, match=r"token 1000 of a request in flight is outside"):
        b.step(bad)
    with pytest.raises(
        BatchError,
        match=r"generation request 0 \(seq_slot 0\): kv_block_ids holds 2 blocks, but its tokens after this step need 3",
    ):
        b.step(tokens)  # the decoding sequences' fifth tokens need a third block
    with pytest.raises(BatchError, match=r"blocks\[1\]: that seq slot holds no request"):
        b.step(tokens, blocks={0: [next(ids)], 1: [next(ids)]})
    assert all(torch.equal(before[k], v) for k, v in b.tensors.items())
    step = b.step(tokens, blocks={s: [next(ids)] for s in (0, 2, 3)})
    n = step.sizes.num_sequences
    assert b.tensors["host_seq_slots"][:n].tolist() == [5, 0, 3, 2, 4]
    assert b.tensors["host_sequence_lengths"][:n].tolist() == [3, 5, 5, 5, 4]


def test_a_run_without_arrivals_returns_to_decode_steps() -> None:
    """Finishes alone: a refilled row is a full step, and the steps after it advance (the decode steps that tokens
    on the device replay as CUDA graphs)."""
    b, _ = _pair("llama", 4)
    for s in range(4):
        b.add(Request(seq_slot=s, prompt=[1, 2, 3], kv_block_ids=[[10 + s, 20 + s, 30 + s]]))
    b.step()
    tokens = np.full(b.config.max_batch_size, 7)
    log: list[str] = []
    real_steady = request_step._steady

    def steady(*args, **kwargs):
        log.append("steady")
        return real_steady(*args, **kwargs)

    kinds = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(request_step, "_steady", steady)
        for finish in (None, 1, None, None, 2, None, None):  # 2: the last row, by then
            if finish is not None:
                b.finish(finish)
            log.clear()
            b.step(tokens)
            kinds.append(log[0] if log else "full")
    assert kinds == ["full", "full", "steady", "steady", "full", "steady", "steady"]


def test_steps_of_finishes_alone_equal_the_twin() -> None:
    """Steps without context rows whose finishes refill rows, one after another: each half's
    KV rows are compared against the layout it was written with (not the table's rows as they
    are now), and equal the full step's."""
    ours, full = _pair("llama", 2)
    n = ours.config.max_batch_size
    for b in (ours, full):
        for s in range(n):
            ids = [[100 * s + k for k in range(8)]]
            b.add(Request(seq_slot=s, prompt=[1, 2, 3], kv_block_ids=ids))
        b.step()
    tokens = np.arange(n) + 5
    for b in (ours, full):  # every list grows in one append: their versions are one
        b.step(tokens, blocks={s: [100 * s + 8] for s in range(n)})
    for slot in (0, 2, 4, 6, 8):  # never the last row: each finish refills one
        steps = []
        for b in (ours, full):
            b.finish(slot)
            steps.append(b.step(tokens))
        _same(ours, full, *steps, slot)


@pytest.mark.parametrize("double_buffered", (True, False))
@pytest.mark.parametrize("few", (0, 1000))
def test_the_kv_rows_of_the_twins_are_equal(monkeypatch, few, double_buffered) -> None:
    """The blocks a step appends written one by one or at once (FEW_BLOCKS), in the churn and
    in steps of finishes alone."""
    monkeypatch.setattr(request_step, "FEW_BLOCKS", few)
    for seed in range(4):
        run_churn("llama", seed, double_buffered=double_buffered)
    test_steps_of_finishes_alone_equal_the_twin()
