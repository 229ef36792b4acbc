"""The step built on the device (``build='device'``) beside the host build and the gather feeder,
in one run: host microseconds per ``step`` call (median and p99) and the device time of the
step's preparation (CUDA events around the call, measured in a second pass that waits for
each step), for ``llama_flash`` at B requests in flight with 0, 2 or 8 changes per step.

    python bench/device_build.py --device cuda --batches 64,256,1024 --changes 0,2,8

Traffic: B requests decode; each step `changes` of them finish and as many arrive in their
slots with a PROMPT-token prompt, run whole in their first step; every decoding request's KV
grows by a token, with a new block appended when it needs one. The tokens the last step
sampled are a tensor on the device (indexed by slot) for bufc's two builds, and a host array
for the feeder, which reads them on the host. The device build runs with `host_inputs=False`
(an engine under CUDA graphs reads no host input); the host build writes them. Both bufc builds run each step at the bucket
(B + changes x PROMPT tokens, B rows); the feeder pads nothing. Ratios are to the feeder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gather_flash import GatherFlash  # noqa: E402

from bufc.generated import llama_flash  # noqa: E402
from bufc.runtime import Request  # noqa: E402

REPLAYED: dict[tuple[int, int], tuple[int, int]] = {}  # graph replays of the device build's steps
PROMPT, TPB, HISTORY = 64, 16, 192  # prompt tokens, tokens per block, tokens decoded before


def config(batch: int, changes: int) -> llama_flash.Config:
    return llama_flash.Config(
        max_batch_size=batch,
        max_num_tokens=batch * (PROMPT + HISTORY + 1),  # the first step runs every history
        vocab_size=32000,
        num_layers=2,
        max_attention_window=2048,
        tokens_per_block=TPB,
        num_kv_blocks=batch * 2048 // TPB + 8,
    )


class Traffic:
    """The same calls for every feeder (see the module docstring)."""

    def __init__(self, batch: int, changes: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.batch, self.changes = batch, changes
        self.next_block = 0
        self.kv: dict[int, int] = {}  # KV tokens each slot holds after its next token
        self.lists: dict[int, int] = {}  # blocks each slot holds

    def blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def request(self, slot: int, generated: int) -> Request:
        prompt = [self.rng.randrange(32000) for _ in range(PROMPT + generated)]
        n = -(-(PROMPT + generated + 1) // TPB)
        self.lists[slot], self.kv[slot] = n, PROMPT + generated
        return Request(slot, prompt, kv_block_ids=[self.blocks(n)])

    def start(self) -> list[Request]:
        return [self.request(s, self.rng.randint(1, HISTORY)) for s in range(self.batch)]

    def step(self) -> tuple[list[int], list[Request], dict[int, list[int]]]:
        """This step's finishes, arrivals and appended blocks (for the decoding slots)."""
        slots = sorted(self.kv)
        done = self.rng.sample(slots, self.changes)
        arrived = [self.request(s, 0) for s in done]
        blocks = {}
        for s in slots:
            if s in done:
                continue
            self.kv[s] += 1
            if -(-(self.kv[s] + 1) // TPB) > self.lists[s]:
                self.lists[s] += 1
                blocks[s] = self.blocks(1)
        return done, arrived, blocks


def run(kind: str, batch: int, changes: int, steps: int, device: str, wait: bool) -> list[float]:
    """Host µs per step, or with `wait` the device µs of each step's own device work (CUDA
    events around it: the device build's copy and replay, the host build's copy and gather;
    a synchronisation after each step) for one feeder."""
    c = config(batch, changes)
    traffic = Traffic(batch, changes, seed=batch * 10 + changes)
    if kind == "feeder":
        b: Any = GatherFlash(c, device)
    elif kind == "device":  # an engine under CUDA graphs: no host input (host_inputs=False)
        c = dataclasses.replace(c, host_inputs=False)
        b = llama_flash.RuntimeBuffers(c, device, build="device")
    else:
        b = llama_flash.RuntimeBuffers(c, device)
    sampled = torch.randint(0, 32000, (batch,), device=device)
    host_sampled = sampled.cpu().numpy().astype(np.int64)
    bucket = (batch + changes * PROMPT, batch)
    for r in traffic.start():
        b.add(r)
    b.step()  # every prompt (the history) at once
    tokens = host_sampled if kind == "feeder" else sampled
    events: list[tuple[Any, Any]] = []
    if wait:  # events around the step's device work
        owner = b._device if kind == "device" else b
        name = "_launch" if kind == "device" else "_to_device"
        real = getattr(owner, name)

        def timed(*args: Any) -> None:
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            pair[0].record()
            real(*args)
            pair[1].record()
            events.append(pair)

        setattr(owner, name, timed)
    out = []
    for i in range(steps + 5):
        done, arrived, blocks = traffic.step()
        for s in done:
            b.finish(s)
        for r in arrived:
            b.add(r)
        t0 = time.perf_counter()
        if kind == "feeder":
            b.step(tokens, blocks=blocks)
        else:
            b.step(tokens, blocks=blocks, bucket=bucket)
        t = (time.perf_counter() - t0) * 1e6
        if wait:
            events[-1][1].synchronize()
            t = events[-1][0].elapsed_time(events[-1][1]) * 1e3
        if i >= 5:  # the first steps capture the buckets' graphs
            out.append(t)
    if kind == "device" and not wait:
        REPLAYED[batch, changes] = (b._device.replays.replayed, steps + 5)
    return out


def stages(batch: int, changes: int, steps: int, device: str) -> dict[str, float]:
    """Median host µs of each stage of the device build's step (timers around its methods)."""
    from bufc.runtime import device_build as build

    times: dict[str, list[float]] = {}
    real = {}

    def timed(owner: object, name: str, label: str) -> None:
        f = real[label] = getattr(owner, name)

        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                times.setdefault(label, []).append((time.perf_counter() - t0) * 1e6)

        setattr(owner, name, run)

    targets = [
        (build.request_step, "plan", "plan"),
        (llama_flash.RuntimeBuffers, "_check", "checks"),
        (build.DeviceBuild, "_pack", "delta"),
        (build.DeviceBuild, "_host_inputs", "host inputs"),
        (build.DeviceBuild, "_step", "views"),
        (build.DeviceBuild, "_launch", "copy + replay"),
        (build.DeviceBuild, "step", "step"),
    ]
    for owner, name, label in targets:
        timed(owner, name, label)
    try:
        run("device", batch, changes, steps, device, False)
    finally:
        for owner, name, label in targets:
            setattr(owner, name, real[label])
    return {k: statistics.median(v[5:]) for k, v in times.items()}


def _stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--changes", default="0,2,8")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json")
    ap.add_argument("--stages", action="store_true", help="the device build's stages alone")
    a = ap.parse_args()
    if a.stages:
        for batch in map(int, a.batches.split(",")):
            for changes in map(int, a.changes.split(",")):
                st = stages(batch, changes, a.steps, a.device)
                print(
                    f"B={batch} changes={changes}: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in st.items()),
                    flush=True,
                )
        return
    rows = []
    print(f"device: {torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'}")
    print(
        "B     chg  host µs median (p99): device build | host build | feeder   "
        "ratios to feeder   prep device µs (device build | host build)"
    )
    for batch in map(int, a.batches.split(",")):
        for changes in map(int, a.changes.split(",")):
            host = {
                k: run(k, batch, changes, a.steps, a.device, False)
                for k in ("device", "host", "feeder")
            }
            dev = (
                {
                    k: run(k, batch, changes, a.steps // 2, a.device, True)
                    for k in ("device", "host")
                }
                if a.device == "cuda"
                else {}
            )
            st = {k: _stats(v) for k, v in host.items()}
            row = {
                "batch": batch,
                "changes": changes,
                **{f"{k}_median_us": v[0] for k, v in st.items()},
                **{f"{k}_p99_us": v[1] for k, v in st.items()},
                **{f"{k}_prep_device_us": statistics.median(v) for k, v in dev.items()},
            }
            rows.append(row)
            f = st["feeder"][0]
            prep = " | ".join(f"{statistics.median(dev[k]):.0f}" for k in dev) or "-"
            print(
                f"{batch:<5} {changes:<4} "
                + " | ".join(f"{st[k][0]:.0f} ({st[k][1]:.0f})" for k in st)
                + f"   {st['device'][0] / f:.2f}x {st['host'][0] / f:.2f}x   {prep}",
                flush=True,
            )
    print(
        "device build steps replayed as graphs: "
        + ", ".join(f"B={b} {c}: {r}/{n}" for (b, c), (r, n) in REPLAYED.items())
    )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
