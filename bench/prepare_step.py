"""prepare_step cost: the generated gpt module against the loop-by-loop reference, one run.

Usage: python bench/prepare_step.py [--device cpu|cuda] [--repeats N] [--json PATH]
Reports the median and interquartile range in microseconds per step, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from reference import reference_step  # noqa: E402

from bufc.generated import gpt  # noqa: E402
from bufc.runtime import Request  # noqa: E402


def decode(n: int) -> tuple[list, list]:
    return [], [
        Request(seq_slot=i, prompt=[1] * 200, generated=[[7] * (1 + i % 50)]) for i in range(n)
    ]


def mixed() -> tuple[list, list]:
    ctx = [
        Request(seq_slot=i, prompt=list(range(2048)), context_position=512, context_chunk_size=512)
        for i in range(8)
    ]
    return ctx, decode(256)[1][8:]


def timed(fn, repeats: int) -> list[float]:
    for _ in range(5):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def summary(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4)
    return {"median_us": statistics.median(xs), "iqr_us": q[2] - q[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    config = gpt.Config(
        max_batch_size=512,
        max_num_tokens=8192,
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        max_attention_window=4096,
    )
    buffers = gpt.RuntimeBuffers(config, device=args.device)
    cases = {
        "decode B=64": decode(64),
        "decode B=256": decode(256),
        "decode B=512": decode(512),
        "mixed 8x512 ctx + 248 decode": mixed(),
    }
    rows = {}
    print(
        f"device {args.device}, torch {torch.__version__}, {args.repeats} repeats; microseconds per step"
    )
    print(f"{'case':32} {'bufc median':>12} {'(IQR)':>8} {'reference':>10} {'ratio':>7}")
    for name, (ctx, gen) in cases.items():
        ours = summary(timed(lambda ctx=ctx, gen=gen: buffers.prepare_step(ctx, gen), args.repeats))
        ref = summary(
            timed(
                lambda ctx=ctx, gen=gen: reference_step("gpt", ctx, gen, vocab_size=32000),
                max(20, args.repeats // 4),
            )
        )
        ratio = ref["median_us"] / ours["median_us"]
        rows[name] = {"bufc": ours, "reference_loop": ref, "ratio": ratio}
        print(
            f"{name:32} {ours['median_us']:12.1f} {ours['iqr_us']:8.1f} {ref['median_us']:10.1f} {ratio:6.1f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
