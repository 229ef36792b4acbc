"""The batch fuzz's mutations: bad values, the registry of mutators (each turns a planned batch
into an invalid or open one), and the mutators of a request's tokens, beams, drafts, slots,
positions, chunks and types (fuzz_feature_mutators.py registers the rest after them)."""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable
from typing import Any

import numpy as np
from fuzz_client import Client
from fuzz_configs import INVALID, MAYBE

from bufc.runtime import Request


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
