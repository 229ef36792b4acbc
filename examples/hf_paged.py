"""transformers' own continuous-batching attention fed by bufc's ``llama_flash`` step.

transformers' continuous batching (``generation/continuous_batching``) keeps K/V in a
``PagedAttentionCache`` and builds, every step, the keyword arguments its ``ModelRunner`` hands
the model forward (``ContinuousBatchingIOs.get_model_kwargs``). ``forward`` below builds the same
arguments from a bufc step instead, and runs the model's own paged path: the cache's ``update``
writes each token's K/V at its ``write_index`` row and reads each sequence back through its
``read_index`` rows, and the model's attention (``"sdpa"``, what continuous batching keeps where
there is no flash kernel, or ``"paged|eager"``) masks them.

Plugging bufc into a transformers-based engine:

1. ``cache = new_cache(model, page_size=config.tokens_per_block, ...)`` and, on the model,
   ``set_attn_implementation("sdpa")`` (or ``"paged|eager"``). The llama_flash Config's
   ``tokens_per_block`` must be the cache's page size.
2. KV blocks come from the cache's allocator (``cache.can_store_request_tokens(state, n)``, the
   request's blocks in ``cache.cache_allocators["full_attention"].block_table[request_id]``);
   hand them to bufc as ``kv_block_ids(cache, blocks)`` (``Request(kv_block_ids=[...])`` or
   ``step(blocks={slot: ...})``). That is each block's page id, ``block * 2 * num_layers``: a
   block holds a K and a V page per layer, and transformers' own ``fill_block_table`` writes the
   same ids. bufc's slot ``page * tokens_per_block + offset`` is then the very row transformers
   writes and reads (its ``write_index`` and ``read_index``), and bufc's ``block_table`` its
   kernel block table (0 past a sequence's blocks, where transformers has -1). bufc's null block 0 is the cache's read-trash sector, never allocated.
   (The Config's num_kv_blocks, if set, bounds these page ids: leave it 0.)
3. Each step: ``step = buffers.step(tokens, chunks=..., blocks=...)``; ``logits = forward(model,
   cache, step)`` (row ``i`` is logit row ``i``); sample the rows whose ``produces_token`` is set
   and write each token at its row's seq slot (``row_slots``) in ``tokens``; on a finished
   request ``buffers.finish(slot)`` and ``cache.free_blocks(request_id)``.
"""

# What this adapter computes beside the contract's tensors (cu_seqlens_k and kv_read_index are
# bound; the Config's max_kv_read_tokens must hold a step's KV tokens):
# - the additive attention mask of "sdpa" / "paged|eager", [1, 1, num_tokens, total KV tokens],
#   block-diagonal bottom-right causal, built on the host by transformers' build_attention_mask
#   from query_start_loc_cpu and cu_seqlens_k_cpu (O(tokens x KV tokens): the engine's to build);
# - a padded token's write row: slot_mapping's -1 becomes the cache's write-trash row;
# - nothing maps slots to physical rows, because bufc is handed page ids (kv_block_ids): bufc's
#   slot = block * tokens_per_block + offset has no block stride other than tokens_per_block
#   (transformers' is 2 * num_layers * page_size).

from __future__ import annotations

import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.utils import (
    attn_mask_is_needed,
    build_attention_mask,
)

from bufc.generated import llama_flash
from bufc.runtime import Step


def new_cache(
    model: torch.nn.Module, *, page_size: int, num_blocks: int, max_batch_tokens: int
) -> PagedAttentionCache:
    """transformers' paged cache for `model`, in the model's dtype and device (no block sharing:
    bufc is told every block a request holds). max_memory_percent is set because only
    continuous_api resolves its default; on a CPU without psutil transformers logs an error
    while sizing the cache, and sizes it from the system's memory all the same."""
    config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_memory_percent=0.9,
        allow_block_sharing=False,
    )
    helper = DistributedHelper(device_mesh=None, cpu_group_timeout=None)
    return PagedAttentionCache(model.config, config, model.device, helper, dtype=model.dtype)


def _allocator(cache: PagedAttentionCache):
    (allocator,) = cache.cache_allocators.values()  # llama_flash: one KV group, full attention
    return allocator


def kv_block_ids(cache: PagedAttentionCache, blocks: list[int]) -> list[int]:
    """The ids bufc takes for the cache's blocks: each block's page id (its physical stride in
    pages times the block id), as transformers' fill_block_table writes them."""
    a = _allocator(cache)
    return [b * (a.block_physical_stride // a.tokens_per_page) for b in blocks]


@torch.no_grad()
def forward(
    model: torch.nn.Module, cache: PagedAttentionCache, step: Step[llama_flash.StepInputs]
) -> torch.Tensor:
    """One forward of the step through transformers' paged path: writes the step's K/V into
    `cache`, returns the logits of its logit rows (also copied into step.outputs["logits"]).
    It reads the step's typed record (`mypy` checks every name)."""
    inp, a = step.inputs, _allocator(cache)
    if "kv_read_index" not in inp:
        raise ValueError("the llama_flash Config needs max_kv_read_tokens > 0 (the read index)")
    total_k = int(inp.cu_seqlens_k_cpu[-1])
    slots = inp.slot_mapping
    kwargs = dict(
        input_ids=inp.input_ids[None],
        position_ids=inp.positions[None],
        cu_seq_lens_q=inp.query_start_loc,
        max_length_q=inp.max_query_len,
        cu_seq_lens_k={a.layer_type: inp.cu_seqlens_k},
        max_length_k={a.layer_type: inp.max_seq_len},
        write_index=[torch.where(slots >= 0, slots, a.write_trash_index)],
        read_index=[inp.kv_read_index[:total_k]],
        logits_indices=inp.logits_indices,
        logits_to_keep=inp.logits_indices,
        cache=cache,
        block_table=None,
        use_cache=False,
        is_causal=not attn_mask_is_needed(model.config),
        attention_mask=None,
    )
    if attn_mask_is_needed(model.config):
        shape = (1, 1, slots.numel(), total_k)
        mask = torch.full(
            shape, torch.finfo(model.dtype).min, dtype=model.dtype, device=slots.device
        )
        build_attention_mask(mask, inp.query_start_loc_cpu.tolist(), inp.cu_seqlens_k_cpu.tolist())
        kwargs["attention_mask"] = mask
    logits = model(**kwargs).logits[0]
    step.outputs["logits"][:, : logits.shape[-1]].copy_(logits)
    return logits
