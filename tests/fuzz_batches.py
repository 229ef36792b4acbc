"""An adversarial batch fuzzer for ``RuntimeBuffers.prepare_step`` and ``advance`` (used by
tests/test_batch_fuzz.py).

A simulated client drives one family's buffers with realistic traffic: requests arrive, are
computed in context chunks, become generation requests (beams, draft tokens), decode in runs of
``advance()`` and finish, their paged-KV block lists growing as their sequences enter new blocks.
About half of the calls are mutated first: one value of the batch (or of the advance tokens) is
replaced by an invalid one (an edge of a dtype, a wrong type, an uncovered block list, a
duplicate slot, ...). Every call is then judged against the contract:

* a call either returns a Step or raises ``BatchError`` (any other exception is a crash);
* a rejected call leaves every tensor exactly as it was (and all state: the calls that follow
  are judged too);
* after every call, every tensor at its full capacity (padding included) equals a fresh
  ``RuntimeBuffers`` of the same Config that ran only the last successful step, and so do the
  step's views and sizes, and the views of a generation batch bucket (``buffers.views``);
* an invalid batch is never accepted, a valid one never rejected.

Mutations labelled MAYBE touch values the contract leaves open (a token the step does not read,
numpy arrays where lists are expected, bools): either outcome is fine, but not a crash, and an
accepted step must still equal a fresh one.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import math
import random
import reprlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from bufc.runtime import REPEAT_LAST, BatchError, Request
from bufc.runtime.decl import DEVICE, ENGINE, EXTERNAL, STATIC, Constant, Rule

VALID, INVALID, MAYBE = "valid", "invalid", "maybe"
INT32_MAX = 2**31 - 1
LORA_MODULES = ("attn_qkv", "attn_dense", "mlp_gate")
COMMON = dict(
    max_batch_size=6,
    max_beam_width=3,
    max_num_tokens=96,
    max_draft_tokens=3,
    vocab_size=1000,
    num_layers=4,
    max_attention_window=256,
)
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt": COMMON,
    # a 64-token window of 16 blocks and a pool of 64 blocks: sequences outgrow the window
    "llama": dict(COMMON, max_attention_window=64, tokens_per_block=4, num_kv_blocks=64),
    "gpt_lora": dict(
        COMMON, max_attention_window=128, tokens_per_block=8, lora_modules=LORA_MODULES
    ),
    "enc_dec": dict(
        COMMON,
        max_attention_window=64,
        tokens_per_block=4,
        max_input_length=16,
        max_encoder_length=16,
        encoder_hidden_size=8,
    ),
    "medusa": dict(
        COMMON, max_beam_width=1, max_attention_window=128, tokens_per_block=8, num_medusa_heads=2
    ),
    "mamba": dict(COMMON, max_beam_width=1, max_draft_tokens=0),
}
ADVANCES = {"gpt", "llama", "medusa", "mamba"}  # families whose every fill rule has an advance form
HISTORY = (ENGINE, EXTERNAL, STATIC)  # written by the engine, the decoder or the caller


def family(name: str):
    return importlib.import_module(f"bufc.generated.{name}")


def make_config(name: str, **overrides):
    mod = family(name)
    fields = {f.name for f in dataclasses.fields(mod.Config) if f.init}
    values = {**CONFIGS.get(name, COMMON), **overrides}
    return mod.Config(**{k: v for k, v in values.items() if k in fields})


def make_buffers(name: str, device: str = "cpu", device_tokens: bool | None = None, **overrides):
    return family(name).RuntimeBuffers(
        make_config(name, **overrides), device=device, device_tokens=device_tokens
    )


def index_limits(config) -> tuple[int, int]:
    """(valid, invalid): block ids below `valid` are good, ids from `invalid` on are not: the
    pool's size (num_kv_blocks), or without one the int32 KVCacheIndex encoding, ids below
    (2**31 - 2) // (2 * num_local_layers). That id itself still encodes (its V index is
    2**31 - 7 with 4 layers), so it is left open (MAYBE)."""
    if getattr(config, "num_kv_blocks", 0):
        return config.num_kv_blocks, config.num_kv_blocks
    limit = (2**31 - 2) // (2 * config.num_local_layers)
    return limit, limit + 1


# ------------------------------------------------------------------------------ comparing
def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)}/{got.dtype} vs {tuple(want.shape)}/{want.dtype}"
    diff = (got != want).flatten().nonzero()
    i = int(diff[0]) if len(diff) else -1
    return f"first at flat {i}: {got.flatten()[i].item()} vs {want.flatten()[i].item()}"


def diff_tensors(buffers, ref, ref_sizes) -> list[str]:
    """Every tensor of `buffers` at capacity against `ref`, a fresh RuntimeBuffers that ran only
    the last successful step (of sizes `ref_sizes`; None: it ran nothing). Engine, external and
    static tensors are skipped; device rules that leave the rows of absent requests as they are
    (encoder_output, prompt tables, M-RoPE tables) are compared over the used prefix."""
    out = []
    got, want = buffers.tensors, ref.tensors
    for name, d in buffers.decls.items():
        if any(d.fill is h for h in HISTORY):
            continue
        g, w = got[name], want[name]
        if d.memory == DEVICE and isinstance(d.fill, Rule) and ref_sizes is not None:
            n = math.prod(d.shape(buffers.config, ref_sizes))
            g, w = g.flatten()[:n], w.flatten()[:n]
        if not torch.equal(g, w):
            out.append(f"tensor {name}: {_first_difference(g, w)}")
    return out


def diff_tensors_exact(buffers, before: dict[str, torch.Tensor]) -> list[str]:
    """Every tensor against a snapshot taken before the call (a rejected call writes nothing)."""
    return [
        f"tensor {name} changed: {_first_difference(t, before[name])}"
        for name, t in buffers.tensors.items()
        if not torch.equal(t, before[name])
    ]


def diff_views(got: dict, want: dict, what: str) -> list[str]:
    out = []
    if sorted(got) != sorted(want):
        return [f"{what} names {sorted(got)} vs {sorted(want)}"]
    for key, w in want.items():
        g = got[key]
        if g.shape != w.shape or not torch.equal(g, w):
            out.append(f"{what}[{key}]: {_first_difference(g, w)}")
    return out


def diff_step(step, ref_step) -> list[str]:
    out = diff_views(step.inputs, ref_step.inputs, "step.inputs")
    out += diff_views(step.outputs, ref_step.outputs, "step.outputs")
    if step.sizes != ref_step.sizes:
        out.append(f"step.sizes {step.sizes} vs {ref_step.sizes}")
    if step.scalars != ref_step.scalars:
        out.append(f"scalars {dict(step.scalars)} vs {dict(ref_step.scalars)}")
    return out


def bucket_pad_problems(buffers, ref_step, bucket) -> list[str]:
    """The views of `bucket` (a generation batch bucket of the step `ref_step`) against the
    step's views: along the one dimension that grows with the bucket, the step's rows hold the
    step's values and the rows past the batch their pad values."""
    inputs, _ = buffers.views(bucket)
    tensor_of = {
        engine_name: d.name
        for d in buffers.decls.values()
        for b in d.inputs
        for engine_name, _ in b.expand(buffers.config)
    }
    out = []
    for engine_name, view in inputs.items():
        d = buffers.decls[tensor_of.get(engine_name, engine_name)]
        if isinstance(d.fill, Constant) or any(d.fill is h for h in HISTORY):
            continue
        step_view = ref_step.inputs[engine_name]
        grown = [k for k, (a, b) in enumerate(zip(view.shape, step_view.shape)) if a != b]
        if view.dim() != step_view.dim() or len(grown) > 1:
            out.append(
                f"bucket view {engine_name}: shape {tuple(view.shape)} vs the step's "
                f"{tuple(step_view.shape)}"
            )
            continue
        if not grown:
            if not torch.equal(view, step_view):
                out.append(f"bucket view {engine_name}: {_first_difference(view, step_view)}")
            continue
        k, n = grown[0], step_view.shape[grown[0]]
        used, rest = view.narrow(k, 0, n), view.narrow(k, n, view.shape[k] - n)
        if not torch.equal(used, step_view):
            out.append(
                f"bucket view {engine_name}{tuple(view.shape)}: its first {n} rows differ from "
                f"the step's ({_first_difference(used, step_view)})"
            )
            continue
        pad = d.pad
        if pad == REPEAT_LAST:  # a cumulative tensor: its last value, 0 after an empty step
            pad = step_view.flatten()[-1].item() if step_view.numel() else 0
        if pad is not None and rest.numel() and not bool((rest == pad).all()):
            bad = rest.flatten()[(rest != pad).flatten().nonzero()[0]].item()
            out.append(
                f"bucket view {engine_name}: a row past the batch holds {bad}, not its pad {pad}"
            )
    return out


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


