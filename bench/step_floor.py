"""Where the steady in-flight step's time goes: bufc's `step(tokens, blocks=...)` against the
lean hand-written step (bench/lean_llama.py) on the same decoding batch, with parts of bufc's
work replaced by no-ops, to separate the rules' work from the layers around it.

    python bench/step_floor.py [--batches 64,256,1024] [--steps N] [--rounds R] [--json PATH]

Variants (each a fresh pair of buffers and lean step on the same traffic; the order of the
variants alternates between rounds, and the medians pool the rounds):
- `full`: bufc as it is;
- `no KV`: the KV rows' decode check and advance form do nothing;
- `no +1`: the token and +1 advance forms do nothing;
- `no copy`: the host-to-device copy does nothing;
- `skeleton`: all three: what remains is the request layer's plan (token gather and check, the
  block appends), the generated program's calls and the runtime around them.

The values written in the no-op variants are wrong; only the times mean something. Prints, per
B and variant, the medians (µs) of bufc's step and of the lean step (which does all its work
in every variant) and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from churn import InFlightDriver, Traffic  # noqa: E402
from lean_llama import LeanLlama  # noqa: E402
from prepare_step import bench_buffers  # noqa: E402

from bufc.rules import core, kv_offsets  # noqa: E402
from bufc.runtime import staging  # noqa: E402

VARIANTS = ("full", "no KV", "no +1", "no copy", "skeleton")


def _no_kv_advance(out, prev, d, entered, *, max_blocks_per_seq, **_):
    return len(d.tokens) * 2 * max_blocks_per_seq


def _no_kv_check(d, kept, **_):
    return None


def _count_only(out, prev, d):
    return len(d.tokens)


def _no_copy(self, half, span):
    return None


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The variant's no-ops in place for the duration (the generated modules call the rule
    functions through `core`, and the staging's copy through its class)."""
    patches = []
    if name in ("no KV", "skeleton"):
        patches += [
            (kv_offsets, "advance_kv", _no_kv_advance),
            (kv_offsets, "check_kv_entered", _no_kv_check),
        ]
    if name in ("no +1", "skeleton"):
        patches += [(core, "advance_plus_one", _count_only), (core, "advance_tokens", _count_only)]
    if name in ("no copy", "skeleton"):
        patches += [(staging.Staging, "copy", _no_copy)]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for owner, attr, fn in patches:
        setattr(owner, attr, fn)
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def measure(batch: int, steps: int, name: str) -> tuple[list[float], list[float]]:
    """bufc's and the lean step's times of `steps` steady steps of `batch` requests (the lean
    step runs the same events right after bufc's)."""
    traffic = Traffic(batch, 0, seed=batch)
    buffers = bench_buffers("cpu")
    lean = LeanLlama(buffers.config, "cpu")
    driver = InFlightDriver(buffers, lean=lean)
    ctx, gen = traffic.step()
    driver.start(ctx, gen)  # untimed, with every rule's real work
    ours: list[float] = []
    theirs: list[float] = []
    with variant(name):
        for i in range(steps + 5):
            ctx, gen = traffic.step()
            _, _, tokens, blocks = driver.changes(ctx, gen)
            t0 = time.perf_counter()
            buffers.step(tokens, blocks=blocks)
            t1 = time.perf_counter()
            lean.step(tokens, blocks=blocks)
            t2 = time.perf_counter()
            if i >= 5:  # warm-up
                ours.append((t1 - t0) * 1e6)
                theirs.append((t2 - t1) * 1e6)
    return ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"step_floor: steady in-flight step, host microseconds ({platform.machine()}, "
        f"torch {torch.__version__}); {args.steps} steps x {args.rounds} rounds, medians"
    )
    print(f"{'B':>5} {'variant':10} {'bufc':>8} {'lean':>8} {'bufc/lean':>10}")
    results = {}
    for batch in batches:
        times: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in VARIANTS}
        for r in range(args.rounds):
            for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                ours, theirs = measure(batch, args.steps, name)
                times[name][0].extend(ours)
                times[name][1].extend(theirs)
        for name in VARIANTS:
            ours_m = statistics.median(times[name][0])
            lean_m = statistics.median(times[name][1])
            results[f"B={batch}, {name}"] = {"bufc_us": ours_m, "lean_us": lean_m}
            print(f"{batch:5d} {name:10} {ours_m:8.1f} {lean_m:8.1f} {ours_m / lean_m:9.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
