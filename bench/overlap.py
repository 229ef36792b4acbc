"""Overlap on a GPU: a Llama-architecture model of about 1B parameters (random weights, bf16)
serving a batch of requests in flight, with and without overlap.

Both runs use the in-flight executor (``examples/executor.py``: add/finish/step, generation-only
steps through the fixed-shape decode). Without overlap the host reads each step's sampled tokens
(a wait on the model) before it prepares the next step; with overlap they stay on the device,
the next step gathers them there and the host reads them one step later, so it prepares and
enqueues step t + 1 while the GPU runs step t. Reported, over the decode steps (every request
generating): tokens/s, the median step, and the GPU's idle time between steps from CUDA events
(end of one step's sampling to the start of the next step's model), as a share of the time.

    python bench/overlap.py [--batch 256] [--prompt 512] [--new 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from bufc.examples.executor import Executor, Job


def model_1b(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(getattr(args, "dtype", torch.bfloat16)).eval()
    return model


def run(model, jobs: list[Job], args: argparse.Namespace, overlap: bool) -> dict:
    ex = Executor(
        model,
        max_batch_size=args.batch,
        token_budget=args.budget,
        chunk_size=args.prompt,
        tokens_per_block=args.tokens_per_block,
        max_sequence_length=args.prompt + args.new,
        device=args.device,
        in_flight=True,
        overlap=overlap,
    )
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    result = ex.run(jobs)
    sync()
    total = time.perf_counter() - start
    decode = [
        i
        for i, s in enumerate(result.steps)
        if not s.context_requests and s.generation_requests == len(jobs)
    ][1:]  # the first decode step follows the last prefill step
    step_s = [result.steps[i].step_s for i in decode]
    gpu_s = [result.gpu_s[i] for i in decode] if result.gpu_s else [0.0]
    idle_s = [result.idle_s[i] for i in decode] if result.idle_s else [0.0]
    gpu, idle, wall = sum(gpu_s), sum(idle_s), sum(step_s)
    return {
        "overlap": overlap,
        "steps": len(result.steps),
        "decode_steps": len(decode),
        "decode_tokens_per_s": len(jobs) * len(decode) / wall,
        "decode_step_median_ms": 1e3 * statistics.median(step_s),
        "prepare_median_us": 1e6 * statistics.median(result.steps[i].prepare_s for i in decode),
        "gpu_step_median_ms": 1e3 * statistics.median(gpu_s),
        "gpu_idle_share": idle / (idle + gpu) if gpu else 0.0,
        "gpu_idle_median_us": 1e6 * statistics.median(idle_s),
        "total_s": total,
        "tokens": result.tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64, help="tokens generated per request")
    p.add_argument("--budget", type=int, default=32768, help="tokens per step (prefill)")
    p.add_argument("--tokens-per-block", type=int, default=64)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--device", default="cuda", help="cuda (a CPU run checks the script only)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/overlap.py needs a CUDA device", file=sys.stderr)
        return 1
    model = model_1b(args)
    params = sum(x.numel() for x in model.parameters())
    rng = random.Random(1)
    jobs = [
        Job(i, tuple(rng.randrange(args.vocab) for _ in range(args.prompt)), args.new)
        for i in range(args.batch)
    ]
    run(model, jobs[: min(8, args.batch)], args, True)  # warm-up: kernels, allocator
    results = [run(model, jobs, args, overlap) for overlap in (False, True)]
    same = results[0].pop("tokens") == results[1].pop("tokens")
    print(
        f"{params / 1e9:.2f}B parameters (bf16), batch {args.batch}, prompts {args.prompt}, "
        f"{args.new} new tokens each; "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}"
    )
    print(
        f"{'overlap':>8} {'tokens/s':>9} {'step ms':>8} {'GPU ms':>7} {'idle %':>7} "
        f"{'idle us':>8} {'prepare us':>10}"
    )
    for r in results:
        print(
            f"{'yes' if r['overlap'] else 'no':>8} {r['decode_tokens_per_s']:9.0f} "
            f"{r['decode_step_median_ms']:8.2f} {r['gpu_step_median_ms']:7.2f} "
            f"{100 * r['gpu_idle_share']:7.2f} {r['gpu_idle_median_us']:8.0f} "
            f"{r['prepare_median_us']:10.0f}"
        )
    ratio = results[1]["decode_tokens_per_s"] / results[0]["decode_tokens_per_s"]
    print(f"overlap / no overlap: {ratio:.3f}x tokens/s; same tokens in both runs: {same}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"params": params, "same_tokens": same, "runs": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
