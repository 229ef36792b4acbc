"""prepare_step cost: the generated llama module against a plain loop-by-loop implementation.

The plain implementation is tests/reference.py (the reference's setBufferSizes/setFromInputs,
one request and one beam at a time) plus what it takes to hand its lists to an engine: one
tensor per engine input and one host-to-device copy per device input, as the C++ reference and
most Python engines do. Both run in the same process on the same batches, interleaved round by round.

    python bench/prepare_step.py [--device cpu|cuda] [--repeats N] [--json PATH]

Prints the median and interquartile range of host microseconds per step for prepare_step and,
on decode cases, for advance() (the next decode step of the same requests), the ratio to the
plain implementation, the host-to-device copies per step and, on CUDA, the device allocations
per step; then the cost curve of decode steps for B = 1 ... 1024.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from reference import reference_step  # noqa: E402

from bufc.generated import llama, llama_flash  # noqa: E402
from bufc.runtime import Request  # noqa: E402

DEVICE_INPUTS = (
    "input_ids",
    "position_ids",
    "context_lengths",
    "sequence_length",
    "last_token_ids",
    "kv_cache_block_offsets",
)
HOST_INPUTS = ("host_context_lengths", "host_request_types", "host_past_key_value_lengths")


def decode(n: int, first_slot: int = 0) -> tuple[list, list]:
    gen = []
    for i in range(n):
        generated = 1 + i % 50
        # the blocks of its tokens plus room to grow (advance() reads a block when it is entered)
        blocks = list(range(64 * i, 64 * i + -(-(200 + generated + 400) // 64)))
        gen.append(
            Request(
                seq_slot=first_slot + i,
                prompt=[1] * 200,
                generated=[[7] * generated],
                kv_block_ids=[blocks],
            )
        )
    return [], gen


def mixed() -> tuple[list, list]:
    ctx = [
        Request(
            seq_slot=1000 + i,
            prompt=list(range(2048)),
            context_position=512,
            context_chunk_size=512,
            kv_block_ids=[list(range(5000 + 16 * i, 5000 + 16 * i + 16))],
        )
        for i in range(8)
    ]
    return ctx, decode(248)[1]


# The benchmarked configuration: a 7B-class Llama, up to 1024 requests and 8192 tokens, 64-token
# KV blocks (the same for every engine contract)
BENCH_CONFIG = dict(
    max_batch_size=1024,
    max_num_tokens=8192,
    vocab_size=32000,
    num_layers=32,
    max_attention_window=4096,
    tokens_per_block=64,
)


def bench_buffers(device: str, double_buffered: bool = True) -> llama.RuntimeBuffers:
    """The TensorRT-LLM contract (llama) at BENCH_CONFIG (`double_buffered`: the staging
    arena's two halves, the default)."""
    config = llama.Config(**BENCH_CONFIG)
    return llama.RuntimeBuffers(config, device=device, double_buffered=double_buffered)


def flash_buffers(device: str, double_buffered: bool = True) -> llama_flash.RuntimeBuffers:
    """The FlashAttention/vLLM contract (llama_flash) at BENCH_CONFIG."""
    config = llama_flash.Config(**BENCH_CONFIG)
    return llama_flash.RuntimeBuffers(config, device=device, double_buffered=double_buffered)


def plain(ctx, gen, config, device) -> int:
    """The plain implementation; returns its host-to-device copies."""
    want = reference_step(
        "gpt",
        ctx,
        gen,
        vocab_size=config.vocab_size,
        kv=(config.max_blocks_per_seq, config.num_local_layers),
    )
    for name in HOST_INPUTS:
        torch.tensor(want[name], dtype=torch.int32)
    for name in DEVICE_INPUTS:
        torch.tensor(want[name], dtype=torch.int32).to(device)
    return len(DEVICE_INPUTS)


def timed(fn, repeats: int) -> list[float]:
    for _ in range(3):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def interleaved(ours, adv, ref, repeats: int) -> tuple[list, list | None, list]:
    """Time the three in rounds (prepare_step, then advance after it, then every fourth round
    the plain implementation), so a noisy stretch of the machine hits all of them alike."""
    for _ in range(3):
        ours()
        if adv:
            adv()
        ref()
    t_ours: list[float] = []
    t_adv: list[float] = []
    t_ref: list[float] = []
    for i in range(repeats):
        t_ours.append(_once(ours))
        if adv:
            t_adv.append(_once(adv))
        if i % 4 == 0:
            t_ref.append(_once(ref))
    return t_ours, t_adv if adv else None, t_ref


def device_allocations(buffers, ctx, gen, tokens, steps: int = 50) -> float:
    """CUDA allocations per call of prepare_step (and advance, on decode cases), counted by
    the caching allocator over `steps` rounds of ours alone."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    for _ in range(steps):
        buffers.prepare_step(ctx, gen)
        if not ctx:
            buffers.advance(tokens)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    return (after - before) / (steps * (1 if ctx else 2))


def summary(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median_us": statistics.median(xs), "iqr_us": q[2] - q[0], "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    buffers = bench_buffers(args.device)
    config = buffers.config
    cuda = args.device.startswith("cuda")
    where = (
        f"{platform.processor() or platform.machine()}, {args.device}, torch {torch.__version__}"
    )
    print(f"prepare_step, host microseconds per step ({where}); {args.repeats} repeats, medians")
    head = (
        f"{'case':30} {'prepare_step':>12} {'IQR':>6} {'advance':>8} {'IQR':>6} {'plain':>8} "
        f"{'IQR':>6} {'ratio':>12} {'copies':>7} {'dev allocs':>10}"
    )
    print(head)
    rows: dict[str, dict] = {}
    cases = {
        "decode B=64": decode(64),
        "decode B=256": decode(256),
        "decode B=512": decode(512),
        "mixed 8x512 ctx + 248 decode": mixed(),
    }
    for name, (ctx, gen) in cases.items():
        tokens = np.full(len(gen), 7, dtype=np.int64)
        t_ours, t_adv, t_ref = interleaved(
            lambda ctx=ctx, gen=gen: buffers.prepare_step(ctx, gen),
            None if ctx else lambda tokens=tokens: buffers.advance(tokens),
            lambda ctx=ctx, gen=gen: plain(ctx, gen, config, args.device),
            args.repeats,
        )
        allocs = device_allocations(buffers, ctx, gen, tokens) if cuda else None
        copies = plain(ctx, gen, config, args.device)
        ours, ref = summary(t_ours), summary(t_ref)
        adv = summary(t_adv) if t_adv else None
        ratio = ref["median_us"] / ours["median_us"]
        ratio_adv = ref["median_us"] / adv["median_us"] if adv else None
        rows[name] = {
            "prepare_step": ours,
            "advance": adv,
            "plain": ref,
            "ratio": ratio,
            "ratio_advance": ratio_adv,
            "copies_bufc": buffers.copies_per_step,
            "copies_plain": copies,
            "device_allocations_per_step": allocs,
        }
        adv_text = f"{adv['median_us']:8.1f} {adv['iqr_us']:6.1f}" if adv else f"{'-':>8} {'':>6}"
        ratios = f"{ratio:4.1f}x" + (f" / {ratio_adv:4.1f}x" if adv else "")
        print(
            f"{name:30} {ours['median_us']:12.1f} {ours['iqr_us']:6.1f} {adv_text} {ref['median_us']:8.1f} "
            f"{ref['iqr_us']:6.1f} {ratios:>12} {buffers.copies_per_step:>3} vs {copies}"
            f" {'-' if allocs is None else f'{allocs:.2f}':>10}"
        )
    print("\ndecode cost curve, median us per step (and per sequence)")
    print(f"{'B':>7} {'prepare_step':>22} {'advance':>22}")
    curve = {}
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        ctx, gen = decode(b)
        full = summary(
            timed(
                lambda ctx=ctx, gen=gen: buffers.prepare_step(ctx, gen), max(20, args.repeats // 2)
            )
        )
        tokens = np.full(b, 7, dtype=np.int64)
        buffers.prepare_step(ctx, gen)
        adv = summary(
            timed(lambda tokens=tokens: buffers.advance(tokens), max(20, args.repeats // 2))
        )
        curve[b] = {"prepare_step": full, "advance": adv}
        print(
            f"{b:7d} {full['median_us']:12.1f} ({full['median_us'] / b:6.2f}) "
            f"{adv['median_us']:12.1f} ({adv['median_us'] / b:6.2f})"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"machine": where, "rows": rows, "curve": curve}, indent=2)
        )


if __name__ == "__main__":
    main()
