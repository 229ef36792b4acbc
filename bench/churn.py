"""prepare_step under serving traffic: the batch changes every step (requests finish, new ones
arrive as 512-token prompts, the rest decode one more token and their KV block lists grow).

Five implementations prepare the same llama step, timed in the same loop on the same batch:
- bufc's `prepare_step` (the generated module, stateless: it reads every request);
- bufc's requests in flight: `finish` for the requests that left, `add` for those that arrived,
  and `step(tokens, blocks=...)` with the sampled tokens (indexed by seq slot) and the KV
  blocks added (what an engine loop hands it; derived from the traffic outside the timing);
- the lean in-flight step (bench/lean_llama.py): a hand-written implementation of the same
  in-flight step for this one family, driven by exactly the same events as bufc's (the same
  finished slots, arrived requests, tokens array and block dict, interleaved with bufc's step
  in alternating order): persistent per-slot numpy state with the block rows kept encoded,
  bufc's condensed row order, +1 in place on decode and only the changed rows patched,
  vectorised checks, one pinned arena and one host-to-device copy of its used prefix. On the
  first steps of every case (CHECK_STEPS, and the start-up), every tensor it writes is compared
  with bufc's at the step's shapes, outside the timing; a difference raises;
- the floor: a minimal hand-written numpy fill of the step's tensors (the ones bufc writes for
  this family at these sizes) that re-reads every request, plus one pinned host-to-device copy;
- the loop-by-loop reference (tests/reference.py) with one tensor and copy per input.

Beside them, the FlashAttention/vLLM contract: bufc's llama_flash module in flight (the same
events, the buffers of prepare_step.flash_buffers) against the gather feeder
(bench/gather_flash.py), a hand-written vLLM-V1-style step for that contract (persistent
per-slot rows, a row -> slot map and a few vectorised gathers per step, one staging buffer and
one copy per device input), interleaved in alternating order like bufc and lean, and compared
tensor by tensor on the start-up and the first CHECK_STEPS steps.

    python bench/churn.py [--device cpu|cuda] [--steps N] [--batches 64,256,1024] [--busy K]
                          [--json PATH]

Prints medians of host microseconds per step and the ratios bufc / floor and reference / bufc,
for B = 64, 256, 1024 requests with 1, 2 and 8 changes per step (and 4 at B = 1024), the steady
case (no change: prepare_step and advance) and the mixed case of bench/prepare_step.py. The
in-flight row of each churn and steady case adds the lean median and the ratio bufc in flight /
lean (the columns `lean` and `flight/lean`); the line `llama_flash in flight / gather feeder`
gives the medians of bufc's llama_flash in flight and of the feeder, and their ratio. With
`--busy K`, every case runs again with K busy processes beside it (a loaded host), and the
table adds bufc's median and worst step under load, as ratios to its quiet median.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import platform
import random
import statistics
import sys
import time
from itertools import chain
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gather_flash import GatherFlash  # noqa: E402
from lean_llama import LeanLlama  # noqa: E402
from prepare_step import bench_buffers, flash_buffers, mixed, plain  # noqa: E402

from bufc.runtime import Constant, Mirror, Request, Rule  # noqa: E402

PROMPT = 512
TPB = 64  # tokens per KV block (bench_buffers)
CHECK_STEPS = 5  # the first steps of every case whose tensors lean and bufc must agree on
Beside = LeanLlama | GatherFlash  # a hand-written step driven beside bufc's


class Traffic:
    """B requests in flight; each step `changes` of the decoding ones finish and as many new
    ones arrive with a whole 512-token prompt (their slots reused), last step's arrivals
    decode from now on, and every decoding request gets its sampled token and, when it needs
    one, a new KV block."""

    def __init__(self, batch: int, changes: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.changes = changes
        self.next_block = 0
        self.gen: list[Request] = [
            self._request(i, generated=self.rng.randint(1, 200)) for i in range(batch)
        ]
        self.ctx: list[Request] = []

    def _blocks(self, tokens: int) -> list[int]:
        n = -(-tokens // TPB)
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def _request(self, slot: int, generated: int = 0) -> Request:
        prompt = [self.rng.randrange(32000) for _ in range(PROMPT)]
        r = Request(seq_slot=slot, prompt=prompt, generated=[[7] * generated] if generated else ())
        r.kv_block_ids = [self._blocks(PROMPT + generated + 1)]
        return r

    def step(self) -> tuple[list, list]:
        for r in self.ctx:  # last step's prompts now decode
            r.generated = [[7]]
        self.gen += self.ctx
        self.ctx = []
        for _ in range(self.changes):
            done = self.gen.pop(self.rng.randrange(len(self.gen)))
            self.ctx.append(self._request(done.seq_slot))
        for r in self.gen:
            r.generated[0].append(self.rng.randrange(32000))
            need = -(-(PROMPT + len(r.generated[0]) + 1) // TPB)
            blocks = r.kv_block_ids[0]
            if len(blocks) < need:
                blocks.extend(self._blocks(TPB))
        return self.ctx, self.gen


class Floor:
    """A minimal hand-written numpy fill of the llama step (input ids, positions, context and
    sequence lengths, request types, past-KV lengths, last-token ids, KV block rows, slots)
    into one pinned buffer, and one host-to-device copy of its used part."""

    def __init__(self, config, device: str) -> None:
        self.width, self.layers = config.max_blocks_per_seq, config.num_local_layers
        n, s = config.max_num_tokens, config.max_num_sequences
        self.size = 3 * n + 5 * s + s * 2 * self.width + config.max_batch_size
        pin = device.startswith("cuda")
        self.host = torch.zeros(self.size, dtype=torch.int32, pin_memory=pin)
        self.arena = self.host.numpy()
        self.device = torch.zeros(self.size, dtype=torch.int32, device=device)

    def __call__(self, ctx: list, gen: list) -> None:
        a, nc = self.arena, len(ctx)
        chunks = [r.prompt for r in ctx]
        ctx_len = np.fromiter(map(len, chunks), np.int64, nc)
        gen_prompt = np.fromiter((len(r.prompt) for r in gen), np.int64, len(gen))
        gen_len = gen_prompt + np.fromiter((len(r.generated[0]) for r in gen), np.int64, len(gen))
        last = np.fromiter((r.generated[0][-1] for r in gen), np.int64, len(gen))
        n_tok = int(ctx_len.sum()) + len(gen)
        s = nc + len(gen)
        o = 0
        ids = a[o : o + n_tok]
        ids[: n_tok - len(gen)] = np.concatenate(chunks) if chunks else []
        ids[n_tok - len(gen) :] = last
        o += n_tok
        pos = a[o : o + n_tok]
        starts = np.repeat(np.cumsum(ctx_len) - ctx_len, ctx_len)
        pos[: n_tok - len(gen)] = np.arange(n_tok - len(gen)) - starts
        pos[n_tok - len(gen) :] = gen_len - 1
        o += n_tok
        for values in (
            np.concatenate((ctx_len, gen_prompt)),  # context lengths
            np.concatenate((ctx_len, gen_len)),  # sequence lengths
            np.concatenate((np.zeros(nc), np.ones(len(gen)))),  # request types
            np.concatenate((ctx_len, gen_len - 1)),  # past KV lengths
            np.cumsum(np.concatenate((ctx_len, np.ones(len(gen), np.int64)))),  # last tokens
            [r.seq_slot for r in ctx] + [r.seq_slot for r in gen],  # slots
        ):
            a[o : o + s] = values
            o += s
        rows = a[o : o + s * 2 * self.width].reshape(s, 2, self.width)
        lists = [r.kv_block_ids[0] for r in ctx] + [r.kv_block_ids[0] for r in gen]
        lens = np.fromiter(map(len, lists), np.int64, s)
        flat = np.fromiter(chain.from_iterable(lists), np.int64, int(lens.sum()))
        seq = np.repeat(np.arange(s), lens)
        col = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
        rows[:] = 0
        rows[seq, 0, col] = flat * (2 * self.layers)
        rows[seq, 1, col] = flat * (2 * self.layers) + 1
        o += rows.size
        self.device[:o].copy_(self.host[:o], non_blocking=True)


class InFlightDriver:
    """The same traffic as the engine loop of the in-flight API sees it: the requests that
    finished, those that arrived, the sampled tokens (indexed by seq slot) and the KV blocks
    added per slot. Derived from consecutive steps of a Traffic outside the timed region;
    `run` is the timed part (finish, add, step). `on_device`: the tokens are handed over as a
    tensor on the buffers' device (gathered there). `lean`: a hand-written step driven by the
    same events (`run_lean`), its start-up included: a LeanLlama beside llama buffers, a
    GatherFlash beside llama_flash buffers."""

    def __init__(self, buffers, on_device: bool = False, lean: Beside | None = None) -> None:
        self.buffers = buffers
        self.lean = lean
        self.tokens = np.zeros(buffers.config.max_batch_size, np.int64)
        self.on_device = (
            torch.zeros(len(self.tokens), dtype=torch.int64, device=buffers.device)
            if on_device
            else None
        )
        self.known: dict[int, tuple[Request, int]] = {}  # slot -> (request, blocks it knows)
        self.leaving: list[Request] = []

    def changes(self, ctx: list, gen: list) -> tuple:
        now = {r.seq_slot: r for r in chain(ctx, gen)}
        finished = [s for s, (r, _) in self.known.items() if now.get(s) is not r]
        # the engine holds a finished request past finish() (it returns its output), so its
        # memory is not freed inside the timed step (a 512-token prompt list costs ~10 us)
        self.leaving = [self.known.pop(s)[0] for s in finished]
        blocks, arrived = {}, list(ctx)
        for r in gen:
            held = self.known[r.seq_slot][1]
            have = len(r.kv_block_ids[0])
            if have > held:
                blocks[r.seq_slot] = r.kv_block_ids[0][held:]
            self.known[r.seq_slot] = (r, have)
            self.tokens[r.seq_slot] = r.generated[0][-1]
        for r in ctx:
            self.known[r.seq_slot] = (r, len(r.kv_block_ids[0]))
        return finished, arrived, (self._tokens() if gen else None), blocks

    def _tokens(self):
        if self.on_device is None:
            return self.tokens
        self.on_device.copy_(torch.from_numpy(self.tokens))  # untimed: what the sampler leaves
        return self.on_device

    def start(self, ctx: list, gen: list):
        """Untimed: the traffic's first requests arrive (as prompts, with two blocks to spare:
        their sequences start shorter than the traffic's) and run their context in chunks of
        the step's token budget; the lean step, if any, gets the same calls. Returns bufc's
        last step."""
        targets = [self.buffers] + ([self.lean] if self.lean is not None else [])
        for r in chain(ctx, gen):
            blocks = [list(r.kv_block_ids[0]) + [0, 0]]
            for b in targets:
                b.add(Request(r.seq_slot, r.prompt, kv_block_ids=blocks))
            self.known[r.seq_slot] = (r, len(r.kv_block_ids[0]))
        waiting = [r.seq_slot for r in chain(ctx, gen)]
        per_step = (self.buffers.config.max_num_tokens - len(waiting)) // PROMPT
        tokens = None
        while waiting:
            chunks = {s: PROMPT for s in waiting[:per_step]}
            for b in targets:
                b.step(tokens, chunks=chunks)
            waiting, tokens = waiting[per_step:], self._tokens()
        if self.lean is not None:
            self.lean.step(tokens)
        return self.buffers.step(tokens)

    def run(self, finished: list, arrived: list, tokens, blocks: dict):
        b = self.buffers
        for slot in finished:
            b.finish(slot)
        for r in arrived:
            b.add(r)
        return b.step(tokens, blocks=blocks)

    def run_lean(self, finished: list, arrived: list, tokens, blocks: dict) -> None:
        lean = self.lean
        assert lean is not None
        for slot in finished:
            lean.finish(slot)
        for r in arrived:
            lean.add(r)
        lean.step(tokens, blocks=blocks)


def check_lean(buffers, step, lean: Beside, where: str) -> None:
    """Every tensor bufc's module writes (its rule, mirror and constant tensors) at the step's
    shapes, against the hand-written step's (`lean`: a LeanLlama or a GatherFlash): the same
    names, shapes, dtypes and values, or AssertionError (untimed)."""
    c = buffers.config
    label = "lean" if isinstance(lean, LeanLlama) else "the feeder"
    written = [n for n, d in buffers.decls.items() if isinstance(d.fill, (Rule, Mirror, Constant))]
    ours, theirs = buffers.tensors, lean.tensors()
    if set(written) != set(theirs):
        raise AssertionError(
            f"{where}: bufc writes {sorted(set(written) - set(theirs))} that {label} does not, "
            f"{label} writes {sorted(set(theirs) - set(written))} that bufc does not"
        )
    for name in written:
        shape = tuple(buffers.decls[name].shape(c, step.sizes))
        want = ours[name].reshape(-1)[: math.prod(shape)].view(shape).cpu()
        got = theirs[name].cpu()
        if got.shape != want.shape or got.dtype != want.dtype:
            raise AssertionError(
                f"{where}: {name}: bufc {want.dtype} {list(want.shape)}, "
                f"{label} {got.dtype} {list(got.shape)}"
            )
        if not torch.equal(got, want):
            diff = (got != want).nonzero()
            first = tuple(diff[0].tolist())
            raise AssertionError(
                f"{where}: {name} differs at {len(diff)} of {want.numel()} elements; first at "
                f"{list(first)}: bufc {want[first].item()}, {label} {got[first].item()}"
            )


def _time(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e6


def churn_case(buffers, floor, device: str, batch: int, changes: int, steps: int) -> dict:
    traffic = Traffic(batch, changes, seed=batch * 10 + changes)
    drivers = _drivers(device)
    flash = _flash_driver(device)
    ours, low, ref = [], [], []
    flight: list[list[float]] = [[] for _ in drivers]
    lean: list[list[float]] = [[] for _ in drivers]
    t_flash: list[tuple[float, float]] = []
    where = f"B={batch}, {changes} changes"
    for i in range(steps + 3):
        ctx, gen = traffic.step()
        t_ours = _time(buffers.prepare_step, ctx, gen)
        t_flight = [_drive(d, i, ctx, gen, where) for d in drivers]
        t_pair = _drive(flash, i, ctx, gen, f"{where}, llama_flash")
        t_low = _time(floor, ctx, gen)
        t_ref = _time(plain, ctx, gen, buffers.config, device) if i % 8 == 3 else None
        if i >= 3:  # warm-up
            ours.append(t_ours)
            for times, lean_times, (t, t_lean) in zip(flight, lean, t_flight):
                times.append(t)
                lean_times.append(t_lean)
            low.append(t_low)
            t_flash.append(t_pair)
            if t_ref is not None:
                ref.append(t_ref)
    return _with_flash(_with_flight(_row(ours, low, ref), flight, lean), t_flash)


def _drivers(device: str) -> list[InFlightDriver]:
    """The in-flight drivers of a case: host tokens (with the lean step beside it), the same
    with one staging half (double_buffered=False, with a lean step of its own beside it), and
    on CUDA tokens on the device."""
    drivers = [
        InFlightDriver(buffers, lean=LeanLlama(buffers.config, device))
        for buffers in (bench_buffers(device), bench_buffers(device, double_buffered=False))
    ]
    if device.startswith("cuda"):
        drivers.append(InFlightDriver(bench_buffers(device), on_device=True))
    return drivers


def _flash_driver(device: str) -> InFlightDriver:
    """bufc's llama_flash module in flight (host tokens) with the gather feeder beside it."""
    buffers = flash_buffers(device)
    return InFlightDriver(buffers, lean=GatherFlash(buffers.config, device))