# ------------------------------------------------------------------------------ bad values
def bad_ints(low: int, high: int) -> list[Any]:
    """Integers outside [low, high) at the edges of every dtype, and values of wrong types."""
    edges = [low - 1, high, high + 1, 2**31 - 1, 2**31, 2**32 + 1, 2**63 - 1, 2**63, 2**64]
    edges += [-1, -(2**31) - 1, -(2**63), -(2**64), np.int64(-1)]
    if high < 2**63:
        edges.append(np.int64(high))
    edges = [v for v in edges if not low <= v < high]
    return edges + ["5", None, 2.0, 1.5, float("nan"), float("inf"), np.float64(3.0), [1], b"1"]


def _pick(rng, lst):
    return rng.randrange(len(lst)) if lst else None


def _own(lst: list, i: int):
    """Replace request i of the scheduled list by a deep copy (the live request is untouched)."""
    lst[i] = copy.deepcopy(lst[i])
    return lst[i]


@dataclasses.dataclass
class Plan:
    ctx: list
    gen: list
    client: Client
    rng: random.Random

    def any_request(self, want: str = "any"):
        """(list, index) of a random scheduled request ('ctx', 'gen' or 'any'), or None."""
        choices = []
        if want in ("any", "ctx"):
            choices += [(self.ctx, i) for i in range(len(self.ctx))]
        if want in ("any", "gen"):
            choices += [(self.gen, i) for i in range(len(self.gen))]
        return self.rng.choice(choices) if choices else None

    def chunk_range(self, r) -> range:
        begin = int(r.context_position)
        n = len(r.prompt) - begin if r.context_chunk_size is None else int(r.context_chunk_size)
        return range(begin, begin + n)

    def last_chunk(self, r) -> bool:
        return self.chunk_range(r).stop == len(r.prompt)


Mutator = Callable[[Plan], "tuple[str, str] | None"]
MUTATORS: list[tuple[Mutator, set[str] | None]] = []


def mutator(families: set[str] | None = None):
    def register(f: Mutator) -> Mutator:
        MUTATORS.append((f, families))
        return f

    return register


PAGED = {"llama", "gpt_lora", "enc_dec", "medusa"}


@mutator()
def prompt_token_in_chunk(p: Plan):
    at = p.any_request("ctx")
    if at is None:
        return None
    r = _own(*at)
    i = p.rng.choice(p.chunk_range(r))
    v = p.rng.choice(bad_ints(0, p.client.vocab))
    r.prompt = list(r.prompt)
    r.prompt[i] = v
    return INVALID, f"context prompt[{i}] (in the chunk) = {v!r}"


@mutator()
def prompt_token_outside_chunk(p: Plan):
    at = p.any_request("ctx")
    if at is None:
        return None
    r = _own(*at)
    outside = [i for i in range(len(r.prompt)) if i not in p.chunk_range(r)]
    if not outside:
        return None
    i = p.rng.choice(outside)
    v = p.rng.choice(bad_ints(0, p.client.vocab))
    r.prompt = list(r.prompt)
    r.prompt[i] = v
    return MAYBE, f"context prompt[{i}] (not read this step) = {v!r}"


