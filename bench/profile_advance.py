"""Profile advance() on a device: where the host time of a decode step goes.

python bench/profile_advance.py [--device cuda] [--batch 256]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prepare_step import bench_buffers, decode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    buffers = bench_buffers(args.device)
    ctx, gen = decode(args.batch)
    tokens = np.full(args.batch, 7, dtype=np.int64)
    buffers.prepare_step(ctx, gen)
    for _ in range(20):
        buffers.advance(tokens)
    t0 = time.perf_counter()
    for _ in range(200):
        buffers.advance(tokens)
    print(
        f"advance B={args.batch} on {args.device}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us mean"
    )
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(150):
        buffers.advance(tokens)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