def _drive(
    driver: InFlightDriver, i: int, ctx: list, gen: list, where: str = ""
) -> tuple[float, float]:
    """Step i of a case through the driver: bufc's in-flight time and, with a lean step, its
    time on the same events (the two in alternating order; 0.0 without one). Step 0 is the
    untimed start-up. On the start-up and the first CHECK_STEPS steps the lean step's tensors
    are compared with bufc's."""
    lean = driver.lean
    if i == 0:
        step = driver.start(ctx, gen)
        if lean is not None:
            check_lean(driver.buffers, step, lean, f"{where}, start-up")
        return 0.0, 0.0
    events = driver.changes(ctx, gen)
    if lean is None:
        return _time(driver.run, *events), 0.0
    if i % 2:
        t_lean = _time(driver.run_lean, *events)
        t0 = time.perf_counter()
        step = driver.run(*events)
        t = (time.perf_counter() - t0) * 1e6
    else:
        t0 = time.perf_counter()
        step = driver.run(*events)
        t = (time.perf_counter() - t0) * 1e6
        t_lean = _time(driver.run_lean, *events)
    if where and i <= CHECK_STEPS:
        check_lean(driver.buffers, step, lean, f"{where}, step {i}")
    return t, t_lean


def _with_flight(row: dict, flight: list[list[float]], lean: list[list[float]]) -> dict:
    row["in_flight_us"] = statistics.median(flight[0])
    row["in_flight_vs_floor"] = row["in_flight_us"] / row["floor_us"]
    row["lean_us"] = statistics.median(lean[0])
    row["in_flight_vs_lean"] = row["in_flight_us"] / row["lean_us"]
    row["in_flight_one_half_us"] = statistics.median(flight[1])
    row["lean_beside_one_half_us"] = statistics.median(lean[1])
    row["in_flight_one_half_vs_lean"] = (
        row["in_flight_one_half_us"] / row["lean_beside_one_half_us"]
    )
    if len(flight) > 2:
        row["in_flight_device_us"] = statistics.median(flight[2])
        row["in_flight_device_vs_floor"] = row["in_flight_device_us"] / row["floor_us"]
    return row


