"""``bufc demo`` (``make demo``): serve a workload with the generated llama buffers and check
every token against transformers.generate.

It builds a small random Llama (float64), runs the in-flight batching executor with chunked
prefill over a paged KV cache, shows a tqdm progress bar (requests finished, rate, ETA; plain
lines when the output is not a terminal) and per-step figures, then a summary.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _at_least(low: int):  # noqa: ANN202 - an argparse type
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bufc demo",
        description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", "'"),
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu or cuda")
    p.add_argument(
        "--requests", type=_at_least(4), default=32, help="requests in the workload (at least 4)"
    )
    p.add_argument("--max-prompt", type=_at_least(1), default=400, help="longest prompt, in tokens")
    p.add_argument("--token-budget", type=_at_least(1), default=128, help="tokens per step")
    p.add_argument("--chunk-size", type=_at_least(1), default=48, help="largest prefill chunk")
    p.add_argument(
        "--tokens-per-block", type=_at_least(1), default=16, help="tokens per KV-cache block"
    )
    p.add_argument(
        "--max-batch-size", type=_at_least(1), default=12, help="most requests in flight"
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="drive the buffers with add/finish/step and keep the sampled tokens on the "
        "device: the host prepares step t+1 while the device runs step t",
    )
    p.add_argument(
        "--threads",
        type=_at_least(1),
        default=1,
        metavar="N",
        help="torch intra-op threads in each process (default 1: the model is tiny, and on a "
        "busy machine extra threads wait for a core and stall every operation)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the workload")
    p.add_argument("--every", type=_at_least(1), default=10, help="print figures every N steps")
    # the demo model has 2 layers and 4 heads (2 KV heads): 1 or 2 ranks either way
    p.add_argument("--pp", type=int, default=1, choices=(1, 2), help="pipeline-parallel processes")
    p.add_argument("--tp", type=int, default=1, choices=(1, 2), help="tensor-parallel processes")
    p.add_argument(
        "--backend",
        default="gloo",
        choices=("gloo", "nccl"),
        help="torch.distributed backend: gloo (CPU) or nccl (GPUs)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(
            f"bufc demo needs torch ({exc}): pip install torch numpy (bufc's [runtime] extra)",
            file=sys.stderr,
        )
        return 1
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the model, the executor and generate alike
    try:
        return _demo(args)
    finally:
        torch.set_num_threads(before)


def _demo(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
        from tqdm import tqdm  # transformers depends on it

        from .compare import Mismatch, assert_same_tokens, reference_tokens, tiny_llama, workload
        from .executor import Executor, StepStats
    except ImportError as exc:
        print(
            f"bufc demo needs torch and transformers ({exc}): pip install torch numpy transformers",
            file=sys.stderr,
        )
        return 1
    model = tiny_llama(args.seed).to(args.device)
    jobs_args = dict(n=args.requests, seed=args.seed + 1, max_prompt=args.max_prompt)
    jobs = workload(vocab_size=model.config.vocab_size, **jobs_args)
    executor_args = dict(
        max_batch_size=args.max_batch_size,
        token_budget=args.token_budget,
        chunk_size=args.chunk_size,
        tokens_per_block=args.tokens_per_block,
        max_sequence_length=args.max_prompt + 16,
    )
    world = args.pp * args.tp
    where = (
        f"{world} processes (pp {args.pp} x tp {args.tp}, {args.backend})"
        if world > 1
        else f"device {args.device}"
    )
    print(
        f"bufc demo: {len(jobs)} requests (prompts 1-{args.max_prompt} tokens), "
        f"budget {args.token_budget} tokens/step, chunks <= {args.chunk_size}, "
        f"{args.tokens_per_block} tokens/block, {where}"
    )
    print(f"{'step':>5} {'in flight':>9} {'ctx':>4} {'gen':>4} {'tokens':>6} {'prepare_step':>13}")
    # on a terminal a progress bar (requests finished, rate, ETA) redraws in place on stderr
    # under the step lines; captured output gets the step lines and the summary alone
    bar = tqdm(total=len(jobs), unit="req", desc="requests", disable=not sys.stderr.isatty())

    def on_step(s: StepStats) -> None:
        if s.step % args.every == 0:
            line = (
                f"{s.step:5d} {s.in_flight:9d} {s.context_requests:4d} {s.generation_requests:4d} "
                f"{s.tokens:6d} {s.prepare_s * 1e6:10.0f} us"
            )
            bar.write(line, file=sys.stdout)  # tqdm.write: printed above the bar
        bar.update(s.finished - bar.n)

    if args.overlap and (world > 1 or args.token_budget < args.max_batch_size):
        print(
            "bufc demo: --overlap runs in one process (no --pp/--tp), every generation "
            "request each step (--token-budget at least --max-batch-size)",
            file=sys.stderr,
        )
        return 2
    if world > 1:
        from .distributed import run_world

        run = run_world(
            args.tp,
            args.pp,
            backend=args.backend,
            model_args={"seed": args.seed},
            jobs_args=jobs_args,
            executor_args=executor_args,
            every=args.every,
            threads=args.threads,
        )
        result, elapsed = run.result, run.elapsed_s
    else:
        executor = Executor(model, device=args.device, overlap=args.overlap, **executor_args)
        start = time.perf_counter()
        result = executor.run(jobs, on_step=on_step)
        elapsed = time.perf_counter() - start
    bar.update(len(jobs) - bar.n)
    bar.close()
    ref_start = time.perf_counter()
    reference = reference_tokens(model, jobs)
    ref_elapsed = time.perf_counter() - ref_start
    try:
        assert_same_tokens(result, reference)
        verdict = f"all {len(jobs)} requests match transformers.generate"
        code = 0
    except Mismatch as exc:
        verdict = f"MISMATCH: {exc}"
        code = 1
    tokens = sum(len(t) for t in result.tokens.values())
    prep = [s.prepare_s for s in result.steps]
    step_total = sum(s.step_s for s in result.steps)
    rows = [
        ("requests", f"{len(jobs)}"),
        (
            "steps",
            f"{len(result.steps)} ({sum(1 for s in result.steps if s.context_requests and s.generation_requests)} mixed)",
        ),
        ("tokens generated", f"{tokens}"),
        ("tokens/s (bufc executor)", f"{tokens / elapsed:.0f}"),
        ("torch intra-op threads", f"{args.threads} per process (--threads)"),
        ("prepare_step median", f"{statistics.median(prep) * 1e6:.0f} us"),
        ("prepare_step share of step time", f"{100 * sum(prep) / step_total:.1f} %"),
        *(
            [
                (
                    "GPU idle between steps",
                    f"{100 * sum(result.idle_s) / (sum(result.idle_s) + sum(result.gpu_s)):.1f} %",
                )
            ]
            if world == 1 and result.gpu_s
            else []
        ),
        ("transformers.generate, one by one", f"{ref_elapsed:.1f} s"),
        ("result", verdict),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return code
