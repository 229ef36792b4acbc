"""A paged K/V pool and its block allocator, addressed the way the engine addresses it.

The pool is one tensor of K/V slabs, ``[num_blocks * num_layers * 2, tokens_per_block, kv_heads,
head_dim]``; slab ``(block * num_layers + layer) * 2 + (0 for K, 1 for V)`` holds one block of one
layer. kv_cache_block_offsets carries ``(block * num_layers) * 2 + k/v`` per block (the
TensorRT-LLM KVCacheIndex encoding); the attention adds ``2 * layer``.
"""

from __future__ import annotations

import torch


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    """Hands out block ids from a free list; blocks return when their request finishes.

    Block 0 is never handed out: kv_cache_block_offsets pads with 0, so the padding rows of a
    CUDA-graph batch bucket read and write block 0 and never touch a request's blocks.
    """

    RESERVED = 1

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks - self.RESERVED
        self._free = list(range(num_blocks - 1, self.RESERVED - 1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        tokens_per_block: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.tokens_per_block = tokens_per_block
        self.slabs = torch.zeros(
            num_blocks * num_layers * 2,
            tokens_per_block,
            kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )

    @classmethod
    def for_model(
        cls,
        model,
        num_blocks: int,
        tokens_per_block: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> PagedKVCache:
        """The pool of a packed model's layers and K/V heads (those of its rank and stage)."""
        return cls(
            num_blocks,
            model.num_layers,
            tokens_per_block,
            model.kv_heads,
            model.head_dim,
            dtype,
            device,
        )

    def slots(
        self, offsets: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(K slab of layer 0, slot) of each token position of one sequence; ``offsets`` is that
        sequence's [2, max_blocks_per_seq] row of kv_cache_block_offsets."""
        tpb = self.tokens_per_block
        return offsets[0, positions // tpb].long(), positions % tpb

    def write(
        self, layer: int, slab: torch.Tensor, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        self.slabs[slab + 2 * layer, slot] = k
        self.slabs[slab + 2 * layer + 1, slot] = v

    def read(
        self, layer: int, slab: torch.Tensor, slot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.slabs[slab + 2 * layer, slot], self.slabs[slab + 2 * layer + 1, slot]
