"""The step built on the device (``build='device'``) against the host build: the same random
in-flight traffic (arrivals, chunked prompts, decode steps, block appends, finishes and slot
reuse, context-only steps, buckets) through both, every bound device tensor compared every
step. On the CPU the device program runs eagerly (the emulation in ``make test``); on a GPU
(``BUFC_DEVICE=cuda``, by hand) it runs as one CUDA graph per bucket. A failed step at any stage
leaves both the device mirror and the request table at the last step."""

from __future__ import annotations

import copy
import os
import random

import numpy as np
import pytest
import torch
from conftest import family, make_config

from bufc.errors import BatchError
from bufc.runtime import Request
from bufc.runtime import device_build as device_build_module

DEVICE = os.environ.get("BUFC_DEVICE", "cpu")
TPB = 4
VARIANTS = {
    "one_group": {},
    "two_windows": {"num_layers": 3, "attention_windows": [8, 64, 8]},
    "read_index": {"max_kv_read_tokens": 600},
    "beam_capacity": {"max_beam_width": 3, "max_draft_tokens": 3},  # one beam each, still
    "no_host_inputs": {"host_inputs": False},  # an engine that reads only device inputs
    "flashinfer": {"family": "llama_flashinfer"},
}


def _pair(family_name: str = "llama_flash", **overrides):
    """A host build and a device build of one Config (llama_flash's by default)."""
    config = make_config(
        family_name,
        **{
            "max_beam_width": 1,
            "max_draft_tokens": 0,
            "tokens_per_block": TPB,
            "max_attention_window": 128,
            **overrides,
        },
    )
    mod = family(family_name)
    host = mod.RuntimeBuffers(config, device="cpu")
    return host, mod.RuntimeBuffers(config, device=DEVICE, build="device")


