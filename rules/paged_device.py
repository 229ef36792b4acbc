"""The FlashAttention/vLLM and FlashInfer rules' device forms (``device_fill`` in
rules/builtin.yaml), run by the step built on the device (``RuntimeBuffers(build='device')``):
each writes its tensor's device mirror at the step's bucket shape from the step's rows on the
device (``runtime.device_rows.DeviceRows``), the bucket's pad rows and tokens at the tensor's
pad. Each equals its host rule in ``paged_attention`` (tests/test_device_build.py compares
them every step); graph-safe: the same operations for one bucket, nothing read back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..runtime.device_rows import DeviceRows


def device_query_start_loc(out: torch.Tensor, d: DeviceRows, pad: int | str) -> None:
    """query_start_loc: 0, then the cumulative query tokens (a pad row adds none)."""
    out.copy_(d.query_start)


def device_seq_lens(out: torch.Tensor, d: DeviceRows, pad: int | str) -> None:
    """seq_lens: each row's KV tokens after the step."""
    out.copy_(d.rows(d.kv[:-1], pad))


def device_cu_seqlens_k(out: torch.Tensor, d: DeviceRows, pad: int | str) -> None:
    """cu_seqlens_k: 0, then the cumulative KV tokens (a pad row adds none)."""
    out.copy_(d.kv_start)


def device_token_positions(out: torch.Tensor, d: DeviceRows, pad: int | str) -> None:
    """token_positions: each token's KV position (one beam, no drafts, no explicit ids)."""
    out.copy_(d.tokens(d.token_pos, pad))


def device_block_table(
    out: torch.Tensor, d: DeviceRows, pad: int | str, *, max_blocks_per_seq: int
) -> None:
    """block_table: each row's slot's block row (a pad row reads the spare slot's zeros)."""
    rows = d.blocks[0].index_select(0, d.slot[:-1])
    out.copy_(rows.where(d.valid[:, None], int(pad)))


def device_kv_slot_mapping(
    out: torch.Tensor,
    d: DeviceRows,
    pad: int | str,
    *,
    max_blocks_per_seq: int,
    tokens_per_block: int,
) -> None:
    """kv_slot_mapping: each token's KV-cache slot in its row's blocks."""
    slots = d.kv_slots(d.blocks[0], d.token_slot, d.token_pos, tokens_per_block)
    out.copy_(d.tokens(slots, pad))


def device_group_block_tables(
    out: torch.Tensor, d: DeviceRows, pad: int | str, *, max_blocks_per_seq: int
) -> None:
    """group_block_tables: block_table of each KV-cache group."""
    rows = d.blocks.index_select(1, d.slot[:-1])
    out.copy_(rows.where(d.valid[None, :, None], int(pad)))


def device_group_slot_mappings(
    out: torch.Tensor, d: DeviceRows, pad: int | str, *, tokens_per_block: int
) -> None:
    """group_slot_mappings: each token's KV-cache slot in each group's blocks."""
    slots = d.kv_slots(d.blocks, d.token_slot, d.token_pos, tokens_per_block)
    out.copy_(d.tokens(slots, pad))


def device_logits_indices(out: torch.Tensor, d: DeviceRows, pad: int | str) -> None:
    """logits_indices: each row's last token (one logit row per row: no drafts)."""
    out.copy_(d.rows(d.query_start[1:] - 1, pad))


def device_produces_token(out: torch.Tensor, d: DeviceRows, pad: int | str) -> None:
    """produces_token: a generation row's token is kept, a context row's where its chunk
    ends the prompt."""
    out.copy_(d.rows(d.keeps_token, pad))


def device_kv_read_index(
    out: torch.Tensor,
    d: DeviceRows,
    pad: int | str,
    *,
    max_blocks_per_seq: int,
    tokens_per_block: int,
) -> None:
    """kv_read_index: the KV-cache slot of every KV position of every row, row after row,
    over the whole capacity (past the step's KV tokens, the pad)."""
    row, pos, valid = d.runs(d.kv_start, out.shape[0])
    slots = d.kv_slots(d.blocks[0], d.slot.index_select(0, row), pos, tokens_per_block)
    out.copy_(slots.where(valid, int(pad)))


def _device_pages(d: DeviceRows, tokens_per_block: int) -> torch.Tensor:
    """_pages on the device: each row's KV pages after the step ([R + 1]; 0 for none)."""
    return (d.kv - 1).div(tokens_per_block, rounding_mode="floor") + 1


def device_paged_kv_indptr(
    out: torch.Tensor, d: DeviceRows, pad: int | str, *, tokens_per_block: int
) -> None:
    """paged_kv_indptr: 0, then the cumulative KV pages (a pad row adds none)."""
    out[0] = 0
    out[1:].copy_(_device_pages(d, tokens_per_block)[:-1].cumsum(0))


def device_paged_kv_indices(
    out: torch.Tensor,
    d: DeviceRows,
    pad: int | str,
    *,
    max_blocks_per_seq: int,
    tokens_per_block: int,
) -> None:
    """paged_kv_indices: each row's first pages, row after row, over the whole capacity (past
    them, the pad)."""
    pages = _device_pages(d, tokens_per_block)
    starts = pages.new_zeros(len(pages) + 1)
    starts[1:] = pages.cumsum(0)
    row, page, valid = d.runs(starts[:-1], out.shape[0])
    ids = d.blocks[0][d.slot.index_select(0, row), page.clamp(0, max_blocks_per_seq - 1)]
    out.copy_(ids.where(valid, int(pad)))


def device_paged_kv_last_page_len(
    out: torch.Tensor, d: DeviceRows, pad: int | str, *, tokens_per_block: int
) -> None:
    """paged_kv_last_page_len: KV tokens in each row's last page."""
    last = d.kv - (_device_pages(d, tokens_per_block) - 1) * tokens_per_block
    out.copy_(d.rows(last[:-1], pad))
