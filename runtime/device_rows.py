"""One step's rows on the device, at its bucket: what every device form reads
(``RuntimeBuffers(build='device')``).

The device build's ``Batch``: derived once per step, inside the step's CUDA graph, from the
device mirror of the request table (each slot's KV tokens so far, its last sampled token, its
block rows) and the step's delta (each row's slot, the first position and size of a context
row's chunk, the context tokens). Every tensor has the bucket's static shape, so one graph
serves every step of that bucket: ``R`` rows and ``T`` tokens, the rows past the step pad rows.
Row arrays carry one more entry, ``R``, a pad row whose slot is the spare slot ``S`` (its
block rows are zero and no step writes them), so a padded token reads something harmless.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class DeviceRows:
    """One step's rows on the device (see the module docstring). ``[R + 1]``: one entry per
    bucket row, then the pad row; ``[T]``: one per bucket token."""

    valid: torch.Tensor  # [R] bool: a row of the step (not a bucket pad row)
    slot: torch.Tensor  # [R + 1] seq slot of each row (pad rows: the spare slot)
    begin: torch.Tensor  # [R + 1] KV position of each row's first query token (pads: 0)
    kv: torch.Tensor  # [R + 1] KV tokens of each row once the step's tokens are written (pads: 0)
    query_start: torch.Tensor  # [R + 1] 0, then the cumulative query tokens
    kv_start: torch.Tensor  # [R + 1] 0, then the cumulative KV tokens
    keeps_token: torch.Tensor  # [R] bool: the row's logit row's sampled token is kept
    token_row: torch.Tensor  # [T] the row of each token (pad tokens: the pad row, R)
    token_valid: torch.Tensor  # [T] bool: a token of the step
    token_slot: torch.Tensor  # [T] the seq slot of each token's row
    token_pos: torch.Tensor  # [T] each token's KV position (pad tokens: 0)
    from_context: torch.Tensor  # [T] bool: a context token (its id in context_tokens)
    context_tokens: torch.Tensor  # [T] the context chunks' tokens, packed first
    last_token: torch.Tensor  # [S + 1] each slot's last sampled token (after this step's)
    blocks: torch.Tensor  # [groups, S + 1, width] each slot's block ids per KV-cache group

    def rows(self, values: torch.Tensor, pad: int | str) -> torch.Tensor:
        """`values` ([R], one per row) with the bucket's pad rows at `pad` (a constant, or
        ``repeat_last``: the last row of the step's value)."""
        return torch.where(self.valid, values, self._pad(values, self.valid, pad))

    def tokens(self, values: torch.Tensor, pad: int | str) -> torch.Tensor:
        """`values` ([..., T], one per token) with the bucket's pad tokens at `pad`."""
        return torch.where(self.token_valid, values, self._pad(values, self.token_valid, pad))

    @staticmethod
    def _pad(values: torch.Tensor, valid: torch.Tensor, pad: int | str) -> torch.Tensor | int:
        if pad != "repeat_last":
            return int(pad)
        last = (valid.sum() - 1).clamp(min=0)  # the last element of the step (0 without any)
        return values.index_select(-1, last.reshape(1))

    @staticmethod
    def runs(starts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Elements 0 .. n - 1 laid out row after row, row i's at starts[i] .. starts[i + 1] - 1
        (`starts`: [R + 1], 0 first): each element's row (past the last, the pad row R), its
        index within its row, and whether it lies within the rows."""
        index = torch.arange(n, device=starts.device)
        row = torch.searchsorted(starts[1:], index, right=True)
        return row, index - starts.index_select(0, row), index < starts[-1]

    def kv_slots(
        self, blocks: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, per_block: int
    ) -> torch.Tensor:
        """The KV-cache slot of KV position `pos` of each slot in `slots` (its block's id x
        `per_block` + its offset), from `blocks` ([..., S + 1, width]: one group's rows, or
        every group's); the column is clamped into the row, so that a pad's position reads a
        block too (the caller masks its value)."""
        width = blocks.shape[-1]
        column = torch.div(pos, per_block, rounding_mode="floor").clamp(0, width - 1)
        block = blocks[..., slots, column].to(torch.int64)
        return block * per_block + torch.remainder(pos, per_block)


def build(
    *,
    slot: torch.Tensor,
    begin: torch.Tensor,
    query: torch.Tensor,
    ends_prompt: torch.Tensor,
    context_tokens: torch.Tensor,
    context_count: torch.Tensor,
    kv_len: torch.Tensor,
    last_token: torch.Tensor,
    blocks: torch.Tensor,
) -> DeviceRows:
    """The step's rows from its delta (`slot`, `begin` (-1: the slot's KV tokens so far),
    `query`, `ends_prompt`: [R] each, pad rows at the spare slot with 0; the context tokens
    and their count) and the device mirror (`kv_len`, `last_token`: [S + 1]; `blocks`)."""
    R, T, spare = slot.shape[0], context_tokens.shape[0], kv_len.shape[0] - 1
    dev = slot.device
    pad_row = torch.full((1,), spare, dtype=slot.dtype, device=dev)
    slots = torch.cat((slot, pad_row))
    zero = torch.zeros(1, dtype=begin.dtype, device=dev)
    first = torch.where(begin >= 0, begin, kv_len.index_select(0, slot))
    first = torch.cat((first, zero))
    queries = torch.cat((query, zero))
    kv = first + queries
    query_start = torch.cat((zero, torch.cumsum(query, 0)))
    kv_start = torch.cat((zero, torch.cumsum(kv[:R], 0)))
    token_row, within, valid_token = DeviceRows.runs(query_start, T)
    token_pos = torch.where(valid_token, first.index_select(0, token_row) + within, 0)
    return DeviceRows(
        valid=slot != spare,
        slot=slots,
        begin=first,
        kv=kv,
        query_start=query_start,
        kv_start=kv_start,
        keeps_token=ends_prompt != 0,
        token_row=token_row,
        token_valid=valid_token,
        token_slot=slots.index_select(0, token_row),
        token_pos=token_pos,
        from_context=torch.arange(T, device=dev) < context_count,
        context_tokens=context_tokens,
        last_token=last_token,
        blocks=blocks,
    )