@mutator()
def last_generated_token(p: Plan):
    at = p.any_request("gen")
    if at is None:
        return None
    in_place = p.rng.random() < 0.5  # the reuse path: the same request objects as last step
    r = at[0][at[1]] if in_place else _own(*at)
    k = p.rng.randrange(len(r.generated))
    v = p.rng.choice(bad_ints(0, p.client.vocab))
    if not in_place:
        r.generated = [list(g) for g in r.generated]
    r.generated[k][-1] = v
    return INVALID, f"generated[{k}][-1] = {v!r}" + (" (in place)" if in_place else "")


@mutator()
def older_generated_token(p: Plan):
    at = p.any_request("gen")
    if at is None:
        return None
    r = _own(*at)
    k = p.rng.randrange(len(r.generated))
    if len(r.generated[k]) < 2:
        return None
    r.generated = [list(g) for g in r.generated]
    i = p.rng.randrange(len(r.generated[k]) - 1)
    v = p.rng.choice(bad_ints(0, p.client.vocab))
    r.generated[k][i] = v
    return MAYBE, f"generated[{k}][{i}] (not read this step) = {v!r}"


@mutator()
def generation_prompt_token(p: Plan):
    at = p.any_request("gen")
    if at is None:
        return None
    r = _own(*at)
    r.prompt = list(r.prompt)
    i = p.rng.randrange(len(r.prompt))
    v = p.rng.choice(bad_ints(0, p.client.vocab))
    r.prompt[i] = v
    return MAYBE, f"generation request's prompt[{i}] (not read this step) = {v!r}"


@mutator()
def draft_token(p: Plan):
    read = [
        (lst, i)
        for lst, i in [(p.ctx, i) for i in range(len(p.ctx))]
        + [(p.gen, i) for i in range(len(p.gen))]
        if lst[i].draft_tokens and (lst is p.gen or p.last_chunk(lst[i]))
    ]
    if not read:
        return None
    lst, at = p.rng.choice(read)
    r = lst[at] if p.rng.random() < 0.4 else _own(lst, at)  # in place: the reuse path
    r.draft_tokens = list(r.draft_tokens)
    i = p.rng.randrange(len(r.draft_tokens))
    v = p.rng.choice(bad_ints(0, p.client.vocab))
    r.draft_tokens[i] = v
    return INVALID, f"draft_tokens[{i}] = {v!r}"


