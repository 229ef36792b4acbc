"""Run the example executor over a tp_size x pp_size torch.distributed world on this machine.

One process per rank (``torch.multiprocessing``, start method spawn), rendezvous over loopback
TCP. Backend gloo runs on the CPU; nccl puts rank r on GPU r. Every rank builds the same model
from the same seed and serves the same workload; rank 0 returns its Result (all ranks sample
the same tokens: the last stage broadcasts them).
"""

from __future__ import annotations

import dataclasses
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .compare import tiny_llama, workload
from .executor import Executor, Result, StepStats
from .parallel import init


@dataclasses.dataclass(frozen=True)
class WorldRun:
    result: Result
    elapsed_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    tp: int,
    pp: int,
    backend: str,
    port: int,
    model_args: dict[str, Any],
    jobs_args: dict[str, Any],
    executor_args: dict[str, Any],
    every: int,
    threads: int,
    queue: Any,
) -> None:
    torch.set_num_threads(threads)  # ranks share the machine's cores (1 by default)
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    par = init(tp, pp, rank, backend, f"tcp://127.0.0.1:{port}")
    try:
        model = tiny_llama(**model_args).to(device)
        jobs = workload(vocab_size=model.config.vocab_size, **jobs_args)
        executor = Executor(model, parallel=par, device=device, **executor_args)

        def on_step(s: StepStats) -> None:
            if rank == 0 and every and s.step % every == 0:
                print(
                    f"{s.step:5d} {s.in_flight:9d} {s.context_requests:4d} "
                    f"{s.generation_requests:4d} {s.tokens:6d} {s.prepare_s * 1e6:10.0f} us",
                    flush=True,
                )

        start = time.perf_counter()
        result = executor.run(jobs, on_step=on_step)
        elapsed = time.perf_counter() - start
        if rank == 0:
            queue.put(WorldRun(result, elapsed))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_world(
    tp: int,
    pp: int,
    *,
    backend: str = "gloo",
    model_args: dict[str, Any] | None = None,
    jobs_args: dict[str, Any] | None = None,
    executor_args: dict[str, Any] | None = None,
    every: int = 0,
    threads: int = 1,
) -> WorldRun:
    """Serve `workload(**jobs_args)` on `tiny_llama(**model_args)` with tp x pp processes."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    args = (
        tp,
        pp,
        backend,
        _free_port(),
        model_args or {},
        jobs_args or {},
        executor_args or {},
        every,
        threads,
        queue,
    )
    mp.start_processes(_worker, args=args, nprocs=tp * pp, join=True, start_method="spawn")
    return queue.get()
