"""Function calls per in-flight step, bufc against the lean hand-written step, and bufc's
llama_flash module against the gather feeder (bench/churn.py's traffic and drivers): Python
functions and the C functions they call (numpy's included), as cProfile counts them.
Deterministic, unlike timings: on a small batch a step's time follows its call count, so this
shows what layers cost where timings are noise.

    python bench/call_counts.py [--steps N] [--batches 64,256,1024]

Prints, per case (B requests, 0, 1, 2 or 8 changes per step), the calls of bufc's finish + add +
step and of the lean step on the same events, and their ratio; then the same for bufc's
llama_flash module in flight and the gather feeder (bench/gather_flash.py).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from churn import InFlightDriver, Traffic  # noqa: E402
from gather_flash import GatherFlash  # noqa: E402
from lean_llama import LeanLlama  # noqa: E402
from prepare_step import bench_buffers, flash_buffers  # noqa: E402


def calls(batch: int, changes: int, steps: int) -> tuple[float, float, float, float]:
    """Calls per step (after 5 warm-up steps) of bufc's llama in-flight driver, of the lean
    step, of bufc's llama_flash in-flight driver and of the gather feeder, all on the same
    events."""
    traffic = Traffic(batch, changes, seed=batch * 10 + changes)
    buffers = bench_buffers("cpu")
    flash = flash_buffers("cpu")
    drivers = (
        InFlightDriver(buffers, lean=LeanLlama(buffers.config, "cpu")),
        InFlightDriver(flash, lean=GatherFlash(flash.config, "cpu")),
    )
    profiles = [cProfile.Profile() for _ in range(4)]
    for i in range(steps + 6):
        ctx, gen = traffic.step()
        if i == 0:
            for driver in drivers:
                driver.start(ctx, gen)
            continue
        runs = []
        for driver in drivers:
            events = driver.changes(ctx, gen)
            runs += [(driver.run, events), (driver.run_lean, events)]
        for profile, (run, events) in zip(profiles, runs):
            if i > 5:
                profile.enable()
            run(*events)
            profile.disable()
    ours, lean, ours_flash, feeder = (
        pstats.Stats(p).total_calls / steps  # type: ignore[attr-defined]
        for p in profiles
    )
    return ours, lean, ours_flash, feeder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batches", default="64,256,1024")
    args = ap.parse_args()
    print(
        f"{'case':24s} {'bufc':>8s} {'lean':>8s} {'ratio':>7s}   {'flash':>8s} {'feeder':>8s} "
        f"{'ratio':>7s}"
    )
    for batch in map(int, args.batches.split(",")):
        for changes in (0, 1, 2, 8):
            ours, lean, flash, feeder = calls(batch, changes, args.steps)
            case = f"B={batch}, " + (f"{changes} changes" if changes else "steady")
            print(
                f"{case:24s} {ours:8.1f} {lean:8.1f} {ours / lean:6.2f}x   {flash:8.1f} "
                f"{feeder:8.1f} {flash / feeder:6.2f}x"
            )


if __name__ == "__main__":
    main()