@mutator()
def too_many_drafts(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r = _own(*at)
    if int(r.beam_width) != 1:
        return None
    n = p.client.max_drafts + 1 + p.rng.choice([0, 0, 5])
    r.draft_tokens = [1] * n
    if p.client.paged:
        p.client.cover(r, at[0] is p.ctx)
    return INVALID, f"{n} draft tokens (max_draft_tokens={p.client.max_drafts})"


@mutator()
def drafts_with_beams(p: Plan):
    at = p.any_request()
    if at is None or int(at[0][at[1]].beam_width) < 2:
        return None
    r = _own(*at)
    r.draft_tokens = [1]
    return INVALID, f"a draft token with beam_width {r.beam_width}"


@mutator()
def unequal_beams(p: Plan):
    at = p.any_request("gen")
    if at is None or len(at[0][at[1]].generated) < 2:
        return None
    r = at[0][at[1]] if p.rng.random() < 0.5 else _own(*at)
    k = p.rng.randrange(len(r.generated))
    if len(r.generated[k]) > 1 and p.rng.random() < 0.5:
        r.generated[k].pop()
    else:
        r.generated[k].append(5)
    return INVALID, f"beam {k} of {len(r.generated)} has {len(r.generated[k])} tokens"


@mutator()
def malformed_beams(p: Plan):
    at = p.any_request("gen")
    if at is None:
        return None
    r = _own(*at)
    bw = int(r.beam_width)
    choice = p.rng.randrange(5)
    if choice == 0:
        r.generated = [[] for _ in range(bw)]
    elif choice == 1:
        r.generated = []
    elif choice == 2:
        r.generated = None
    elif choice == 3:
        r.generated = [list(g) for g in r.generated] + [[5]]
    else:
        if bw < 2:
            return None
        r.generated = [list(g) for g in r.generated][:-1]
    return INVALID, f"beam_width {bw} with generated={r.generated!r:.60}"


@mutator()
def beam_width_value(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r = _own(*at)
    v = p.rng.choice(bad_ints(1, p.client.max_beam + 1) + [float(int(r.beam_width))])
    r.beam_width = v
    return INVALID, f"beam_width = {v!r}"


@mutator()
def beam_width_zero_without_beams(p: Plan):
    at = p.any_request("gen")
    if at is None:
        return None
    r = _own(*at)
    r.beam_width, r.generated = 0, []
    return INVALID, "beam_width 0 and no beams"


@mutator()
def slot_value(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r = _own(*at)
    v = p.rng.choice(bad_ints(0, p.client.c.max_batch_size) + [100, float(int(r.seq_slot))])
    r.seq_slot = v
    return INVALID, f"seq_slot = {v!r} (max_batch_size {p.client.c.max_batch_size})"


@mutator()
def duplicate_slot(p: Plan):
    if len(p.ctx) + len(p.gen) < 2:
        return None
    at = p.any_request()
    others = [r for r in p.ctx + p.gen if r is not at[0][at[1]]]
    r = _own(*at)
    v = p.rng.choice(others).seq_slot
    r.seq_slot = np.int64(v) if p.rng.random() < 0.3 else int(v)
    return INVALID, f"seq_slot {v} twice"


@mutator()
def same_request_twice(p: Plan):
    if not p.gen:
        return None
    p.gen.append(p.gen[p.rng.randrange(len(p.gen))])
    return INVALID, "a generation request scheduled twice"


@mutator()
def context_position_value(p: Plan):
    at = p.any_request("ctx")
    if at is None:
        return None
    r = _own(*at)
    n = len(r.prompt)
    v = p.rng.choice(bad_ints(0, n) + [float(int(r.context_position)), n + 3])
    r.context_position = v
    return INVALID, f"context_position = {v!r} (prompt of {n})"


@mutator()
def chunk_size_value(p: Plan):
    at = p.any_request("ctx")
    if at is None:
        return None
    r = _own(*at)
    rest = len(r.prompt) - int(r.context_position)
    chunk = rest if r.context_chunk_size is None else int(r.context_chunk_size)
    v = p.rng.choice([v for v in bad_ints(1, rest + 1) if v is not None] + [float(chunk), 0])
    r.context_chunk_size = v
    return INVALID, f"context_chunk_size = {v!r} ({rest} tokens left)"


@mutator({"gpt", "llama", "gpt_lora", "enc_dec", "medusa"})
def position_ids_length(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r = _own(*at)
    n = len(r.prompt) + p.rng.choice([-1, 1, 5])
    if n < 1:
        return None
    r.position_ids = list(range(n))
    return INVALID, f"{n} position_ids for a prompt of {len(r.prompt)}"


@mutator({"gpt", "llama", "gpt_lora", "enc_dec", "medusa"})
def position_id_value(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    is_ctx = at[0] is p.ctx
    r = _own(*at)
    n = len(r.prompt)
    r.position_ids = list(range(n))
    if is_ctx:
        read = list(p.chunk_range(r))
        if r.draft_tokens and p.last_chunk(r):
            read.append(n - 1)
    else:
        read = [n - 1]
    i = p.rng.randrange(n)
    values = [v for v in bad_ints(0, 2**31) if not isinstance(v, float) or v == v]
    v = p.rng.choice(values + [-5])
    r.position_ids[i] = v
    label = INVALID if i in read else MAYBE
    return label, f"position_ids[{i}] = {v!r}" + ("" if i in read else " (not read this step)")


@mutator()
def prompt_value(p: Plan):
    at = p.any_request("ctx")
    if at is None:
        return None
    r = _own(*at)
    v = p.rng.choice([[], None, "abc", 7])
    r.prompt, r.context_position, r.context_chunk_size = v, 0, None
    return INVALID, f"prompt = {v!r}"


@mutator()
def context_with_generated(p: Plan):
    at = p.any_request("ctx")
    if at is None:
        return None
    r = _own(*at)
    r.generated = [[3]] * int(r.beam_width)
    return INVALID, "a context request with generated tokens"


@mutator()
def over_capacity(p: Plan):
    c = p.client.c
    if p.rng.random() < 0.5:
        n = c.max_batch_size + 1 - len(p.gen)
        p.ctx[:] = [Request(seq_slot=1000 + i, prompt=[1], kv_block_ids=[[1]]) for i in range(n)]
        return INVALID, f"{n + len(p.gen)} requests (max_batch_size {c.max_batch_size})"
    n = c.max_num_tokens + 1
    blocks = [[1] * min(p.client.width, -(-n // p.client.tpb))] if p.client.paged else None
    p.ctx.append(Request(seq_slot=999, prompt=[1] * n, kv_block_ids=blocks))
    return INVALID, f"a prompt of {n} tokens (max_num_tokens {c.max_num_tokens})"


@mutator()
def numpy_arrays(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r = _own(*at)
    field = p.rng.choice(["prompt", "generated", "draft_tokens", "position_ids"])
    value = getattr(r, field)
    if value is None or (field == "generated" and not value):
        return None
    if field == "generated":
        r.generated = [np.asarray(g, dtype=np.int64) for g in value]
    else:
        setattr(r, field, np.asarray(value, dtype=np.int64))
    return MAYBE, f"{field} as numpy arrays"


@mutator()
def bool_values(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r = _own(*at)
    if at[0] is p.ctx:
        r.prompt = list(r.prompt)
        r.prompt[p.rng.choice(p.chunk_range(r))] = True
    else:
        r.generated = [list(g) for g in r.generated]
        r.generated[0][-1] = False
    return MAYBE, "a bool token"


# ---- paged KV
def _sequence_list(p: Plan, at):
    """(request, the block list of one of its sequences, that sequence's token count): the
    live request, edited in place (the runtime converts only the lists that changed since
    the last step), or a copy."""
    is_ctx = at[0] is p.ctx
    if p.rng.random() < 0.4:
        r = at[0][at[1]]
    else:
        r = _own(*at)
        r.kv_block_ids = [list(b) for b in r.kv_block_ids]
    tokens = p.client.sequence_tokens(r, is_ctx)
    k = 0 if is_ctx else p.rng.randrange(len(tokens))
    lists = r.kv_block_ids
    return r, lists[k if len(lists) > 1 else 0], tokens[k]


@mutator(PAGED)
def kv_list_shape(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    if p.rng.random() < 0.3 and len(at[0][at[1]].kv_block_ids) == 1:  # in place, live request
        at[0][at[1]].kv_block_ids[0].clear()
        return INVALID, "kv_block_ids [[]] (cleared in place)"
    r = _own(*at)
    v = p.rng.choice([[[]], [], None, [[]] * (int(r.beam_width) + 1), [[1]] * 2, "abc"])
    if v == [[1]] * 2 and int(r.beam_width) == 2:
        return None
    r.kv_block_ids = v
    return INVALID, f"kv_block_ids = {v!r} (beam_width {r.beam_width})"


@mutator(PAGED)
def kv_uncovered(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r, blocks, tokens = _sequence_list(p, at)
    need = p.client.needed_blocks(tokens)
    keep = p.rng.randint(0, need - 1)
    del blocks[keep:]
    return INVALID, f"{keep} KV blocks for {tokens} tokens (needs {need})"


@mutator(PAGED)
def kv_too_long(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r, blocks, tokens = _sequence_list(p, at)
    blocks.extend([1] * (p.client.width + 1 - len(blocks)))
    return INVALID, f"{len(blocks)} KV blocks (max_blocks_per_seq {p.client.width})"


@mutator(PAGED)
def kv_block_id(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r, blocks, tokens = _sequence_list(p, at)
    i = p.rng.randrange(len(blocks))
    if p.client.limit != p.client.bad_limit and p.rng.random() < 0.1:
        blocks[i] = p.client.limit
        return MAYBE, f"KV block id {p.client.limit} (the int32 encoding edge)"
    if p.rng.random() < 0.25:  # equal by value to the id it replaces: still not an int
        v = p.rng.choice([float(blocks[i]), np.float64(blocks[i])])
        blocks[i] = v
        where = "in place" if r is at[0][at[1]] else "on a copy"
        # A generation list equal by value to the one its kept row was built from keeps that
        # row (the bytes written are the checked ones; steady steps re-read no list); a new
        # context list is converted and refused. Either outcome is right.
        return MAYBE, f"KV block id {v!r} ({where}, equal to the int it replaces)"
    v = p.rng.choice(bad_ints(0, p.client.bad_limit))
    blocks[i] = v
    return INVALID, f"a KV block id {v!r} (ids below {p.client.limit})"


@mutator(PAGED)
def kv_numpy(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r = _own(*at)
    lengths = {len(b) for b in r.kv_block_ids}
    if len(lengths) != 1:
        return None
    r.kv_block_ids = np.asarray([list(b) for b in r.kv_block_ids], dtype=np.int64)
    return MAYBE, "kv_block_ids as a 2-D numpy array"


# ---- encoder-decoder
@mutator({"enc_dec"})
def encoder_output_length_value(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r = _own(*at)
    c = p.client.c
    v = p.rng.choice([v for v in bad_ints(1, c.max_encoder_length + 1) if v is not None] + [0])
    r.encoder_output_length = v
    if isinstance(v, int) and 0 < v < 100 and r.encoder_output is not None:
        r.encoder_output = torch.zeros(v, c.encoder_hidden_size, dtype=c.model_dtype)
    return INVALID, f"encoder_output_length = {v!r} (max_encoder_length {c.max_encoder_length})"


@mutator({"enc_dec"})
def encoder_input_length_value(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r = _own(*at)
    c = p.client.c
    if r.encoder_output_length is None:
        r.encoder_output_length = r.encoder_output.shape[0] if r.encoder_output is not None else 1
    if p.rng.random() < 0.3:
        v = p.rng.choice([[], [7] * (c.max_input_length + 1)])
        r.encoder_input_ids, r.encoder_input_length = v, None
        return INVALID, f"{len(v)} encoder_input_ids (max_input_length {c.max_input_length})"
    v = p.rng.choice([v for v in bad_ints(1, c.max_input_length + 1) if v is not None] + [0, -1])
    r.encoder_input_length = v
    return INVALID, f"encoder_input_length = {v!r} (max_input_length {c.max_input_length})"


@mutator({"enc_dec"})
def cross_kv(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r = _own(*at)
    c = p.client.c
    n_out = r.encoder_output_length
    if n_out is None:
        n_out = r.encoder_input_length or len(r.encoder_input_ids)
    need = -(-int(n_out) // c.tokens_per_block)
    lists = [list(b) for b in r.cross_kv_block_ids]
    choice = p.rng.randrange(4)
    if choice == 0:
        r.cross_kv_block_ids = p.rng.choice([[[]], [], None])
        return INVALID, f"cross_kv_block_ids = {r.cross_kv_block_ids!r}"
    if choice == 1:
        k = p.rng.randint(0, need - 1)
        r.cross_kv_block_ids = [b[:k] for b in lists]
        return INVALID, f"{k} cross KV blocks for an encoder output of {n_out} (needs {need})"
    if choice == 2:
        r.cross_kv_block_ids = [[1] * (c.max_cross_blocks_per_seq + 1)]
        return INVALID, f"{c.max_cross_blocks_per_seq + 1} cross KV blocks"
    v = p.rng.choice(bad_ints(0, p.client.bad_limit))
    lists[0][p.rng.randrange(len(lists[0]))] = v
    r.cross_kv_block_ids = lists
    return INVALID, f"a cross KV block id {v!r}"


@mutator({"enc_dec"})
def encoder_output_missing(p: Plan):
    at = p.any_request("ctx")
    if at is None:
        return None
    r = _own(*at)
    r.encoder_output = None
    return INVALID, "a context request without its encoder_output"


# ---- LoRA
@mutator({"gpt_lora"})
def lora_row(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    live = at[0][at[1]]
    in_place = live.lora_weights is not None and p.rng.random() < 0.4
    r = live if in_place else _own(*at)
    c = p.client.c
    rows = [list(row) for row in r.lora_weights or [("attn_qkv", 0, 1, 2, None, 4)]]
    row = rows[p.rng.randrange(len(rows))]
    field = p.rng.randrange(9)
    if field == 0:
        row[0] = p.rng.choice(["mlp_4h_to_h", None, 1, ""])
    elif field == 1:
        row[1] = p.rng.choice(bad_ints(0, c.num_layers))
    elif field in (2, 3):
        row[field] = p.rng.choice(bad_ints(0, 2**63))
    elif field == 4:
        row[4] = p.rng.choice([v for v in bad_ints(0, 2**63) if v is not None])
    elif field == 5:
        row[5] = p.rng.choice(bad_ints(0, 2**31))
    elif field == 6:
        rows[0] = rows[0][:5] if p.rng.random() < 0.5 else rows[0] + [0]
    elif field == 7 and in_place:  # a float equal to the int it replaces
        k = p.rng.choice([1, 2, 3, 5])
        row[k] = float(row[k])
    else:
        r.lora_weights = p.rng.choice([[], "abc", [None]])
        return INVALID, f"lora_weights = {r.lora_weights!r}"
    if in_place:  # the same list object, edited: the runtime must see the edit
        r.lora_weights[:] = [tuple(x) for x in rows]
        return INVALID, f"lora row {tuple(row)!r:.80} (edited in place)"
    r.lora_weights = [tuple(x) for x in rows]
    return INVALID, f"lora row {tuple(row)!r:.80}"


@mutator({"enc_dec"})
def encoder_lengths_in_place(p: Plan):
    """A live generation request's encoder lengths changed in place (the reuse path)."""
    at = p.any_request("gen")
    if at is None:
        return None
    r = at[0][at[1]]
    c = p.client.c
    if p.rng.random() < 0.5:
        v = p.rng.choice([0, -1, c.max_encoder_length + 1, 2**31, 2**64, 2.0, "3"])
        r.encoder_output_length = v
        return INVALID, f"encoder_output_length = {v!r} (in place)"
    v = p.rng.choice([0, -1, c.max_input_length + 1, 2**32 + 1, 1.0, None])
    r.encoder_input_length = v
    if v is None:
        r.encoder_input_ids = None
    return INVALID, f"encoder_input_length = {v!r} (in place)"


@mutator({"enc_dec"})
def encoder_output_value(p: Plan):
    at = p.any_request("ctx")
    if at is None:
        return None
    r = _own(*at)
    c = p.client.c
    t = r.encoder_output
    rows, h = t.shape
    choice = p.rng.randrange(6)
    if choice == 0:
        r.encoder_output = torch.zeros(rows, h + 1, dtype=c.model_dtype)
    elif choice == 1:
        r.encoder_output = torch.zeros(rows * h, dtype=c.model_dtype)
    elif choice == 2:
        r.encoder_output = t.tolist()
    elif choice == 3:
        r.encoder_output = "abc"
    elif choice == 4:
        r.encoder_output = t.numpy()
        return MAYBE, "encoder_output as a numpy array"
    else:
        r.encoder_output = t.to(torch.float32 if c.model_dtype != torch.float32 else torch.float16)
        return MAYBE, f"encoder_output of dtype {r.encoder_output.dtype}"
    return INVALID, f"encoder_output = {reprlib.repr(r.encoder_output)}"


@mutator({"enc_dec"})
def cross_attention_mask_value(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    r = _own(*at)
    n_in = r.encoder_input_length
    n_in = len(r.encoder_input_ids) if n_in is None else int(n_in)
    widest = max(
        (
            len(x.encoder_input_ids)
            if x.encoder_input_length is None
            else int(x.encoder_input_length)
            for x in p.ctx + p.gen
        ),
        default=1,
    )
    choice = p.rng.randrange(5)
    if choice == 0:
        r.cross_attention_mask = np.ones((3, widest + 1), dtype=bool)
        return INVALID, f"cross_attention_mask of {widest + 1} columns (widest input {widest})"
    if choice == 1:
        r.cross_attention_mask = np.ones((0, n_in), dtype=bool)
        return INVALID, "cross_attention_mask without rows"
    if choice == 2:
        r.cross_attention_mask = np.ones(n_in, dtype=bool)
        return INVALID, "a 1-D cross_attention_mask"
    if choice == 3:
        r.cross_attention_mask = [[True] * n_in] * 2
        return MAYBE, "cross_attention_mask as nested lists"
    r.cross_attention_mask = np.full((2, n_in), 7, dtype=np.int64)
    return MAYBE, "cross_attention_mask of int64 values"


class _Namespace:
    """A request-like object (any object with the Request fields will do)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


@mutator()
def request_object(p: Plan):
    at = p.any_request()
    if at is None:
        return None
    lst, i = at
    fields = {f.name: copy.deepcopy(getattr(lst[i], f.name)) for f in dataclasses.fields(Request)}
    if p.rng.random() < 0.4:
        lst[i] = _Namespace(**fields)
        return MAYBE, "a request-like object that is not a Request"
    missing = p.rng.choice(["prompt", "seq_slot", "beam_width", "generated", "draft_tokens"])
    if lst is p.ctx and missing == "generated" or p.client.paged and p.rng.random() < 0.3:
        missing = "kv_block_ids" if p.client.paged else "prompt"
    del fields[missing]
    lst[i] = _Namespace(**fields)
    return INVALID, f"a request object without {missing}"


@mutator()
def request_lists(p: Plan):
    choice = p.rng.randrange(4)
    if choice == 0 and p.gen and p.ctx:
        p.ctx.append(p.gen[0])
        return INVALID, "one request in both lists"
    if choice == 1 and (p.ctx or p.gen):
        p.ctx.append(None)
        return INVALID, "None in the context list"
    if choice == 2 and p.gen:
        p.gen.append(5)
        return INVALID, "an int in the generation list"
    p.ctx.append("abc")
    return INVALID, "a str in the context list"


MUTATOR_NAMES = [f.__name__ for f, _ in MUTATORS]


def mutate_prepare(p: Plan, name: str):
    candidates = [f for f, fams in MUTATORS if fams is None or name in fams]
    for _ in range(10):
        f = p.rng.choice(candidates)
        done = f(p)
        if done is not None:
            return done[0], f"{f.__name__}: {done[1]}"
    return None


def mutate_advance(rng: random.Random, tokens: list[int], client: Client):
    """(tokens to pass, label, description); may edit the live requests (restored after)."""
    n = len(tokens)
    choice = rng.randrange(10)
    if choice == 0:
        i = rng.randrange(n)
        v = rng.choice(bad_ints(0, client.vocab))
        bad = list(tokens)
        bad[i] = v
        return bad, INVALID, f"advance token[{i}] = {v!r}"
    if choice == 1:
        v = torch.tensor(tokens)
        v[rng.randrange(n)] = rng.choice([client.vocab, -1, 2**31, 2**40])
        return v, INVALID, f"advance tokens tensor {v.tolist()}"
    if choice == 2:
        bad = list(tokens) + [1] if rng.random() < 0.5 else list(tokens)[:-1]
        return bad, INVALID, f"{len(bad)} advance tokens for {n} sequences"
    if choice == 3:
        v = rng.choice([None, "abc", [[1]] * (n + 1), [None] * n, [1.5] * n])
        return v, INVALID, f"advance({v!r})"
    if choice == 4 and client.paged:  # a sequence enters a block its list does not hold
        for r in client.last_gen:
            for k, g in enumerate(r.generated):
                t = len(r.prompt) + len(g) + 1
                lists = r.kv_block_ids
                blocks = lists[k if len(lists) > 1 else 0]
                if (t - 1) % client.tpb == 0 and len(blocks) == client.needed_blocks(t):
                    if t > client.width * client.tpb:
                        continue
                    blocks.pop()
                    return tokens, INVALID, f"advance into KV block {len(blocks)} not in the list"
        return None
    if choice in (5, 6):
        forms = [
            (np.asarray(tokens, dtype=np.int64), "int64 array"),
            (np.asarray(tokens, dtype=np.int32), "int32 array"),
            (torch.tensor(tokens, dtype=torch.int64), "int64 tensor"),
            ([np.int64(t) for t in tokens], "numpy int64 scalars"),
            (tuple(tokens), "tuple"),
        ]
        v, what = rng.choice(forms)
        return v, VALID, f"advance tokens as {what}"
    if choice == 7:
        forms = [
            (torch.tensor(tokens, dtype=torch.float32), "float tensor"),
            (np.asarray(tokens, dtype=np.float64), "float64 array"),
            ([float(t) for t in tokens], "floats"),
        ]
        v, what = rng.choice(forms)
        return v, INVALID, f"advance tokens as {what} (of integral values)"
    if choice == 8:
        forms = [
            (np.asarray(tokens, dtype=np.int64).reshape(n, 1), "an [n, 1] array"),
            ([bool(t % 2) for t in tokens], "bools"),
        ]
        v, what = rng.choice(forms)
        return v, MAYBE, f"advance tokens as {what}"
    return None


# ------------------------------------------------------------------------------ the fuzzer
@dataclasses.dataclass
class Counts:
    family: str
    tried: int = 0
    valid_accepted: int = 0
    invalid_rejected: int = 0
    maybe_accepted: int = 0
    maybe_rejected: int = 0
    advances: int = 0
    advances_after_a_rejection: int = 0
    bucket_checks: int = 0
    invalid_accepted: int = 0
    valid_rejected: int = 0
    crashes: int = 0
    corruptions: int = 0
    examples: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def note(self, kind: str, text: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        shown = self.examples.setdefault(kind, [])
        if len(shown) < 6:
            shown.append(text)

    @property
    def bad(self) -> int:
        return self.invalid_accepted + self.valid_rejected + self.crashes + self.corruptions

    def line(self) -> str:
        return (
            f"{self.family:9} tried {self.tried:4}  valid accepted {self.valid_accepted:4}  "
            f"invalid rejected {self.invalid_rejected:4}  maybe accepted/rejected "
            f"{self.maybe_accepted}/{self.maybe_rejected}  (advance calls {self.advances}, "
            f"{self.advances_after_a_rejection} right after a rejected call, "
            f"bucket checks {self.bucket_checks})  |  INVALID ACCEPTED {self.invalid_accepted}  "
            f"VALID REJECTED {self.valid_rejected}  CRASHES {self.crashes}  "
            f"CORRUPTIONS {self.corruptions}"
        )

    def report(self) -> str:
        lines = [self.line()]
        for kind, shown in self.examples.items():
            lines += [f"  {kind}:"] + [f"    {s}" for s in shown]
        return "\n".join(lines)


def _integral_block_ids(args: tuple) -> tuple:
    """`args` with block ids that are floats of integral value as ints (what a kept row holds)."""
    args = copy.deepcopy(args)
    for r in args[0] + args[1]:
        for field in ("kv_block_ids", "cross_kv_block_ids"):
            ids = getattr(r, field, None)
            if isinstance(ids, list):
                setattr(
                    r,
                    field,
                    [
                        [int(v) if isinstance(v, float) and v == int(v) else v for v in b]
                        if isinstance(b, list)
                        else b
                        for b in ids
                    ],
                )
    return args


class Fuzzer:
    def __init__(self, name: str, seed: int, p_mutate: float = 0.5) -> None:
        self.name = name
        self.rng = random.Random(seed)
        self.config = make_config(name)
        self.p_mutate = p_mutate
        self.counts = Counts(name)
        self.last_rejected = False
        self.client = Client(name, self.config, self.rng)
        self.reset()

    def new(self):
        return family(self.name).RuntimeBuffers(self.config)

    def reset(self) -> None:
        """Fresh buffers after a failure (so one bug is not counted on every later step)."""
        self.buffers = self.new()
        self.ref, self.ref_step = self.new(), None
        self.client.advanceable = False

    def ref_advanceable(self) -> bool:
        """Whether advance() may follow the last successful step."""
        s = self.ref_step and self.ref_step.sizes
        return bool(
            s
            and self.name in ADVANCES
            and s.num_sequences
            and not s.num_context_requests
            and s.num_tokens == s.num_sequences
        )

    def fresh(self, ctx, gen):
        ref = self.new()
        return ref, ref.prepare_step(ctx, gen)

    # ------------------------------------------------------------------ one call
    def run(self, calls: int) -> Counts:
        # one thread: torch parallelises copies of large tensors (the logits), which only costs
        # on a shared 2-core machine; the values do not depend on it
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for i in range(calls):
                self.call(i)
                if self.rng.random() < 0.3:
                    self.check_bucket(i)
        finally:
            torch.set_num_threads(threads)
        return self.counts

    def call(self, i: int) -> None:
        rng, client, counts = self.rng, self.client, self.counts
        saved = client.save()
        advance = client.advanceable and rng.random() < 0.5
        wrong_advance = not self.ref_advanceable() and rng.random() < 0.03
        label, what = VALID, "valid"
        tokens = ctx = gen = None
        if advance or wrong_advance:
            n = self.ref_step.sizes.num_sequences if self.ref_step else 1
            tokens = client.plan_advance() if advance else [1] * max(n, 1)
            if wrong_advance:
                label, what = INVALID, "advance() after a step it cannot follow"
            elif rng.random() < self.p_mutate:
                done = mutate_advance(rng, tokens, client)
                if done is not None:
                    tokens, label, what = done
            if advance and client.advance_past_int32():
                what = ("" if label == VALID else f"{what}; ") + "a position past int32"
                label = INVALID
            args = None
        else:
            ctx, gen = client.plan_prepare()
            if rng.random() < self.p_mutate:
                done = mutate_prepare(Plan(ctx, gen, client, rng), self.name)
                if done is not None:
                    label, what = done
            args = copy.deepcopy((ctx, gen))  # what the fresh buffers replay
        kind = "advance" if advance or wrong_advance else "prepare_step"
        where = f"call {i} ({kind}, {label}: {what})"
        before = {k: v.clone() for k, v in self.buffers.tensors.items()}
        counts.tried += 1
        counts.advances += kind == "advance"
        counts.advances_after_a_rejection += kind == "advance" and self.last_rejected
        self.last_rejected = False
        try:
            step = (
                self.buffers.advance(tokens)
                if kind == "advance"
                else self.buffers.prepare_step(ctx, gen)
            )
        except BatchError as exc:
            client.restore(saved)
            problems = diff_tensors_exact(self.buffers, before)
            problems += diff_tensors(self.buffers, self.ref, self.ref_step and self.ref_step.sizes)
            if problems:
                counts.note(
                    "corruptions", f"{where}: rejected ({exc}) but " + "; ".join(problems[:3])
                )
                self.reset()
            elif label == VALID:
                counts.note("valid_rejected", f"{where}: {exc}")
                if kind == "prepare_step":
                    client.drop(gen + ctx)
                client.advanceable = False
            elif label == MAYBE:
                counts.maybe_rejected += 1
            else:
                counts.invalid_rejected += 1
            self.last_rejected = True
            return
        except Exception as exc:  # noqa: BLE001 - the contract allows BatchError only
            client.restore(saved)
            changed = diff_tensors_exact(self.buffers, before)
            counts.note(
                "crashes",
                f"{where}: {type(exc).__name__}: {exc}"
                + (f" (and {len(changed)} tensors changed)" if changed else ""),
            )
            self.reset()
            return
        if label == INVALID:
            client.restore(saved)
            counts.note("invalid_accepted", f"{where}: accepted")
            self.reset()
            return
        # accepted: equal to a fresh RuntimeBuffers that ran only this step
        if kind == "advance":  # the equivalent requests: the tokens it took appended
            values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
            client.commit_advance([int(v) for v in np.asarray(values).reshape(-1)])
            args = ([], copy.deepcopy(client.last_gen))
        try:
            if label == MAYBE:  # a kept row's list equal by value: the fresh run gets the ints
                args = _integral_block_ids(args)
            ref, ref_step = self.fresh(*args)
        except Exception as exc:  # noqa: BLE001
            counts.note(
                "corruptions",
                f"{where}: accepted here, but a fresh RuntimeBuffers raises "
                f"{type(exc).__name__}: {exc}",
            )
            client.restore(saved)
            self.reset()
            return
        problems = diff_step(step, ref_step) + diff_tensors(self.buffers, ref, ref_step.sizes)
        if problems:
            counts.note("corruptions", f"{where}: " + "; ".join(problems[:4]))
            client.restore(saved)
            self.reset()
            return
        self.ref, self.ref_step = ref, ref_step
        if label == MAYBE:
            counts.maybe_accepted += 1
            if kind == "prepare_step":  # the buffers ran copies: the live requests did not move
                client.restore(saved)
                client.advanceable = False
            return
        counts.valid_accepted += 1
        if kind == "prepare_step":
            client.commit_prepare(ctx, gen)

    def check_bucket(self, i: int) -> None:
        """views() of a generation batch bucket: equal to the fresh buffers' views, with the
        rows past the batch holding their pad values."""
        s = self.ref_step and self.ref_step.sizes
        if not s or s.num_context_requests or s.num_tokens != s.num_sequences:
            return
        # a bucket counts requests of one sequence each, at most max_batch_size
        if s.num_sequences > self.config.max_batch_size:
            return
        rows = self.rng.randint(s.num_sequences, self.config.max_batch_size)
        bucket = s.generation_bucket(rows)
        self.counts.bucket_checks += 1
        if self.name == "gpt_lora" and rows != s.num_sequences:  # [.., sequences]: refused
            with pytest.raises(ValueError, match="cannot be padded to a bucket"):
                self.buffers.views(bucket)
            return
        try:
            got_in, got_out = self.buffers.views(bucket)
            want_in, want_out = self.ref.views(bucket)
            problems = diff_views(got_in, want_in, "bucket inputs")
            problems += diff_views(got_out, want_out, "bucket outputs")
            problems += bucket_pad_problems(self.buffers, self.ref_step, bucket)
        except Exception as exc:  # noqa: BLE001
            problems = [f"{type(exc).__name__}: {exc}"]
        if problems:  # (no reset: a layout problem of views() is not a damaged state)
            self.counts.note(
                "corruptions",
                f"after call {i}: views({rows}-row bucket): " + "; ".join(problems[:3]),
            )
