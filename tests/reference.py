"""A plain, loop-by-loop port of the reference's setBufferSizes / setFromInputs.

Written straight from buffer-inventory.md §2.2-§2.4 and runtimeBuffers.cpp, one request and
one beam at a time, with no numpy and no shared code with bufc.runtime: the differential
tests compare the generated modules against it. The one deliberate difference is the fix of
the reference's bug with explicit position ids on a last chunk with drafts (marked below).
"""

from __future__ import annotations

GLM_MASK_IDS = (50260, 50263, 50264)


def reference_step(
    variant: str,
    ctx: list,
    gen: list,
    *,
    vocab_size: int,
    world_size: int = 1,
    kv: tuple[int, int] | None = None,
) -> dict:
    """`kv` = (max_blocks_per_seq, num_local_layers) for a paged-KV family."""
    sizes = _buffer_sizes(ctx, gen)
    num_ctx, num_gen_seq = len(ctx), sizes["num_generation_sequences"]
    max_context_length = sizes["max_context_length"]

    # ---- setFromInputs
    request_types = [0] * num_ctx + [1] * num_gen_seq
    seq_slots = [r.seq_slot for r in ctx] + [r.seq_slot for r in gen]
    # the row map: one row per sequence, a request's beams share its slot
    row_slots = [r.seq_slot for r in ctx] + [r.seq_slot for r in gen for _ in range(r.beam_width)]
    input_ids: list[int] = []
    pos: list[int] = []
    pos2: list[int] = []
    context_lengths: list[int] = []
    sequence_lengths: list[int] = []
    past_kv: list[int] = []
    logits_ids: list[int] = []
    for r in ctx:
        begin, chunk = _begin(r), _chunk(r)
        drafts = list(r.draft_tokens or ())
        last_chunk = begin + chunk == len(r.prompt)
        total_before = len(input_ids)
        input_ids.extend(r.prompt[begin : begin + chunk])
        logits_ids.append(chunk)
        if last_chunk:
            input_ids.extend(drafts)
            logits_ids.extend([1] * len(drafts))
        input_length = chunk + (len(drafts) if last_chunk else 0)
        context_lengths.append(input_length)
        sequence_lengths.append(begin + input_length)
        past_kv.append(begin + input_length)
        if r.position_ids is not None:
            pos.extend(r.position_ids[begin : begin + chunk])
            if last_chunk:
                # FIX of the reference: it appends no positions for these drafts.
                for k in range(len(drafts)):
                    pos.append(r.position_ids[-1] + 1 + k)
        elif variant == "chatglm":
            row = list(range(input_length))
            row[-1] -= 1
            pos.extend(row)
            pos2.extend([0] * (input_length - 1) + [1])
        elif variant == "glm":
            mine = input_ids[total_before : total_before + input_length]
            mask = max_context_length
            for k, tok in enumerate(mine):
                if tok in GLM_MASK_IDS:
                    mask = k
                    break
            r.mask_position = mask
            row = list(range(input_length))
            row[-1] = mask
            pos.extend(row)
            pos2.extend([0] * (input_length - 1) + [1])
        else:
            pos.extend(range(begin, begin + input_length))
    for r in gen:
        drafts = list(r.draft_tokens or ())
        prompt_len = len(r.prompt)
        max_gen = max(len(g) for g in r.generated)
        sequence_len = prompt_len + max_gen
        for beam in range(r.beam_width):
            num_tokens = prompt_len + len(r.generated[beam])
            input_ids.append(r.generated[beam][-1])
            input_ids.extend(drafts)
            if r.position_ids is not None:
                pos.append(r.position_ids[-1] + sequence_len - prompt_len)
            elif variant == "chatglm":
                pos.append(prompt_len - 2)
                pos2.append(sequence_len - prompt_len + 1)
            elif variant == "glm":
                pos.append(r.mask_position)
                pos2.append(sequence_len - prompt_len + 1)
            else:
                pos.append(num_tokens - 1)
        for _ in range(r.beam_width):
            past_kv.append(sequence_len - 1)
        logits_ids.extend([1] * (len(drafts) + r.beam_width))
    for r in gen:
        max_gen = max(len(g) for g in r.generated)
        context_q = len(r.prompt) + len(r.draft_tokens or ())
        for _ in range(r.beam_width):
            context_lengths.append(context_q)
            sequence_lengths.append(context_q + max_gen)
    last_token_ids = []
    running = 0
    for n in logits_ids:
        running += n
        last_token_ids.append(running)

    padded_vocab = -(-vocab_size // world_size) * world_size
    longest = max(past_kv) if past_kv else 0
    out = {
        "sizes": sizes,
        "input_ids": input_ids,
        "context_lengths": context_lengths,
        "host_context_lengths": context_lengths,
        "sequence_length": sequence_lengths,
        "host_request_types": request_types,
        "host_past_key_value_lengths": past_kv,
        "last_token_ids": last_token_ids,
        "seq_slots": seq_slots,
        "row_slots": row_slots,
        "logits_shape": [sizes["num_logits"], padded_vocab],
        "max_kv_cache_length_rounded": -(-longest // 256) * 256,
    }
    out["position_ids"] = [pos, pos2] if variant in ("chatglm", "glm") else pos
    if kv is not None:
        out["kv_cache_block_offsets"] = [_kv_rows(ctx, gen, *kv)]
    return out


def _buffer_sizes(ctx: list, gen: list) -> dict:
    """setBufferSizes: the step's sizes, one request at a time."""
    num_ctx = len(ctx)
    ctx_logits = num_ctx
    num_ctx_tokens = 0
    max_context_length = 0
    for r in ctx:
        last_chunk = _begin(r) + _chunk(r) == len(r.prompt)
        d = len(r.draft_tokens or ()) if last_chunk else 0
        ctx_logits += d
        num_ctx_tokens += _chunk(r) + d
        max_context_length = max(max_context_length, len(r.prompt))
    num_gen_seq = 0
    num_gen_tokens = 0
    for r in gen:
        num_gen_seq += r.beam_width
        num_gen_tokens += len(r.draft_tokens or ()) + r.beam_width
    return {
        "num_context_requests": num_ctx,
        "num_context_tokens": num_ctx_tokens,
        "num_generation_requests": len(gen),
        "num_generation_sequences": num_gen_seq,
        "num_generation_tokens": num_gen_tokens,
        "num_logits": ctx_logits + num_gen_tokens,
        "num_sequences": num_ctx + num_gen_seq,
        "num_tokens": num_ctx_tokens + num_gen_tokens,
        "num_requests": num_ctx + len(gen),
        "max_context_length": max_context_length,
    }


def _kv_rows(ctx: list, gen: list, width: int, layers: int) -> list:
    # copyBlockOffsets, one sequence row per context request (the reference's beam > 1 rows for
    # a context request are overwritten by the next request: fixed) and per generation beam
    rows = []
    for r in ctx:
        rows.append(_kv_row(r.kv_block_ids[0], width, layers))
    for r in gen:
        for beam in range(r.beam_width):
            ids = r.kv_block_ids[beam] if len(r.kv_block_ids) > 1 else r.kv_block_ids[0]
            rows.append(_kv_row(ids, width, layers))
    return rows


def _kv_row(ids: list, width: int, layers: int) -> list:
    k = [0] * width
    v = [0] * width
    for j, block in enumerate(ids):
        k[j] = (
            block * layers + 0
        ) * 2 + 0  # flat_index3(block, layer 0, field, layers, kvFactor 2)
        v[j] = (block * layers + 0) * 2 + 1
    return [k, v]


def _begin(r) -> int:
    return r.context_position


def _chunk(r) -> int:
    return (
        len(r.prompt) - r.context_position if r.context_chunk_size is None else r.context_chunk_size
    )