def _with_flash(row: dict, pairs: list[tuple[float, float]]) -> dict:
    """The medians of bufc's llama_flash in flight and of the gather feeder, and their ratio."""
    row["flash_us"] = statistics.median(t for t, _ in pairs)
    row["feeder_us"] = statistics.median(t for _, t in pairs)
    row["flash_vs_feeder"] = row["flash_us"] / row["feeder_us"]
    return row


def steady_case(buffers, floor, device: str, batch: int, steps: int) -> dict:
    traffic = Traffic(batch, 0, seed=batch)
    drivers = _drivers(device)
    flash = _flash_driver(device)
    ours, adv, low, ref = [], [], [], []
    flight: list[list[float]] = [[] for _ in drivers]
    lean: list[list[float]] = [[] for _ in drivers]
    t_flash: list[tuple[float, float]] = []
    for i in range(steps + 3):
        ctx, gen = traffic.step()
        t_ours = _time(buffers.prepare_step, ctx, gen)
        t_flight = [_drive(d, i, ctx, gen, f"B={batch}, steady") for d in drivers]
        t_pair = _drive(flash, i, ctx, gen, f"B={batch}, steady, llama_flash")
        t_low = _time(floor, ctx, gen)
        tokens = np.full(len(gen), 7, np.int64)
        t_adv = _time(buffers.advance, tokens)
        for r in gen:  # advance() was the next step: the requests follow it
            r.generated[0].append(7)
        t_ref = _time(plain, ctx, gen, buffers.config, device) if i % 8 == 3 else None
        if i >= 3:
            ours.append(t_ours)
            adv.append(t_adv)
            low.append(t_low)
            for times, lean_times, (t, t_lean) in zip(flight, lean, t_flight):
                times.append(t)
                lean_times.append(t_lean)
            t_flash.append(t_pair)
            if t_ref is not None:
                ref.append(t_ref)
    row = _with_flash(_with_flight(_row(ours, low, ref), flight, lean), t_flash)
    before = [d.buffers.bytes_to_device for d in drivers]
    for _ in range(4):
        ctx, gen = traffic.step()
        for d in drivers:
            _drive(d, 1, ctx, gen)
    row["in_flight_bytes_per_step"] = [
        (d.buffers.bytes_to_device - b) // 4 for d, b in zip(drivers, before)
    ]
    row["advance_us"] = statistics.median(adv)
    row["advance_vs_floor"] = row["advance_us"] / row["floor_us"]
    return row


