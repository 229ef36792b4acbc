"""Sampled tokens as a tensor on the buffers' device (here the CPU, with ``device_tokens``):
token dtypes are checked before a byte is written, and a device step is all or nothing, so
whatever raises, the next good step equals that of twin buffers that never saw the failure."""

from __future__ import annotations

import importlib
import pathlib

import numpy as np
import pytest
import torch
import yaml
from fuzz_configs import make_buffers

from bufc.runtime import BatchError, Request
from bufc.runtime.staging import Staging
from bufc.runtime.tokens import TokenGather
from bufc.runtime.transfer import Transfer

ROOT = pathlib.Path(__file__).resolve().parent.parent
SLOTS = (0, 1)
# the CPU emulates the device path; on CUDA the same tests run there (by hand on the H200)
DEVICES = pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ),
    ],
)


def _start(b) -> None:
    """Two requests whose 3-token prompts are computed: the next step decodes."""
    paged = "host_kv_cache_block_offsets" in b.decls
    for slot in SLOTS:
        blocks = {"kv_block_ids": [[3 * slot + 1, 3 * slot + 2, 3 * slot + 3]]} if paged else {}
        b.add(Request(seq_slot=slot, prompt=[5, 6, 7], **blocks))
    b.step()


def _tokens(b, value: int = 9, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.full((b.config.max_batch_size,), value, dtype=dtype, device=b.device)


def _same(b, twin) -> list[str]:
    got, want = b.tensors, twin.tensors
    return [n for n in got if not torch.equal(got[n], want[n])]


def _pair(name: str, device: str = "cpu", **overrides):
    b = make_buffers(name, device, device_tokens=True, max_beam_width=1, **overrides)
    twin = make_buffers(name, device, device_tokens=True, max_beam_width=1, **overrides)
    for x in (b, twin):
        _start(x)
    return b, twin


# ---------------------------------------------------------------------------- token dtypes
NARROW = [(torch.int8, 1000), (torch.uint8, 1000), (torch.int16, 40000)]


@pytest.mark.parametrize("on_device", (True, False), ids=("device", "host"))
@pytest.mark.parametrize(("dtype", "vocab"), NARROW, ids=lambda x: str(x))
@DEVICES
def test_a_token_dtype_that_cannot_hold_every_id_is_refused(
    dtype, vocab, on_device, device
) -> None:
    """int8, uint8, int16 below the vocabulary would wrap (1000 is -24 in int8): refused,
    naming the dtype, on the device and as a host array, and nothing changes."""
    b, twin = _pair("llama", device, vocab_size=vocab)
    tokens = _tokens(b, 5, dtype)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(
        BatchError,
        match=rf"step\(\): {name} tokens cannot hold every token id 0 \.\. {vocab - 1} "
        rf"\(vocab_size={vocab}\); pass int32 or int64 tokens",
    ):
        b.step(tokens if on_device else tokens.cpu().numpy())
    for x in (b, twin):
        x.step(_tokens(x, 5))
    assert b.step(_tokens(b, 6)).inputs["input_ids"].tolist() == [6, 6]
    twin.step(_tokens(twin, 6))
    assert _same(b, twin) == []


@pytest.mark.parametrize("dtype", (torch.uint16, torch.uint32, torch.uint64), ids=str)
@DEVICES
def test_an_unsigned_dtype_torch_cannot_gather_is_refused_on_the_device(dtype, device) -> None:
    """uint16/32/64 pass for integers but index_select has no kernel for them: refused before
    the step (it used to fail half-way, every later position one too high)."""
    b, twin = _pair("llama", device)
    name = str(dtype).removeprefix("torch.")
    for _ in range(2):  # a full step, then a steady one
        with pytest.raises(
            BatchError, match=rf"torch cannot gather {name} tensors on the device; pass int32"
        ):
            b.step(_tokens(b, 5, dtype))
        for x in (b, twin):
            x.step(_tokens(x, 5))
        assert _same(b, twin) == []


@pytest.mark.parametrize(
    ("dtype", "vocab"), [(torch.int16, 1000), (torch.uint8, 200), (torch.int32, 40000)], ids=str
)
@DEVICES
def test_a_narrow_dtype_that_holds_every_id_gives_the_same_tokens(dtype, vocab, device) -> None:
    """A dtype that holds the whole vocabulary is gathered and checked in int64: the tokens
    equal those of int64 tokens (the limit 1000 in int16 no longer wraps anything)."""
    b, twin = _pair("llama", device, vocab_size=vocab)
    for value in (vocab - 1, 3, 0):
        got = b.step(_tokens(b, value, dtype)).inputs["input_ids"].tolist()
        twin.step(_tokens(twin, value))
        assert got == [value, value]
        assert _same(b, twin) == []


def test_host_token_arrays_follow_the_same_rule() -> None:
    """numpy tokens: a dtype below the vocabulary is refused; uint16 above it is read."""
    b, twin = make_buffers("llama", max_beam_width=1), make_buffers("llama", max_beam_width=1)
    for x in (b, twin):
        _start(x)
    with pytest.raises(BatchError, match=r"int8 tokens cannot hold every token id 0 \.\. 999"):
        b.step(np.full(b.config.max_batch_size, 5, np.int8))
    b.step(np.full(b.config.max_batch_size, 5, np.uint16))
    twin.step(np.full(twin.config.max_batch_size, 5, np.int64))
    assert _same(b, twin) == []
    with pytest.raises(BatchError, match=r"advance\(\): uint8 tokens cannot hold every token"):
        g = make_buffers("gpt")
        g.prepare_step([], [Request(seq_slot=0, prompt=[1, 2], generated=[[3]])])
        g.advance(np.zeros(1, np.uint8))


# ------------------------------------------------------------------- a failed device step
def _device_forms() -> list[tuple[str, str]]:
    """(family, module:function) for every device advance form of the rule contract, each
    with a family whose generated module calls it."""
    contract = yaml.safe_load((ROOT / "rules" / "builtin.yaml").read_text())
    forms = sorted(
        {r["device_advance"] for r in contract["rules"].values() if "device_advance" in r}
    )
    out = []
    for form in forms:
        function = form.rsplit(":", 1)[1]
        family = next(
            name
            for name in ("llama", "glm", "gpt")
            if f".{function}(" in (ROOT / "generated" / f"{name}.py").read_text()
        )
        out.append((family, form))
    return out


class Injected(RuntimeError):
    pass


def _raising_after(original):
    """`original`, raising the first time after it did its writes (the worst case)."""
    calls = []

    def wrapper(*args, **kwargs):
        original(*args, **kwargs)
        if not calls:
            calls.append(1)
            raise Injected("injected")

    return wrapper


FORMS = _device_forms()


def test_the_contract_has_device_forms() -> None:
    assert len(FORMS) >= 2, FORMS


FAILURES = [(f"form {f}", True) for _, f in FORMS] + [
    (where, steady)
    for where in ("load", "gather", "write", "send_back", "copy up")
    for steady in (True, False)
]


@pytest.mark.parametrize(
    ("where", "steady"), FAILURES, ids=[f"{w}-{'steady' if s else 'full'}" for w, s in FAILURES]
)
@DEVICES
def test_a_failed_device_step_leaves_the_last_step_current(
    where, steady, device, monkeypatch
) -> None:
    """An exception from each device advance form (a steady step), the gather, the token
    write or a copy up (a steady or a full step), after it did its writes: a BatchError, and
    the next good steps equal those of twin buffers that never saw the failed call, tensor for
    tensor."""
    family = next((fam for fam, f in FORMS if where == f"form {f}"), "llama")
    b, twin = _pair(family, device)
    for x in (b, twin):
        x.step(_tokens(x, 9))  # a full step: the prompts' first tokens
        if not steady:
            x.finish(1)  # the next step is a full one again
    if where.startswith("form "):
        module, function = where.removeprefix("form ").split(":")
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, function, _raising_after(getattr(mod, function)))
    elif where == "copy up":  # the step's one copy, or a steady step's block table
        owner, name = (Transfer, "_copy_member") if steady else (Staging, "copy")
        monkeypatch.setattr(owner, name, _raising_after(getattr(owner, name)))
    else:
        monkeypatch.setattr(TokenGather, where, _raising_after(getattr(TokenGather, where)))
    with pytest.raises(BatchError, match=r"device work failed \(Injected: injected\)"):
        b.step(_tokens(b, 4))
    monkeypatch.undo()
    for value in (4, 11):
        for x in (b, twin):
            x.step(_tokens(x, value))
        assert _same(b, twin) == [], where
