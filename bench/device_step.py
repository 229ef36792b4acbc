"""The host's cost of a steady in-flight decode step, the sampled tokens on the host against
the same tokens as a tensor on the buffers' device (gathered there, the step's device work
replayed as CUDA graphs), measured in one run on the same batch, interleaved.

    python bench/device_step.py [--device cuda] [--steps N] [--profile B] [--json PATH]

Prints, for B = 64, 256 and 1024 decoding requests, the median host microseconds of `step`
with host tokens and with device tokens, their difference, and the graphs replayed. With
`--profile B` it then prints cProfile's top functions of the device-token step at that B.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prepare_step import bench_buffers  # noqa: E402

from bufc.runtime import Request  # noqa: E402

TPB = 64  # tokens per KV block (bench_buffers)


def decoding(device: str, batch: int, on_device: bool, steps: int):
    """Buffers whose `batch` requests have run their 4-token prompts, each with the KV
    blocks of `steps` more tokens: the next steps are steady."""
    c = bench_buffers("cpu").config
    b = type(bench_buffers("cpu"))(c, device=device, device_tokens=on_device)
    n = -(-(4 + steps) // TPB)
    for s in range(batch):
        b.add(Request(s, [1, 2, 3, 4], kv_block_ids=[[n * s + k for k in range(n)]]))
    b.step()
    return b


def tokens_for(b, on_device: bool):
    t = torch.full((b.config.max_batch_size,), 7, dtype=torch.int64)
    return t.to(b.device) if on_device else t.numpy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    where = (
        f"{platform.processor() or platform.machine()}, {args.device}, torch {torch.__version__}"
    )
    print(f"steady in-flight step, host microseconds ({where}); {args.steps} steps, medians")
    print(f"{'B':>6} {'host tokens':>12} {'device tokens':>14} {'difference':>11} {'replayed':>9}")
    rows = {}
    for batch in (64, 256, 1024):
        pair = [decoding(args.device, batch, d, args.steps + 4) for d in (False, True)]
        tokens = [tokens_for(b, d) for b, d in zip(pair, (False, True))]
        times: list[list[float]] = [[], []]
        for i in range(args.steps + 4):
            for k, (b, t) in enumerate(zip(pair, tokens)):
                t0 = time.perf_counter()
                b.step(t)
                dt = (time.perf_counter() - t0) * 1e6
                if i >= 4:
                    times[k].append(dt)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()  # the steps of one pair start alike
        host, dev = (statistics.median(x) for x in times)
        replayed = pair[1]._replays.replayed
        rows[batch] = {"host_us": host, "device_us": dev, "replayed": replayed}
        print(f"{batch:6} {host:12.1f} {dev:14.1f} {dev - host:+11.1f} {replayed:9}")
    if args.profile:
        b = decoding(args.device, args.profile, True, args.steps + 8)
        t = tokens_for(b, True)
        for _ in range(8):
            b.step(t)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            b.step(t)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": where, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