def _row(ours: list, low: list, ref: list) -> dict:
    m_ours, m_low = statistics.median(ours), statistics.median(low)
    m_ref = statistics.median(ref) if ref else float("nan")
    return {
        "bufc_us": m_ours,
        "floor_us": m_low,
        "reference_us": m_ref,
        "bufc_vs_floor": m_ours / m_low,
        "reference_vs_bufc": m_ref / m_ours,
        "steps": len(ours),
    }


def _spin(stop) -> None:  # a busy background process
    while not stop.is_set():
        pass


@contextlib.contextmanager
def busy(k: int):
    """`k` processes spinning on the CPU while the block runs."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(k)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # let them reach the loop
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=5)


def loaded_case(device: str, batch: int, changes: int, steps: int, k: int) -> dict:
    """bufc's churn step (prepare_step, and in flight) quiet and with `k` busy processes:
    medians and the worst step."""
    out: dict = {}
    for label, load in (("quiet", 0), ("loaded", k)):
        traffic = Traffic(batch, changes, seed=batch * 10 + changes)
        buffers = bench_buffers(device)
        driver = InFlightDriver(bench_buffers(device))
        times, flight = [], []
        with busy(load):
            for i in range(steps + 3):
                ctx, gen = traffic.step()
                t = _time(buffers.prepare_step, ctx, gen)
                if i == 0:
                    driver.start(ctx, gen)
                    continue
                f = _time(driver.run, *driver.changes(ctx, gen))
                if i >= 3:
                    times.append(t)
                    flight.append(f)
        out[label] = {
            "median_us": statistics.median(times),
            "max_us": max(times),
            "in_flight_median_us": statistics.median(flight),
            "in_flight_max_us": max(flight),
        }
    q, lo = out["quiet"], out["loaded"]
    out["loaded_median_vs_quiet"] = lo["median_us"] / q["median_us"]
    out["loaded_max_vs_quiet"] = lo["max_us"] / q["median_us"]
    out["in_flight_loaded_median_vs_quiet"] = lo["in_flight_median_us"] / q["in_flight_median_us"]
    out["in_flight_loaded_max_vs_quiet"] = lo["in_flight_max_us"] / q["in_flight_median_us"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument(
        "--batches", default="64,256,1024", help="comma-separated batch sizes (default: all)"
    )
    ap.add_argument("--busy", type=int, default=0, help="busy background processes (0: none)")
    ap.add_argument("--json")
    args = ap.parse_args()
    buffers = bench_buffers(args.device)
    floor = Floor(buffers.config, args.device)
    where = (
        f"{platform.processor() or platform.machine()}, {args.device}, torch {torch.__version__}"
    )
    print(f"churn: host microseconds per step ({where}); {args.steps} steps, medians")
    print(
        f"{'case':34} {'bufc':>9} {'floor':>9} {'bufc/floor':>10} {'reference':>10} {'ref/bufc':>9}"
        f" {'lean':>9} {'flight/lean':>11}"
    )
    rows = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for changes in (1, 2, 4, 8) if batch == 1024 else (1, 2, 8):
            rows[f"B={batch}, {changes} changes"] = churn_case(
                buffers, floor, args.device, batch, changes, args.steps
            )
        rows[f"B={batch}, steady"] = steady_case(buffers, floor, args.device, batch, args.steps)
    ctx, gen = mixed()
    ours = [_time(buffers.prepare_step, ctx, gen) for _ in range(args.steps)]
    low = [_time(floor, ctx, gen) for _ in range(args.steps)]
    ref = [_time(plain, ctx, gen, buffers.config, args.device) for _ in range(args.steps // 8)]
    rows["mixed 8x512 ctx + 248 decode"] = _row(ours, low, ref)
    for name, r in rows.items():
        print(
            f"{name:34} {r['bufc_us']:9.1f} {r['floor_us']:9.1f} {r['bufc_vs_floor']:9.2f}x "
            f"{r['reference_us']:10.1f} {r['reference_vs_bufc']:8.1f}x"
        )
        if "advance_us" in r:
            print(
                f"{'  advance()':34} {r['advance_us']:9.1f} {r['floor_us']:9.1f} "
                f"{r['advance_vs_floor']:9.2f}x"
            )
        if "in_flight_us" in r:
            print(
                f"{'  in flight (finish/add/step)':34} {r['in_flight_us']:9.1f} "
                f"{r['floor_us']:9.1f} {r['in_flight_vs_floor']:9.2f}x {'':10} {'':9} "
                f"{r['lean_us']:9.1f} {r['in_flight_vs_lean']:10.2f}x"
            )
        if "flash_us" in r:
            print(
                f"{'  llama_flash in flight / gather feeder':40} {r['flash_us']:9.1f} "
                f"{r['feeder_us']:9.1f} {r['flash_vs_feeder']:9.2f}x"
            )
        if "in_flight_one_half_us" in r:
            print(
                f"{'  in flight, one staging half':34} {r['in_flight_one_half_us']:9.1f} "
                f"{r['floor_us']:9.1f} {r['in_flight_one_half_us'] / r['floor_us']:9.2f}x "
                f"{'':10} {'':9} {r['lean_beside_one_half_us']:9.1f} "
                f"{r['in_flight_one_half_vs_lean']:10.2f}x"
            )
        if "in_flight_device_us" in r:
            print(
                f"{'  in flight, tokens on the device':34} {r['in_flight_device_us']:9.1f} "
                f"{r['floor_us']:9.1f} {r['in_flight_device_vs_floor']:9.2f}x"
            )
        if "in_flight_bytes_per_step" in r:
            print(
                f"{'  host-to-device bytes per step':34} "
                + " / ".join(str(x) for x in r["in_flight_bytes_per_step"])
                + " (in flight: two halves / one half"
                + (" / tokens on the device)" if len(r["in_flight_bytes_per_step"]) > 2 else ")")
            )
    loaded = {}
    if args.busy:
        print(f"\nbufc under load: {args.busy} busy processes beside it, against quiet")
        print(f"{'case':34} {'quiet':>9} {'loaded':>9} {'median':>8} {'worst':>9} {'worst':>8}")
        for batch, changes in ((64, 2), (256, 2), (1024, 4)):
            name = f"B={batch}, {changes} changes"
            r = loaded[name] = loaded_case(args.device, batch, changes, args.steps, args.busy)
            q, lo = r["quiet"], r["loaded"]
            print(
                f"{name:34} {q['median_us']:9.1f} {lo['median_us']:9.1f} "
                f"{r['loaded_median_vs_quiet']:7.2f}x {lo['max_us']:9.1f} "
                f"{r['loaded_max_vs_quiet']:7.2f}x"
            )
            print(
                f"{'  in flight':34} {q['in_flight_median_us']:9.1f} "
                f"{lo['in_flight_median_us']:9.1f} {r['in_flight_loaded_median_vs_quiet']:7.2f}x "
                f"{lo['in_flight_max_us']:9.1f} {r['in_flight_loaded_max_vs_quiet']:7.2f}x"
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"machine": where, "cases": rows, "loaded": loaded}, indent=2)
        )


if __name__ == "__main__":
    main()
