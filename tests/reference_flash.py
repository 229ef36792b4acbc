"""The FlashAttention/vLLM contract of one step (family llama_flash), request by request and token
by token: what vLLM's gpu_model_runner and block_table.py compute, written as plain loops."""

from __future__ import annotations


def reference_flash(ctx: list, gen: list, *, tokens_per_block: int, width: int) -> dict:
    """Every tensor of the step, by the engine names of llama_flash, plus its scalars."""
    tpb = tokens_per_block
    out: dict[str, list] = {
        "input_ids": [],
        "positions": [],
        "query_start_loc": [0],
        "seq_lens": [],
        "block_table": [],
        "slot_mapping": [],
        "logits_indices": [],
        "cu_seqlens_k": [0],
        "row_slots": [],
        "produces_token": [],
        "kv_read_index": [],
    }
    query_lens = []

    def sequence(slot, tokens, kv_first, positions, blocks, logit_tokens, produces):
        """One sequence's query tokens at KV positions kv_first, kv_first + 1, ..."""
        start = len(out["input_ids"])
        for j, (token, position) in enumerate(zip(tokens, positions)):
            kv = kv_first + j
            out["input_ids"].append(token)
            out["positions"].append(position)
            out["slot_mapping"].append(blocks[kv // tpb] * tpb + kv % tpb)
        for j in logit_tokens:
            out["logits_indices"].append(start + j)
            # a chunk that stops mid-prompt samples a token the engine discards
            out["produces_token"].append(produces or j > logit_tokens[0])
        out["query_start_loc"].append(len(out["input_ids"]))
        out["seq_lens"].append(kv_first + len(tokens))
        out["cu_seqlens_k"].append(out["cu_seqlens_k"][-1] + kv_first + len(tokens))
        out["row_slots"].append(slot)
        for kv in range(kv_first + len(tokens)):  # every KV position the sequence reads
            out["kv_read_index"].append(blocks[kv // tpb] * tpb + kv % tpb)
        out["block_table"].append(list(blocks) + [0] * (width - len(blocks)))
        query_lens.append(len(tokens))

    for r in ctx:
        n, begin = len(r.prompt), r.context_position
        chunk = n - begin if r.context_chunk_size is None else r.context_chunk_size
        drafts = list(r.draft_tokens or ()) if begin + chunk == n else []
        tokens = list(r.prompt[begin : begin + chunk]) + drafts
        if r.position_ids is None:
            positions = list(range(begin, begin + len(tokens)))
        else:  # drafts continue after the last prompt position
            positions = list(r.position_ids[begin : begin + chunk])
            positions += [r.position_ids[-1] + 1 + d for d in range(len(drafts))]
        # logit rows: the chunk's last token, then each draft
        logits = [chunk - 1] + [chunk + d for d in range(len(drafts))]
        sequence(
            r.seq_slot, tokens, begin, positions, r.kv_block_ids[0], logits, begin + chunk == n
        )
    for r in gen:
        drafts = list(r.draft_tokens or ())
        for k in range(r.beam_width):
            generated = r.generated[k]
            blocks = r.kv_block_ids[k if len(r.kv_block_ids) > 1 else 0]
            tokens = [generated[-1]] + drafts
            kv_first = len(r.prompt) + len(generated) - 1
            # explicit positions continue from the prompt's last one
            first = kv_first if r.position_ids is None else r.position_ids[-1] + len(generated)
            positions = [first + j for j in range(len(tokens))]
            logits = list(range(len(tokens)))
            sequence(r.seq_slot, tokens, kv_first, positions, blocks, logits, True)
    out["scalars"] = {
        "max_query_len": max(query_lens, default=0),
        "max_seq_len": max(out["seq_lens"], default=0),
        "num_actual_tokens": len(out["input_ids"]),
    }
    return out


def reference_flashinfer(ctx: list, gen: list, *, tokens_per_block: int, width: int) -> dict:
    """FlashInfer's paged-KV arrays of the same step (family llama_flashinfer), page by page,
    with the tensors it shares with llama_flash."""
    flash = reference_flash(ctx, gen, tokens_per_block=tokens_per_block, width=width)
    indptr, indices, last = [0], [], []
    for length, row in zip(flash["seq_lens"], flash["block_table"]):
        pages = -(-length // tokens_per_block)
        indices += row[:pages]
        indptr.append(indptr[-1] + pages)
        last.append(length - (pages - 1) * tokens_per_block)
    shared = ("input_ids", "positions", "slot_mapping", "row_slots", "produces_token")
    out = {name: flash[name] for name in shared}
    out["logits_indices"] = flash["logits_indices"]
    out["qo_indptr"] = flash["query_start_loc"]
    out["paged_kv_indptr"], out["paged_kv_indices"] = indptr, indices
    out["paged_kv_last_page_len"] = last
    out["scalars"] = {k: flash["scalars"][k] for k in ("max_query_len", "num_actual_tokens")}
    return out
