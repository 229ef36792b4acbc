"""A fast engine served in flight: FastLlama (examples/fast_llama.py, a Llama of about 1.1B
parameters with random weights in bf16) through examples/serving.py's server, its inputs
prepared by bufc's llama_flash buffers (`bufc`: the host build; `device`: the step built on the
device, `build='device'`, `host_inputs=False`) or by the plain torch preparation of
bench/plain_flash.py (`plain`), each case run for each in turn on the same model.

Cases, for each batch B: `steady` (B requests decode, none leaves: every step is generation-only)
and `churn` (about B // 128 requests, at least 1, finish each step and as many arrive with
512-token prompts, prefilled in chunks of 256 beside the decode: mixed steps). Every step
replays the CUDA graph of its token and batch bucket (`--graph-tokens N`: steps of more tokens
run eagerly, their prompt chunks through FlashAttention; `--no-graphs`: all eagerly at the
bucket's shapes). The tokens stay on the device (overlap); the host reads them
one step late. `--rounds N` serves each case N times per feeder, the order alternating (bufc
then plain, plain then bufc, ...), and pools the steps. Over the measured steps (after the
warm-up; a step that captured a CUDA graph is left out and counted, `capt`: a one-time cost,
which engines pay at start-up) it reports:

- decode tokens/s: the tokens generated over the wall time of those steps;
- the median step (wall, loop to loop) and the median GPU time of a step (CUDA events);
- steady: the bytes a decode step reads (weights, and K/V of every sequence's positions) over
  the HBM bandwidth measured in the same run (a device-to-device copy, bytes read and written
  over its time): the memory bound, and the GPU step's ratio to it;
- GPU idle: the time between one step's end and the next one's start, as a share of the time;
- the host's preparation per step (the feeder's call) and the whole loop iteration;
- whether bufc's and the plain preparation's tokens were the same.

    python bench/serving.py [--batches 64,256,1024] [--steps 48] [--rounds 2] [--json PATH]
    python bench/serving.py --device cpu --tiny   (checks the script: a tiny model on the CPU)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overlap import model_1b  # noqa: E402
from plain_flash import PlainFeeder  # noqa: E402

from bufc.examples.fast_llama import FastLlama  # noqa: E402
from bufc.examples.serving import BufcFeeder, DeviceFeeder, Server, churn_jobs  # noqa: E402
from bufc.generated import llama_flash  # noqa: E402

CHUNK = 256  # prompt tokens per chunk


def hbm_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy (read and written), median of 10."""
    if device != "cuda":
        return float("nan")
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n / statistics.median(times[2:])


