"""A hybrid (two-window) model's steps under one CUDA graph: llama_flash with two KV-cache
groups on the GPU, every step built at one bucket (``step(..., bucket=(tokens, rows))``), and a
fixed-shape paged read through each group's block table and slot mapping captured once on the
bucket's views and replayed as the batch changes; each replay equals the same read computed
eagerly from an unpadded twin's step. Skipped without CUDA; run by hand on the GPU machine
(``python3 -P -m pytest -q tests/test_gpu_buckets.py`` with bufc on PYTHONPATH)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import make_buffers

from bufc.runtime import Request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TPB, WINDOWS, BLOCKS = 4, [8, 64, 8], 512
BUCKET = (32, 8)  # (tokens, rows) of the one graph


def buffers(device: str):
    return make_buffers(
        "llama_flash",
        device=device,
        max_batch_size=8,
        max_num_tokens=64,
        max_beam_width=1,
        num_layers=3,
        attention_windows=WINDOWS,
        tokens_per_block=TPB,
        max_attention_window=64,
    )


def paged_read(inputs, pool: torch.Tensor, rows: int) -> torch.Tensor:
    """[groups, rows + 1]: per group and row the pool value of the block holding its last KV
    position, read through the block table at seq_lens (0 for a padded row), then the sum of
    the written slots' block values (fixed shapes, no host read: what an attention kernel
    under a graph does)."""
    tables, slots = inputs["group_block_tables"], inputs["group_slot_mappings"]
    groups = tables.shape[0]
    lens = inputs["seq_lens"][:rows].long()
    col = ((lens - 1).clamp(min=0) // TPB).view(1, rows, 1).expand(groups, rows, 1)
    block = tables[:, :rows].long().gather(2, col)[..., 0]
    read = pool[block] * (lens > 0)
    written = torch.where(slots >= 0, pool[slots.clamp(min=0) // TPB], 0).sum(1, keepdim=True)
    return torch.cat((read, written), dim=1)


@pytest.mark.parametrize("seed", range(2))
def test_two_window_steps_replay_one_captured_graph(seed: int) -> None:
    rng = random.Random(seed)
    gpu, twin = buffers("cuda"), buffers("cpu")
    windows = gpu.config.attention_window_sizes
    pool = torch.arange(BLOCKS, dtype=torch.float32, device="cuda") * 3 + 1
    free = list(range(1, BLOCKS))
    rng.shuffle(free)
    lists: dict[int, dict[int, list[int]]] = {}
    counts: dict[int, int] = {}

    def arrive(slot: int) -> None:
        n = rng.randint(1, 9)
        lists[slot] = {w: [free.pop() for _ in range(-(-(n + 1) // TPB))] for w in windows}
        counts[slot] = n
        prompt = [rng.randrange(100) for _ in range(n)]
        for b in (gpu, twin):
            b.add(
                Request(slot, prompt, kv_block_ids={w: [list(x)] for w, x in lists[slot].items()})
            )

    for slot in range(4):
        arrive(slot)
    graph, out, replays, tokens = None, None, 0, None
    for _ in range(12):
        blocks: dict = {}
        if tokens is not None:
            for slot in list(counts):
                counts[slot] += 1
                need = -(-(counts[slot] + 1) // TPB)
                for w in windows:
                    if need > len(lists[slot][w]):
                        grown = [free.pop() for _ in range(need - len(lists[slot][w]))]
                        lists[slot][w] += grown
                        blocks.setdefault(slot, {})[w] = grown
        want_step = twin.step(tokens, blocks={s: dict(v) for s, v in blocks.items()})
        step = gpu.step(tokens, blocks=blocks, bucket=BUCKET)
        rows = want_step.sizes.num_sequences
        want = paged_read({k: v.cuda() for k, v in want_step.inputs.items()}, pool, rows)
        if graph is None:  # captured once, on the bucket's views
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                paged_read(step.inputs, pool, BUCKET[1])  # warm-up
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = paged_read(step.inputs, pool, BUCKET[1])
        graph.replay()  # (a capture records the work; it runs on replay)
        replays += 1
        assert out is not None
        torch.cuda.synchronize()
        assert torch.equal(out[:, :rows], want[:, :rows]), rows
        assert torch.equal(out[:, -1], want[:, -1])  # the written slots, padded tokens none
        assert not out[:, rows:-1].any()  # padded rows read nothing
        tokens = np.zeros(8, np.int64)
        tokens[list(counts)] = [rng.randrange(100) for _ in counts]
        if rng.random() < 0.4:
            slot = rng.choice(sorted(counts))
            for b in (gpu, twin):
                b.finish(slot)
            del counts[slot], lists[slot]
            arrive(slot)
    assert replays == 12
