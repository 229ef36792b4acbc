"""Loop-by-loop references for the feature groups' fills (buffer-inventory.md §1.1-1.11,
§2.3.8-2.3.12), one request and one beam at a time, with no numpy and no code shared with
bufc.runtime. Where the reference has a bug that bufc fixes, the loop follows the fix and says so.
"""

from __future__ import annotations

import math

from reference import _begin, _chunk, _kv_row


def _last_chunk(r) -> bool:
    return _begin(r) + _chunk(r) == len(r.prompt)


def _drafts(r) -> int:
    return len(r.draft_tokens or ())


def sequences(ctx: list, gen: list) -> list:
    """(request, request index) of every row: context requests, then every generation beam."""
    rows = [(r, i) for i, r in enumerate(ctx)]
    for j, r in enumerate(gen):
        for _ in range(r.beam_width):
            rows.append((r, len(ctx) + j))
    return rows


def tokens_of(ctx: list, gen: list) -> list:
    """(request index, position) of every input token, in token order."""
    out = []
    for i, r in enumerate(ctx):
        n = _chunk(r) + (_drafts(r) if _last_chunk(r) else 0)
        for k in range(n):
            out.append((i, _begin(r) + k))
    for j, r in enumerate(gen):
        for beam in r.generated:
            last = len(r.prompt) + len(beam) - 1
            out.append((len(ctx) + j, last))
            for k in range(_drafts(r)):  # drafts ride on the single beam
                out.append((len(ctx) + j, last + 1 + k))
    return out


def enc_in(r) -> int:
    return (
        r.encoder_input_length if r.encoder_input_length is not None else len(r.encoder_input_ids)
    )


def enc_out(r) -> int:
    return r.encoder_output_length if r.encoder_output_length is not None else enc_in(r)


# ----------------------------------------------------------------------- cache indirection
def cache_indirection_copies(ctx, gen, max_beam_width, window) -> list:
    src, dst, size = [], [], []
    step_width = max((r.beam_width for r in gen), default=1)
    for i, r in enumerate(gen):
        src.append(r.seq_slot * max_beam_width * window)  # the decoder's slot stride (fixed)
        dst.append(i * step_width * window)  # row i of the [B, step beam width, window] input
        size.append(r.beam_width * window)
    return [src, dst, size]


def cache_indirection_decoder_copies(ctx, gen, max_beam_width, window) -> list:
    src, size = [], []
    for r in ctx + gen:
        src.append(r.seq_slot * max_beam_width * window)
        size.append(r.beam_width * window)
    return [src, list(src), size]


# ------------------------------------------------------------------------ encoder-decoder
def encoder_sizes(ctx, gen) -> dict:
    longest = 0
    for r in ctx + gen:
        longest = max(longest, enc_in(r))
    return {
        "num_encoder_tokens": sum(enc_out(r) for r in ctx),
        "num_encoder_input_tokens": sum(enc_in(r) for r in ctx),
        "max_encoder_input_length": max(1, longest),
    }


def encoder_output_lengths(ctx, gen) -> list:
    return [enc_out(r) for r, _ in sequences(ctx, gen)]


def cross_kv_offsets(ctx, gen, width, layers) -> list:
    rows = []
    for r in ctx:
        rows.append(_kv_row(r.cross_kv_block_ids[0], width, layers))
    for r in gen:
        for beam in range(r.beam_width):
            ids = r.cross_kv_block_ids
            rows.append(_kv_row(ids[beam] if len(ids) > 1 else ids[0], width, layers))
    return [rows]


def cross_attention_mask(ctx, gen) -> list:
    width = encoder_sizes(ctx, gen)["max_encoder_input_length"]
    reqs = ctx + gen
    out = []
    for i, p in tokens_of(ctx, gen):
        r = reqs[i]
        row = [True] * width
        if r.cross_attention_mask is not None:
            m = r.cross_attention_mask
            src = m[min(p, len(m) - 1)]  # one row per token (the reference: one per request)
            for j in range(len(src)):
                row[j] = bool(src[j])
        elif i < len(ctx):  # the padding mask of a context request without a mask
            for j in range(enc_in(r), width):
                row[j] = False
        out.append(row)
    return out


def skip_cross_attn_blocks(ctx, gen) -> list:
    reqs = ctx + gen
    skip = len(reqs) > 0
    for r in reqs:
        skip = skip and bool(r.skip_cross_attn_blocks)
    return [skip]


def encoder_engine(ctx) -> dict:
    ids, pos, lengths = [], [], []
    for r in ctx:
        for k, t in enumerate(r.encoder_input_ids):
            ids.append(t)
            pos.append(k)
        lengths.append(len(r.encoder_input_ids))
    return {"input_ids": ids, "position_ids": pos, "input_lengths": lengths}


# -------------------------------------------------------------------------------- LoRA
def lora(ctx, gen, modules, first_layer, num_layers) -> tuple[list, list]:
    n = len(sequences(ctx, gen))
    ptrs = [[[[0, 0, 0] for _ in range(n)] for _ in range(num_layers)] for _ in modules]
    ranks = [[[0] * n for _ in range(num_layers)] for _ in modules]
    seq = 0
    for r in ctx + gen:
        width = 1 if r in ctx else r.beam_width
        for module, layer, a, b, scale, rank in r.lora_weights or ():
            if not first_layer <= layer < first_layer + num_layers:
                continue
            m, local = modules.index(module), layer - first_layer
            for k in range(width):  # one row per sequence (the reference: per request, a bug)
                ptrs[m][local][seq + k] = [a, b, scale or 0]
                ranks[m][local][seq + k] = rank
        seq += width
    return ptrs, ranks


# ------------------------------------------------------------------------ prompt tuning
def prompt_tasks(ctx, gen) -> list:
    out = []
    reqs = ctx + gen
    for i, r in enumerate(reqs):
        task = i if r.prompt_table is not None else 0
        if i < len(ctx):
            n = _chunk(r) + (_drafts(r) if _last_chunk(r) else 0)
        else:
            n = r.beam_width + _drafts(r)  # drafts get their request's task (a reference bug)
        out += [task] * n
    return out


# ----------------------------------------------------------------- RNN, M-RoPE, adapters
def slot_mapping(ctx, gen) -> list:
    return [r.seq_slot for r, _ in sequences(ctx, gen)]


def mrope_position_deltas(ctx, gen) -> list:
    rows = []
    for r in gen:
        for _ in range(r.beam_width):
            rows.append([r.mrope_position_deltas])  # from row 0, as the reference and its plugin
    return rows + [[0] for _ in ctx]


def language_adapter_routings(ctx, gen) -> list:
    reqs = ctx + gen
    return [[reqs[i].language_adapter_uid] for i, _ in tokens_of(ctx, gen)]


# -------------------------------------------------------------------------------- Eagle
def posterior(ctx, gen) -> tuple[list, list]:
    thresholds = []
    for r, _ in sequences(ctx, gen):
        t = r.eagle_posterior_threshold
        thresholds.append(0.09 if t is None else t)
    return thresholds, [math.sqrt(t) for t in thresholds]


def chunked_context_next_tokens(ctx, gen) -> list:
    out = []
    for r in ctx:
        out.append(-1 if _last_chunk(r) else r.prompt[_begin(r) + _chunk(r)])
    for r in gen:
        out += [-1] * r.beam_width
    return out
