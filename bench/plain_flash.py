"""A plain input preparation of the FlashAttention/vLLM step, for bench/serving.py: what one
writes without bufc, with ordinary Python and torch ops, behind the server's four calls (``add``,
``finish``, ``step``, and the bucket views of a generation-only step).

It keeps each request's prompt, position, generated count and block list in Python objects,
and every step builds the contract's tensors as Python lists (context requests first, then the
generation requests), makes one tensor of each and copies it into a persistent device buffer
(the engine's CUDA graphs read fixed addresses), pads the tokens and rows of a bucket, and gathers the
sampled tokens of the generation rows on the device. It checks nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from bufc.examples.fast_llama import Batch
from bufc.examples.serving import Prepared

NAMES = (
    "input_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "seq_lens",
    "block_table",
    "logits_indices",
)


@dataclasses.dataclass(eq=False)
class _Req:
    prompt: list[int]
    blocks: list[int]
    position: int = 0
    generated: int = 0


class PlainFeeder:
    name = "plain"

    def __init__(self, config: Any, device: str | torch.device) -> None:
        """Sized by a llama_flash Config, as bufc's feeder is."""
        c = config
        S, N, W = c.max_batch_size, c.max_num_tokens, c.max_blocks_per_seq
        self.W, self.bs, self.device = W, c.tokens_per_block, torch.device(device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.buf = {
            "input_ids": torch.zeros(N, **i32),
            "positions": torch.zeros(N, **i32),
            "slot_mapping": torch.full((N,), -1, **i32),
            "query_start_loc": torch.zeros(S + 1, **i32),
            "seq_lens": torch.zeros(S, **i32),
            "block_table": torch.zeros(S, W, **i32),
            "logits_indices": torch.zeros(S, **i32),
        }
        self.seq_slots = torch.zeros(S, **i32)
        self.logits = torch.zeros(S, c.vocab_size_padded, dtype=c.logits_dtype, device=self.device)
        self.reqs: dict[int, _Req] = {}
        self.waiting: dict[int, None] = {}  # context phase, arrival order
        self.decoding: dict[int, None] = {}
        self.produced: list[tuple[int, _Req]] = []  # the last step's producers, by slot
        self.rows = self.tokens = 0

    def add(self, slot: int, prompt: Sequence[int], blocks: list[int]) -> None:
        self.reqs[slot] = _Req(list(prompt), list(blocks))
        self.waiting[slot] = None

    def finish(self, slot: int) -> None:
        del self.reqs[slot]
        self.waiting.pop(slot, None)
        self.decoding.pop(slot, None)

    def step(
        self, tokens: torch.Tensor | None, chunks: dict[int, int], blocks: dict[int, list[int]]
    ) -> Prepared:
        # the last step's effects: its generation rows and finished prompts produced a token
        for slot, r in self.produced:
            if self.reqs.get(slot) is r:  # still in flight (not a new request in its slot)
                r.generated += 1
                if slot in self.waiting:
                    del self.waiting[slot]
                    self.decoding[slot] = None
        for slot, ids in blocks.items():
            self.reqs[slot].blocks += ids
        bs, W = self.bs, self.W
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts = [0]
        lens: list[int] = []
        table: list[list[int]] = []
        seq_slots: list[int] = []
        completing: list[tuple[int, _Req]] = []
        ctx = [s for s in self.waiting if s in chunks]
        for slot in ctx:
            r, n = self.reqs[slot], chunks[slot]
            begin, end = r.position, r.position + n
            ids += r.prompt[begin:end]
            pos += range(begin, end)
            slots += [r.blocks[p // bs] * bs + p % bs for p in range(begin, end)]
            starts.append(starts[-1] + n)
            lens.append(end)
            table.append(r.blocks + [0] * (W - len(r.blocks)))
            seq_slots.append(slot)
            r.position = end
            if end == len(r.prompt):
                completing.append((slot, r))
        n_ctx, ctx_tok = len(ctx), len(ids)
        decode = list(self.decoding)
        for slot in decode:
            r = self.reqs[slot]
            length = len(r.prompt) + r.generated
            p = length - 1
            ids.append(0)  # the sampled token, gathered on the device below
            pos.append(p)
            slots.append(r.blocks[p // bs] * bs + p % bs)
            starts.append(starts[-1] + 1)
            lens.append(length)
            table.append(r.blocks + [0] * (W - len(r.blocks)))
            seq_slots.append(slot)
        rows = len(seq_slots)
        values = {
            "input_ids": ids,
            "positions": pos,
            "slot_mapping": slots,
            "query_start_loc": starts,
            "seq_lens": lens,
            "block_table": table,
            "logits_indices": [s - 1 for s in starts[1:]],
        }
        for name, v in values.items():
            self.buf[name][: len(v)].copy_(torch.tensor(v, dtype=torch.int32), non_blocking=True)
        self.seq_slots[:rows].copy_(torch.tensor(seq_slots, dtype=torch.int32), non_blocking=True)
        if decode and tokens is not None:
            rows_dev = torch.tensor(decode, dtype=torch.long).to(self.device, non_blocking=True)
            self.buf["input_ids"][ctx_tok : ctx_tok + len(decode)] = tokens[rows_dev].to(
                torch.int32
            )
        self.produced = [(slot, self.reqs[slot]) for slot in decode] + completing
        tok = len(ids)
        self.rows, self.tokens = rows, tok
        inputs = {
            "input_ids": self.buf["input_ids"][:tok],
            "positions": self.buf["positions"][:tok],
            "slot_mapping": self.buf["slot_mapping"][:tok],
            "query_start_loc": self.buf["query_start_loc"][: rows + 1],
            "seq_lens": self.buf["seq_lens"][:rows],
            "block_table": self.buf["block_table"][:rows],
            "logits_indices": self.buf["logits_indices"][:rows],
        }
        batch = Batch(
            inputs,
            n_ctx,
            ctx_tok,
            sum(lens[:n_ctx]),
            max(b - a for a, b in zip(starts, starts[1:])),
            max(lens),
        )
        return Prepared(batch, self.seq_slots, self.logits, rows, self._bucket)

    def _bucket(self, tokens: int, rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The buffers at a bucket of `tokens` and `rows`, what lies past the step padded: a
        padded token writes nowhere (slot -1) and belongs to no sequence, a padded row has no
        tokens and length 0."""
        n, t, b = self.rows, self.tokens, self.buf
        b["input_ids"][t:tokens] = 0
        b["positions"][t:tokens] = 0
        b["slot_mapping"][t:tokens] = -1
        b["query_start_loc"][n + 1 : rows + 1] = t
        b["seq_lens"][n:rows] = 0
        b["block_table"][n:rows] = 0
        b["logits_indices"][n:rows] = 0
        inputs = {
            "input_ids": b["input_ids"][:tokens],
            "positions": b["positions"][:tokens],
            "slot_mapping": b["slot_mapping"][:tokens],
            "query_start_loc": b["query_start_loc"][: rows + 1],
            "seq_lens": b["seq_lens"][:rows],
            "block_table": b["block_table"][:rows],
            "logits_indices": b["logits_indices"][:rows],
        }
        return inputs, self.logits[:rows]