def serve_case(engine, args, batch: int, case: str, feeder_name: str) -> dict:
    changes = max(1, batch // 128)
    steady = case == "steady"
    budget = batch + max(8192, 2 * changes * CHUNK)
    life = batch // changes
    prefill_steps = math.ceil(batch * args.prompt / (budget - batch))
    warm = prefill_steps + args.warmup
    # A steady request decodes from the step its prefill ends, so at most one token a step.
    new = warm + args.steps + 1 if steady else life
    width = math.ceil((args.prompt + new + 1) / args.tokens_per_block)
    config = llama_flash.Config(
        max_batch_size=batch,
        max_num_tokens=budget,
        vocab_size=args.vocab,
        num_layers=args.layers,
        max_attention_window=width * args.tokens_per_block,
        tokens_per_block=args.tokens_per_block,
        logits_dtype=args.dtype,
    )
    feeders = {"bufc": BufcFeeder, "plain": PlainFeeder, "device": DeviceFeeder}
    feeder = feeders[feeder_name](config, args.device)
    server = Server(
        engine,
        feeder,
        max_batch_size=batch,
        token_budget=budget,
        chunk_size=CHUNK,
        tokens_per_block=args.tokens_per_block,
        num_blocks=batch * (width + 1) + 1,
        graphs=not args.no_graphs,
        graph_tokens=args.graph_tokens,
    )
    jobs = churn_jobs(batch, changes, args.prompt, args.vocab, seed=batch, steady=steady)
    if args.device == "cuda":
        torch.cuda.synchronize()
    served = server.run(jobs, max_steps=warm + args.steps)
    # Steps that captured a CUDA graph pay a one-time cost (torch synchronises and collects
    # garbage around a capture; engines capture their buckets at start-up): counted apart.
    kept = [i for i in range(warm, len(served.steps)) if not served.steps[i].captured]
    return {
        "records": [served.steps[i] for i in kept],
        "wall": [served.wall_s[i] for i in kept],
        "gpu": [served.gpu_s[i] for i in kept] if served.gpu_s else [],
        "idle": [served.idle_s[i] for i in kept] if served.idle_s else [],
        "captured": len(served.steps) - warm - len(kept),
        "kv_bytes_per_token": server.cache.bytes_per_token(),
        "tokens": served.tokens,
    }


def summarize(engine, runs: list[dict], batch: int, case: str, feeder: str, bandwidth: float):
    """One row from a feeder's runs of a case (pooled: tokens/s over all their steps, medians
    over all their steps)."""
    recs = [r for run in runs for r in run["records"]]
    wall = [w for run in runs for w in run["wall"]]
    gpu = [g for run in runs for g in run["gpu"]] or [float("nan")]
    idle = [g for run in runs for g in run["idle"]] or [float("nan")]
    generated = sum(r.generation_requests for r in recs)
    row = {
        "batch": batch,
        "case": case,
        "feeder": feeder,
        "changes": 0 if case == "steady" else max(1, batch // 128),
        "runs": len(runs),
        "steps": len(recs),
        "captured_steps": sum(run["captured"] for run in runs),
        "arrived_per_step": sum(r.arrived for r in recs) / len(recs),
        "graph_steps": sum(r.graph for r in recs),
        "tokens_per_s": generated / sum(wall),
        "step_ms": 1e3 * statistics.median(wall),
        "gpu_ms": 1e3 * statistics.median(gpu),
        "idle_share": sum(idle) / (sum(idle) + sum(gpu)),
        "prepare_us": 1e6 * statistics.median(r.prepare_s for r in recs),
        "host_us": 1e6 * statistics.median(r.host_s for r in recs),
    }
    if case == "steady":
        kv = statistics.median(r.kv_tokens for r in recs)
        read = engine.weight_bytes() + kv * runs[0]["kv_bytes_per_token"]
        row["bytes_read"] = read
        row["bound_ms"] = 1e3 * read / bandwidth
        row["over_bound"] = row["gpu_ms"] / row["bound_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="64,256,1024")
    p.add_argument("--cases", default="steady,churn")
    p.add_argument("--feeders", default="bufc,plain")
    p.add_argument("--steps", type=int, default=48, help="measured steps per case")
    p.add_argument("--warmup", type=int, default=16, help="steps after the first prefill")
    p.add_argument(
        "--rounds", type=int, default=1, help="runs per feeder and case, in alternating order"
    )
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens-per-block", type=int, default=64)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-graphs", action="store_true", help="run the bucketed steps eagerly")
    p.add_argument(
        "--graph-tokens", type=int, help="steps of more tokens run eagerly (default: none)"
    )
    p.add_argument("--tiny", action="store_true", help="a tiny float32 model (script check)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    args.dtype = torch.bfloat16
    if args.tiny:
        args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads = 2, 64, 128, 4, 2
        args.vocab, args.prompt, args.tokens_per_block, args.dtype = 512, 64, 16, torch.float32
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/serving.py needs a CUDA device (or --device cpu --tiny)", file=sys.stderr)
        return 1
    model = model_1b(args)  # in args.dtype
    params = sum(x.numel() for x in model.parameters())
    engine = FastLlama(model, max_positions=4096)
    del model
    bandwidth = hbm_bandwidth(args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"{params / 1e9:.2f}B parameters ({str(args.dtype).removeprefix('torch.')}), prompts "
        f"{args.prompt}, {args.steps} measured steps; {name}; copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s"
    )
    header = (
        f"{'B':>5} {'case':>6} {'feeder':>6} {'tok/s':>8} {'step ms':>8} {'GPU ms':>7} "
        f"{'bound ms':>8} {'xbound':>6} {'idle %':>6} {'prep us':>8} {'host us':>8} {'capt':>4} "
        f"{'same':>5}"
    )
    print(header)
    rows = []
    t0 = time.perf_counter()
    for batch in map(int, args.batches.split(",")):
        for case in args.cases.split(","):
            feeders = args.feeders.split(",")
            runs: dict[str, list[dict]] = {f: [] for f in feeders}
            for r in range(args.rounds):  # alternate the order: A B, B A, ...
                for f in feeders if r % 2 == 0 else feeders[::-1]:
                    runs[f].append(serve_case(engine, args, batch, case, f))
            tokens = [run["tokens"] for f in feeders for run in runs[f]]
            same = all(t == tokens[0] for t in tokens)
            pair = [summarize(engine, runs[f], batch, case, f, bandwidth) for f in feeders]
            for r in pair:
                r["same_tokens"] = same
                print(
                    f"{batch:>5} {case:>6} {r['feeder']:>6} {r['tokens_per_s']:8.0f} "
                    f"{r['step_ms']:8.2f} {r['gpu_ms']:7.2f} {r.get('bound_ms', float('nan')):8.2f} "
                    f"{r.get('over_bound', float('nan')):6.2f} {100 * r['idle_share']:6.2f} "
                    f"{r['prepare_us']:8.0f} {r['host_us']:8.0f} {r['captured_steps']:4d} "
                    f"{str(same):>5}"
                )
            if len(pair) == 2:
                ratio = pair[0]["tokens_per_s"] / pair[1]["tokens_per_s"]
                print(
                    f"{'':>5} {case:>6} {'ratio':>6} {ratio:8.3f}x tokens/s "
                    f"({pair[0]['feeder']} / {pair[1]['feeder']})"
                )
            rows += pair
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        info = {"device": name, "params": params, "bandwidth": bandwidth, "argv": sys.argv[1:]}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"info": info, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
