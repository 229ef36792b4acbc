"""Host cost of the CUDA calls one step makes (event wait, async copy, event record), to see
how much of prepare_step/advance on a GPU machine is the driver rather than bufc.

    python bench/cuda_primitives.py
"""

from __future__ import annotations

import statistics
import time

import torch


def median_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    host = torch.zeros(1 << 17, dtype=torch.uint8, pin_memory=True)
    dev = torch.zeros(1 << 17, dtype=torch.uint8, device="cuda")
    ev = torch.cuda.Event()
    ev.record()
    torch.cuda.synchronize()
    span = 82_000
    hs, ds = host[:span], dev[:span]
    rows = {
        "event.synchronize (done)": lambda: ev.synchronize(),
        "event.query (done)": lambda: ev.query(),
        "event.record": lambda: ev.record(),
        "slice two views": lambda: (dev[:span], host[:span]),
        "copy_ 82 KB pinned, non_blocking": lambda: ds.copy_(hs, non_blocking=True),
        "copy + record + synchronize": lambda: (
            ds.copy_(hs, non_blocking=True),
            ev.record(),
            ev.synchronize(),
        ),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: host us per call (median)")
    for name, fn in rows.items():
        print(f"  {name:36} {median_us(fn):8.2f}")


if __name__ == "__main__":
    main()
