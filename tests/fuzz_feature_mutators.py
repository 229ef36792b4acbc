"""The batch fuzz's mutators of paged-KV block lists, encoder-decoder and LoRA inputs and
request objects, registered after fuzz_mutators.py's own (the registry's order is kept), and
the two entry points that draw from the whole registry: mutate_prepare and mutate_advance."""

from __future__ import annotations

import copy
import dataclasses
import random
import reprlib
from typing import Any

import numpy as np
import torch
from fuzz_client import Client
from fuzz_configs import INVALID, MAYBE, VALID
from fuzz_mutators import MUTATORS, PAGED, Plan, _own, bad_ints, mutator

from bufc.runtime import Request


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