class Traffic:
    """Random in-flight traffic, the same calls for every build it drives."""

    def __init__(self, seed: int, builds: list, windows: tuple[int, ...]) -> None:
        self.rng = random.Random(seed)
        self.builds, self.windows = builds, windows
        self.slots = builds[0].config.max_batch_size
        self.lists: dict[int, dict[int, list[int]]] = {}
        self.tokens_of: dict[int, int] = {}  # KV tokens each slot will hold after its next token
        self.left: dict[int, int] = {}  # prompt tokens each context-phase slot has left
        self.produced: set[int] = set()
        self.next_block = 1
        self.quiet = 0  # steps left without an arrival or a finish

    def _blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        self.rng.shuffle(out)
        return out

    def arrive(self, slot: int) -> None:
        n = self.rng.randint(1, 14)
        ahead = self.rng.randint(0, 2)  # blocks allocated ahead of need
        self.lists[slot] = {w: self._blocks(-(-n // TPB) + ahead) for w in self.windows}
        self.left[slot], self.tokens_of[slot] = n, 0
        prompt = [self.rng.randrange(100) for _ in range(n)]
        ids = {w: [list(x)] for w, x in self.lists[slot].items()}
        for b in self.builds:
            b.add(Request(slot, prompt, kv_block_ids=copy.deepcopy(ids)))

    def plan(self) -> dict:
        """The next step's keywords (and the state it leaves, applied by `ran`)."""
        rng = self.rng
        chunks = {s: rng.randint(1, n) for s, n in self.left.items() if rng.random() < 0.8}
        generation = rng.random() > 0.1
        blocks: dict = {}
        for slot in self.lists:
            grow = chunks.get(slot, 0) if slot in self.left else int(generation)
            need = -(-(self.tokens_of[slot] + grow) // TPB)
            for w, ids in self.lists[slot].items():
                if need > len(ids) or rng.random() < 0.05:
                    new = self._blocks(max(need - len(ids), 1))
                    ids += new
                    blocks.setdefault(slot, {})[w] = new
        if len(self.windows) == 1:
            blocks = {s: v[self.windows[0]] for s, v in blocks.items()}
        return {"chunks": chunks, "generation": generation, "blocks": blocks}

    def ran(self, kw: dict) -> None:
        """The step of `kw` ran: counts moved, tokens sampled, maybe a finish and an arrival."""
        produced = set()
        for slot, n in kw["chunks"].items():
            self.left[slot] -= n
            self.tokens_of[slot] += n
            if not self.left[slot]:
                del self.left[slot]
                produced.add(slot)
        if kw["generation"]:
            for slot in self.lists:
                if slot not in self.left and slot not in produced:
                    self.tokens_of[slot] += 1
                    produced.add(slot)
        self.produced = produced
        if self.quiet:  # a run of decode steps: nothing arrives or leaves
            self.quiet -= 1
            return
        if self.rng.random() < 0.2:
            self.quiet = self.rng.randint(2, 5)
        if self.rng.random() < 0.3 and self.lists:
            slot = self.rng.choice(sorted(self.lists))
            for b in self.builds:
                b.finish(slot)
            self.produced.discard(slot)
            del self.lists[slot], self.tokens_of[slot]
            self.left.pop(slot, None)
        free = [s for s in range(self.slots) if s not in self.lists]
        if free and self.rng.random() < 0.5:
            self.arrive(self.rng.choice(free))

    def tokens(self) -> torch.Tensor | None:
        if not self.produced:
            return None
        values = torch.zeros(self.slots, dtype=torch.int64)
        for slot in self.produced:
            values[slot] = self.rng.randrange(100)
        return values

    def bucket(self, kw: dict) -> tuple[int, int] | None:
        """None, or a bucket at least the step's (tokens, rows): one beam, so a padded row is a
        request, within max_batch_size."""
        roll = self.rng.random()
        if roll < 0.3:
            return None
        c = self.builds[0].config
        if roll < 0.6:  # a CUDA graph's fixed bucket: steady runs repeat it
            return c.max_num_tokens, c.max_batch_size
        gen = sum(1 for s in self.lists if s not in self.left) if kw["generation"] else 0
        rows = len(kw["chunks"]) + gen
        tokens = sum(kw["chunks"].values()) + gen
        return (
            min(c.max_num_tokens, tokens + self.rng.randint(0, 5)),
            rows + self.rng.randint(0, c.max_batch_size - rows),
        )


def _same(host_step, device_step) -> None:
    """Every input the device step binds equals the host build's, and the scalars agree (the
    device's max_* are their declared bounds)."""
    assert device_step.sizes == host_step.sizes
    assert device_step.mode == host_step.mode
    assert set(device_step.inputs) == set(host_step.inputs)
    for name, value in device_step.inputs.items():
        want = host_step.inputs[name]
        assert value.shape == want.shape, name
        assert torch.equal(value.cpu(), want), (name, value, want)
    h, d = host_step.scalars, device_step.scalars
    assert set(d) == set(h) and d["num_actual_tokens"] == h["num_actual_tokens"]
    assert all(d[n] >= h[n] for n in ("max_query_len", "max_seq_len") if n in h)


def _drive(seed: int, variant: str, steps: int = 60) -> None:
    overrides = dict(VARIANTS[variant])
    host, device = _pair(overrides.pop("family", "llama_flash"), **overrides)
    traffic = Traffic(seed, [host, device], getattr(host.config, "attention_window_sizes", (0,)))
    for slot in range(3):
        traffic.arrive(slot)
    for _ in range(steps):
        kw = traffic.plan()
        tokens, bucket = traffic.tokens(), traffic.bucket(kw)
        want = host.step(
            None if tokens is None else tokens.numpy(), bucket=bucket, **copy.deepcopy(kw)
        )
        got = device.step(
            None if tokens is None else tokens.to(DEVICE), bucket=bucket, **copy.deepcopy(kw)
        )
        _same(want, got)
        traffic.ran(kw)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("seed", range(3))
def test_the_device_build_equals_the_host_build(seed: int, variant: str) -> None:
    _drive(seed, variant)


def test_the_comparison_fails_when_a_device_form_is_wrong(monkeypatch) -> None:
    """A mutated device form (slot mapping one slot off) or a mutated intake (the sampled
    token not taken in) is caught by the comparison."""
    from bufc.rules import paged_device

    real = paged_device.device_kv_slot_mapping

    def off_by_one(out, d, pad, **reads):
        real(out, d, pad, **reads)
        out.add_(1)

    monkeypatch.setattr(paged_device, "device_kv_slot_mapping", off_by_one)
    with pytest.raises(AssertionError, match="slot_mapping"):
        _drive(0, "one_group", steps=5)
    monkeypatch.undo()
    monkeypatch.setattr(
        device_build_module.DeviceMirror, "state", lambda m: (m.kv_len, m.blocks, m.flag)
    )
    real_step = device_build_module.DeviceBuild._device_step

    def no_intake(self, lay, targets, tokens):
        real_step(self, lay, targets, None)

    monkeypatch.setattr(device_build_module.DeviceBuild, "_device_step", no_intake)
    with pytest.raises(AssertionError, match="input_ids"):
        _drive(1, "one_group", steps=12)


def _boom(*args, **kwargs):
    raise RuntimeError("injected")


def _after(real):
    def run(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("injected")

    return run


STAGES = {
    "plan": (lambda: (device_build_module.request_step, "plan", _boom)),
    "pack": (lambda: (device_build_module.DeviceBuild, "_pack", _boom)),
    "views": (lambda: (device_build_module.DeviceBuild, "_step", _boom)),
    "a device form": (
        lambda: (
            __import__("bufc.rules.paged_device", fromlist=["x"]),
            "device_seq_lens",
            _boom,
        )
    ),
    "after the device program": (
        lambda: (
            device_build_module.DeviceBuild,
            "_device_step",
            _after(device_build_module.DeviceBuild._device_step),
        )
    ),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_failed_step_leaves_the_last_step_current(stage: str, monkeypatch) -> None:
    """An exception at any stage of a device step leaves the device mirror and the request
    table at the last step: the same call again, and every step after it, equals the host
    build that never saw the failure (blocks appended by the failed call included)."""
    if DEVICE != "cpu" and stage in ("a device form", "after the device program"):
        pytest.skip("a replayed CUDA graph runs no Python to fail (its eager run is the CPU's)")
    host, device = _pair(**VARIANTS["two_windows"])
    traffic = Traffic(7, [host, device], host.config.attention_window_sizes)
    for slot in range(3):
        traffic.arrive(slot)
    for i in range(16):
        kw = traffic.plan()
        tokens, bucket = traffic.tokens(), traffic.bucket(kw)
        host_tokens = None if tokens is None else tokens.numpy()
        want = host.step(host_tokens, bucket=bucket, **copy.deepcopy(kw))
        device_tokens = None if tokens is None else tokens.to(DEVICE)
        if i in (3, 9):  # the failed call, then the same call again
            owner, name, fake = STAGES[stage]()
            with monkeypatch.context() as m:
                m.setattr(owner, name, fake)
                with pytest.raises((RuntimeError, BatchError), match="injected"):
                    device.step(device_tokens, bucket=bucket, **copy.deepcopy(kw))
        got = device.step(device_tokens, bucket=bucket, **copy.deepcopy(kw))
        _same(want, got)
        traffic.ran(kw)


def test_a_token_outside_the_vocabulary_is_flagged_and_refused_until_finished() -> None:
    """Read on the device, never on the host: the device writes 0 in its place, and the next
    step names the slot until its request is finished (as the host build's gather does)."""
    _, device = _pair()
    vocab = device.config.vocab_size
    device.add(Request(0, [1, 2, 3], kv_block_ids=[[1, 2]]))
    device.add(Request(1, [4, 5], kv_block_ids=[[3]]))
    device.step()
    tokens = torch.tensor([7, vocab + 5] + [0] * 6, device=DEVICE)
    step = device.step(tokens)
    assert step.inputs["input_ids"].tolist() == [7, 0]
    with pytest.raises(
        BatchError,
        match=rf"^step\(\): a step sampled token {vocab + 5} for seq_slot 1, outside 0 \.\. "
        rf"{vocab - 1} \(vocab_size={vocab}\); the device wrote the pad token in its place\. "
        r"Finish that request \(finish\(1\)\) before the next step$",
    ):
        device.step(torch.zeros(8, dtype=torch.int64, device=DEVICE))
    device.finish(1)
    assert device.step(torch.full((8,), 9, device=DEVICE)).inputs["input_ids"].tolist() == [9]


def test_what_the_device_build_refuses_is_refused_by_the_call_that_hands_it_over() -> None:
    config = make_config("llama_flash", tokens_per_block=TPB, max_attention_window=128)
    mod = family("llama_flash")
    with pytest.raises(ValueError, match=r"^build must be 'host' or 'device', got 'gpu'$"):
        mod.RuntimeBuffers(config, build="gpu")
    with pytest.raises(
        ValueError,
        match=r"^the llama family has no device build: a tensor it binds on the device has no "
        r"device form \(a rule's device_fill\), or a step scalar no device value; use "
        r"build='host'$",
    ):
        family("llama").RuntimeBuffers(make_config("llama"), build="device")
    device = mod.RuntimeBuffers(config, build="device")
    with pytest.raises(
        BatchError,
        match=r"^request \(seq_slot 0\): the device build \(build='device'\) runs one beam per "
        r"request, without explicit position ids or draft tokens; this request has beam_width "
        r"2: use build='host' for it$",
    ):
        device.add(Request(0, [1, 2, 3], beam_width=2, kv_block_ids=[[1], [2]]))
    with pytest.raises(BatchError, match=r"this request has explicit position_ids: use"):
        device.add(Request(0, [1, 2, 3], position_ids=[0, 1, 2], kv_block_ids=[[1]]))
    with pytest.raises(BatchError, match=r"this request has draft tokens: use"):
        device.add(Request(0, [1, 2, 3], draft_tokens=[4], kv_block_ids=[[1]]))
    device.add(Request(0, [1, 2, 3], kv_block_ids=[[1]]))
    with pytest.raises(
        BatchError,
        match=r"^prepare_step\(\) builds on the host; these buffers build='device'$",
    ):
        device.prepare_step([], [])
    device.step()
    with pytest.raises(
        BatchError,
        match=r"^step\(\): the device build \(build='device'\) runs no draft tokens; use "
        r"build='host' for speculative decoding$",
    ):
        device.step(torch.zeros(8, dtype=torch.int64), drafts={0: [1]})
    with pytest.raises(
        BatchError,
        match=r"^step\(\): the device build takes the sampled tokens as a tensor on cpu, "
        r"indexed by seq slot \(or None\); got ",
    ):
        device.step([5] * 8)
    with pytest.raises(
        BatchError,
        match=r"^at the bucket host_input_ids would be \[513\], beyond its capacity \[512\]: pick a "
        r"smaller bucket$",
    ):
        device.step(torch.zeros(8, dtype=torch.int64), bucket=(513, 1))
    sent = device.bytes_to_device
    step = device.step(torch.zeros(8, dtype=torch.int64), bucket=(4, 2))
    assert step.inputs["seq_lens"].tolist() == [4, 0]
    assert device.bytes_to_device > sent  # the delta, counted like the host build's copy
    with pytest.raises(
        BatchError,
        match=r"^views\(\) reads the host build's layout; these buffers build='device': build "
        r"each step at its bucket instead, step\(\.\.\., bucket=\(tokens, rows\)\)$",
    ):
        device.views(step.sizes.padded(8, 4))
    assert step.inputs.seq_lens_cpu.tolist() == [4, 0]  # host inputs: on the host, alike


def test_host_inputs_false_leaves_every_host_input_out_of_both_builds() -> None:
    """An engine that reads only device inputs (a FlashAttention engine under CUDA graphs):
    no *_cpu input is bound, by either build, and the device build writes none on the host."""
    host, device = _pair(host_inputs=False)
    for b in (host, device):
        b.add(Request(0, [1, 2, 3], kv_block_ids=[[1]]))
        step = b.step()
        assert not [n for n in step.inputs if n.endswith("_cpu")]
        with pytest.raises(AttributeError, match="not among this step's inputs"):
            step.inputs.seq_lens_cpu  # noqa: B018
    assert int(device.tensors["host_seq_lens"].abs().sum()) == 0  # never written


def test_every_slot_arriving_and_growing_in_one_step_fits_the_delta() -> None:
    """Every slot's whole block row (its arrival) and an appended id each, in one step: the
    most block ids a delta carries, past the next power of two of one row per slot."""
    host, device = _pair(max_attention_window=4 * TPB - 1)  # 4 blocks per row
    assert host.config.max_blocks_per_seq == 4
    for slot in range(8):
        for b in (host, device):
            b.add(Request(slot, [1, 2, 3, 4, 5], kv_block_ids=[[10 * slot + 1, 10 * slot + 2]]))
    grown = {slot: [10 * slot + 3] for slot in range(8)}
    _same(host.step(blocks=copy.deepcopy(grown)), device.step(blocks=copy.deepcopy(grown)))


def test_steady_steps_after_a_context_only_step_take_in_every_token() -> None:
    """A scheduler that runs prompts in steps of their own (generation=False): the steady
    steps after one take in the tokens of every row, in both staging halves."""
    host, device = _pair()
    S = host.config.max_batch_size

    def step(value: int | None, **kw) -> None:
        tokens = None if value is None else torch.full((S,), value)
        want = host.step(None if tokens is None else tokens.numpy(), **copy.deepcopy(kw))
        _same(want, device.step(None if tokens is None else tokens.to(DEVICE), **kw))

    for b in (host, device):
        b.add(Request(0, [1, 2, 3], kv_block_ids=[[1, 2, 3]]))
    step(None)
    step(10)
    for b in (host, device):
        b.add(Request(1, [4, 5, 6], kv_block_ids=[[4, 5, 6]]))
    step(11, generation=False)
    for value in (12, 13, 14, 15, 16):
        step(value)


def test_every_token_outside_the_vocabulary_is_refused_until_its_request_finishes() -> None:
    """Two slots sample out-of-range tokens in one step: each is refused in turn until its
    request is finished; a new request in a finished slot is not refused for its
    predecessor's token."""
    _, device = _pair()
    vocab = device.config.vocab_size
    for slot in range(3):
        device.add(Request(slot, [1, 2], kv_block_ids=[[slot + 1]]))
    device.step()
    device.step(torch.tensor([7, vocab + 5, -3] + [0] * 5, device=DEVICE))
    zeros = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    with pytest.raises(BatchError, match=rf"token {vocab + 5} for seq_slot 1"):
        device.step(zeros)
    device.finish(1)
    with pytest.raises(BatchError, match=r"token -3 for seq_slot 2"):
        device.step(zeros)
    device.finish(2)
    device.add(Request(2, [4, 5], kv_block_ids=[[9]]))
    assert device.step(zeros).sizes.num_sequences == 2  # slot 0 decodes, slot 2's prompt runs


@pytest.mark.parametrize(
    "kw",
    [
        {"drafts": np.array([1, 2])},
        {"accepted": np.array([0, 0])},
        {"drafts": torch.tensor([1, 2])},
        {"bucket": np.array([8, 8])},
        {"bucket": (8.0, 8)},
    ],
    ids=["drafts-array", "accepted-array", "drafts-tensor", "bucket-array", "bucket-float"],
)
def test_a_hostile_argument_is_a_batch_error_and_changes_nothing(kw) -> None:
    """What the host build refuses with a BatchError, the device build refuses alike, also
    after steady steps at a bucket (the layout it remembers is no shortcut)."""
    host, device = _pair()
    for b in (host, device):
        b.add(Request(0, [1, 2, 3], kv_block_ids=[[1, 2]]))
    S = host.config.max_batch_size
    for value in (None, 5, 6):
        tokens = None if value is None else torch.full((S,), value)
        want = host.step(None if tokens is None else tokens.numpy(), bucket=(8, 8))
        _same(want, device.step(None if tokens is None else tokens.to(DEVICE), bucket=(8, 8)))
    tokens = torch.full((S,), 7)
    for b, t in ((host, tokens.numpy()), (device, tokens.to(DEVICE))):
        with pytest.raises(BatchError):
            b.step(t, **kw)
    _same(host.step(tokens.numpy(), bucket=(8, 8)), device.step(tokens.to(DEVICE), bucket=(8, 8)))
