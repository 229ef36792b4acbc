"""The batch fuzz's simulated client: realistic traffic for one family (requests arrive, are
scheduled in context chunks, decode with beams, drafts and advance() runs, and finish), its
paged-KV block lists growing as their sequences enter new blocks."""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import numpy as np
import torch
from fuzz_configs import ADVANCES, INT32_MAX, index_limits

from bufc.runtime import Request


# ------------------------------------------------------------------------------ the client
@dataclasses.dataclass(eq=False)
class Live:
    req: Request
    target: int  # generated tokens per beam before it finishes
    pending: list[list[int]] | None = None  # sampled tokens per beam, not yet appended


_SAVED_FIELDS = ("generated", "kv_block_ids", "draft_tokens", "context_position")
_SAVED_FIELDS += ("context_chunk_size", "cross_kv_block_ids", "lora_weights")
_SAVED_FIELDS += ("encoder_input_length", "encoder_output_length", "encoder_input_ids")
_SAVED_FIELDS += ("encoder_output", "cross_attention_mask", "skip_cross_attn_blocks")


def _copy(value: Any) -> Any:
    """A deep copy, except of tensors (never edited in place here)."""
    return value if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class Client:
    """Realistic traffic for one family: requests arrive with a prompt, are scheduled in context
    chunks under a token budget, decode (beams, drafts, advance() runs) and finish."""

    def __init__(self, name: str, config, rng: random.Random) -> None:
        self.name, self.c, self.rng = name, config, rng
        self.vocab = config.vocab_size
        self.max_beam = getattr(config, "max_beam_width", 1)
        self.max_drafts = getattr(config, "max_draft_tokens", 0)
        self.paged = hasattr(config, "max_blocks_per_seq")
        self.tpb = getattr(config, "tokens_per_block", 1)
        self.width = getattr(config, "max_blocks_per_seq", 0)
        self.limit, self.bad_limit = index_limits(config) if self.paged else (0, 0)
        self.enc = hasattr(config, "max_encoder_length")
        self.lora = hasattr(config, "lora_modules")
        self.positions = name != "mamba"
        self.live: list[Live] = []
        self.free = list(range(config.max_batch_size))
        self.advanceable = False
        self.last_gen: list[Request] = []  # the generation list advance() continues

    # ------------------------------------------------------------------ state
    def save(self) -> tuple:
        fields = {
            id(x): (
                copy.deepcopy(x.pending),
                {f: _copy(getattr(x.req, f)) for f in _SAVED_FIELDS},
            )
            for x in self.live
        }
        return list(self.live), list(self.free), self.advanceable, list(self.last_gen), fields

    def restore(self, saved: tuple) -> None:
        """Back to the state of `save()` (a rejected call did not happen)."""
        self.live, self.free, self.advanceable, self.last_gen, fields = saved
        self.live, self.free = list(self.live), list(self.free)
        for x in self.live:
            pending, values = fields[id(x)]
            x.pending = pending
            for f, v in values.items():
                setattr(x.req, f, v)

    def drop(self, requests) -> None:
        """Finish `requests` (a valid batch of theirs was rejected: do not retry it forever)."""
        ids = {id(r) for r in requests}
        for x in [x for x in self.live if id(x.req) in ids]:
            self.live.remove(x)
            self.free.append(int(x.req.seq_slot))
        self.advanceable = False

    # ------------------------------------------------------------------ values
    def token(self) -> int:
        r = self.rng.random()
        return 0 if r < 0.03 else self.vocab - 1 if r < 0.06 else self.rng.randrange(self.vocab)

    def block_id(self) -> int:
        r = self.rng.random()
        return 0 if r < 0.05 else self.limit - 1 if r < 0.1 else self.rng.randrange(self.limit)

    def maybe_np(self, value: int, p: float) -> Any:
        return np.int64(value) if self.rng.random() < p else value

    def new_request(self) -> Live:
        rng, c = self.rng, self.c
        slot = self.free.pop(rng.randrange(len(self.free)))
        n = rng.randint(1, 4) if rng.random() < 0.2 else rng.randint(1, 40)
        typed = rng.random() < 0.15  # numpy integers, which must be accepted as ints
        prompt = [self.token() for _ in range(n)]
        if typed:
            prompt = [np.int64(t) for t in prompt]
        beam = 1 if self.max_beam == 1 or rng.random() < 0.5 else rng.randint(1, self.max_beam)
        r = Request(
            seq_slot=np.int64(slot) if typed else slot,
            prompt=prompt,
            beam_width=self.maybe_np(beam, 0.3) if typed else beam,
        )
        if self.positions and rng.random() < 0.15:
            r.position_ids = [rng.randrange(5000) for _ in range(n)]
            if rng.random() < 0.3:  # near the int32 edge: a few generated tokens overrun it
                r.position_ids[-1] = INT32_MAX - rng.randint(0, 12)
        if self.paged:
            per_beam = beam > 1 and rng.random() < 0.4
            r.kv_block_ids = [[] for _ in range(beam)] if per_beam else [[]]
        if self.enc:
            n_in = rng.randint(1, c.max_input_length)
            if rng.random() < 0.5:
                r.encoder_input_length = self.maybe_np(n_in, 0.2)
            else:
                r.encoder_input_ids = [self.token() for _ in range(n_in)]
            n_out = n_in
            if rng.random() < 0.5:
                n_out = rng.randint(1, c.max_encoder_length)
                r.encoder_output_length = self.maybe_np(n_out, 0.2)
            r.encoder_output = torch.tensor(
                [[rng.randint(-8, 7) for _ in range(c.encoder_hidden_size)] for _ in range(n_out)],
                dtype=c.model_dtype,
            )
            blocks = -(-n_out // self.tpb)
            lists = 1 if beam == 1 or rng.random() < 0.5 else beam
            r.cross_kv_block_ids = [
                [self.block_id() for _ in range(blocks + rng.randint(0, 1))][
                    : c.max_cross_blocks_per_seq
                ]
                for _ in range(lists)
            ]
            if rng.random() < 0.2:
                rows, cols = rng.randint(1, 50), rng.randint(1, n_in)
                r.cross_attention_mask = np.asarray(
                    [rng.random() < 0.7 for _ in range(rows * cols)]
                ).reshape(rows, cols)
            r.skip_cross_attn_blocks = rng.random() < 0.3
        if self.lora and rng.random() < 0.6:
            keys = [(m, layer) for m in c.lora_modules for layer in range(c.num_layers)]
            rows = []
            for m, layer in rng.sample(keys, rng.randint(1, 5)):
                scale = None if rng.random() < 0.5 else rng.randint(1, 2**40)
                rows.append(
                    (
                        m,
                        self.maybe_np(layer, 0.2),
                        rng.randint(0, 2**62),
                        rng.randint(0, 2**62),
                        scale,
                        rng.randint(0, 64),
                    )
                )
            r.lora_weights = rows
        x = Live(r, target=rng.randint(1, 30))
        self.live.append(x)
        return x

    # ------------------------------------------------------------------ KV blocks
    def needed_blocks(self, tokens: int) -> int:
        return -(-min(tokens, self.width * self.tpb) // self.tpb)

    def ensure_blocks(self, blocks: list, tokens: int, extra: int = 0) -> None:
        """Grow `blocks` (in place, one id at a time) until it covers `tokens`."""
        want = min(self.needed_blocks(tokens) + extra, self.width)
        while len(blocks) < want:
            blocks.append(self.maybe_np(self.block_id(), 0.05))

    def sequence_tokens(self, r, is_context: bool) -> list[int]:
        """Tokens of each sequence after this step (context: one sequence)."""
        drafts = len(r.draft_tokens) if r.draft_tokens is not None else 0
        if is_context:
            begin = int(r.context_position)
            chunk = (
                len(r.prompt) - begin if r.context_chunk_size is None else int(r.context_chunk_size)
            )
            last = begin + chunk == len(r.prompt)
            return [begin + chunk + (drafts if last else 0)]
        return [len(r.prompt) + len(g) + drafts for g in r.generated]

    def cover(self, r, is_context: bool, extra: int = 0) -> None:
        if not self.paged:
            return
        tokens = self.sequence_tokens(r, is_context)
        lists = r.kv_block_ids
        if is_context:  # a context request is one sequence; keep every list in step
            for blocks in lists:
                self.ensure_blocks(blocks, tokens[0], extra)
        else:
            for k, t in enumerate(tokens):
                self.ensure_blocks(lists[k if len(lists) > 1 else 0], t, extra)

    # ------------------------------------------------------------------ steps
    def materialize(self) -> None:
        """Append the tokens sampled from the last step; finish the requests that are done."""
        for x in list(self.live):
            if x.pending is None:
                continue
            r = x.req
            if not r.generated:
                r.generated = [[] for _ in range(int(r.beam_width))]
            for beam, new in zip(r.generated, x.pending):
                beam.extend(new)
            x.pending = None
            if len(r.generated[0]) >= x.target or self.positions_past_int32(r, 0):
                self.live.remove(x)
                self.free.append(int(r.seq_slot))

    @staticmethod
    def positions_past_int32(r, more: int) -> bool:
        """Whether a generation request with explicit position ids, `more` tokens longer,
        has a position past the int32 range (its positions continue after the last one)."""
        p = r.position_ids
        return p is not None and int(p[-1]) + len(r.generated[0]) + more > INT32_MAX

    def advance_past_int32(self) -> bool:
        return any(self.positions_past_int32(r, 1) for r in self.last_gen)

    def plan_prepare(self) -> tuple[list, list]:
        rng, c = self.rng, self.c
        self.materialize()
        for _ in range(2):
            if self.free and (not self.live or rng.random() < 0.4):
                self.new_request()
        budget = c.max_num_tokens
        everyone = rng.random() < 0.8
        gen, ctx = [], []
        for x in self.live:
            r = x.req
            if not r.generated or (not everyone and rng.random() < 0.25):
                continue
            drafts = []
            exact = self.name == "medusa"  # a fixed tree: every generation request, K drafts
            if int(r.beam_width) == 1 and self.max_drafts and (exact or rng.random() < 0.25):
                n = self.max_drafts if exact else rng.randint(1, self.max_drafts)
                drafts = [self.token() for _ in range(n)]
            cost = int(r.beam_width) + len(drafts)
            if cost > budget:
                continue
            r.draft_tokens = drafts
            budget -= cost
            gen.append(r)
        recurrent = self.name == "mamba"  # whole prompts, context and generation apart
        if recurrent and gen and rng.random() < 0.5:
            budget = 0  # a generation step
        elif recurrent:
            gen, budget = [], c.max_num_tokens  # a context step
        for x in self.live:
            r = x.req
            if r.generated or budget < 1 or rng.random() < 0.1:
                continue
            begin = int(r.context_position)
            rest = len(r.prompt) - begin
            if recurrent and rest > budget:
                continue
            chunk = (
                rest
                if rest <= budget and (recurrent or rng.random() < 0.6)
                else rng.randint(1, min(rest, budget))
            )
            drafts = []
            last = begin + chunk == len(r.prompt)
            if last and int(r.beam_width) == 1 and self.max_drafts and rng.random() < 0.2:
                drafts = [self.token() for _ in range(rng.randint(1, self.max_drafts))]
                drafts = drafts[: budget - chunk]
                if r.position_ids is not None:  # drafts continue after the last position
                    drafts = drafts[: INT32_MAX - int(r.position_ids[-1])]
            r.context_chunk_size = (
                None if last and rng.random() < 0.5 else self.maybe_np(chunk, 0.1)
            )
            r.draft_tokens = drafts
            budget -= chunk + len(drafts)
            ctx.append(r)
        extra = 1 if rng.random() < 0.1 else 0
        for r in ctx:
            self.cover(r, True, extra)
        for r in gen:
            self.cover(r, False, extra)
        return ctx, gen

    def commit_prepare(self, ctx: list, gen: list) -> None:
        rng = self.rng
        by_req = {id(x.req): x for x in self.live}
        for r in ctx:
            x = by_req[id(r)]
            begin = int(r.context_position)
            chunk = (
                len(r.prompt) - begin if r.context_chunk_size is None else int(r.context_chunk_size)
            )
            r.context_position = begin + chunk
            r.context_chunk_size = None
            if begin + chunk == len(r.prompt):  # sample the first token(s) of each beam
                accepted = 1 + (rng.randint(0, len(r.draft_tokens)) if r.draft_tokens else 0)
                x.pending = [
                    [self.token() for _ in range(accepted)] for _ in range(int(r.beam_width))
                ]
            r.draft_tokens = []
        drafts = any(r.draft_tokens for r in gen)
        for r in gen:
            x = by_req[id(r)]
            accepted = 1 + (rng.randint(0, len(r.draft_tokens)) if r.draft_tokens else 0)
            x.pending = [[self.token() for _ in range(accepted)] for _ in r.generated]
            r.draft_tokens = []
        self.advanceable = bool(gen) and not ctx and not drafts and self.name in ADVANCES
        self.last_gen = list(gen)

    def plan_advance(self) -> list[int]:
        """The tokens of the next decode step, one per sequence; blocks the new tokens enter are
        appended to the block lists first."""
        by_req = {id(x.req): x for x in self.live}
        tokens = []
        for r in self.last_gen:
            x = by_req[id(r)]
            tokens += [p[0] for p in x.pending]
            if self.paged:
                lists = r.kv_block_ids
                for k, g in enumerate(r.generated):
                    self.ensure_blocks(
                        lists[k if len(lists) > 1 else 0], len(r.prompt) + len(g) + 1
                    )
        return tokens

    def commit_advance(self, applied: list[int]) -> None:
        """Append the tokens an accepted advance() took (one per sequence, in row order)."""
        by_req = {id(x.req): x for x in self.live}
        it = iter(applied)
        for r in self.last_gen:
            x = by_req[id(r)]
            for beam in r.generated:
                beam.append(next(it))
            x.pending = [[self.token()] for _ in r.generated]
