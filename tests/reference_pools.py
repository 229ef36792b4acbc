"""A loop-by-loop port of TensorRT-LLM's KV-pool layout, written from
../shared/reference/contracts-and-pools.md §3 (kvCacheManager.cpp: BlockManager,
WindowBlockManager, setOffsets; attentionOp.cpp's reading of the mapping), with no shared code
with bufc.rules.pools.

One block manager per distinct window (a std::map: ascending windows), each with one pool per
distinct KV head count (a std::map: ascending); a window's pools take consecutive absolute
indices after the smaller windows'. A layer's index within its pool is a running count of that
pool's layers in layer order.
"""

from __future__ import annotations


def reference_pools(
    windows: list[int],
    heads: list[int],
    default_window: int,
    first_layer: int,
    layers: int,
    period: int = 1,
) -> dict:
    """{"mapping": [(pool, layer in pool)] per local attention layer, "layers_in_pool": [...],
    "pool_window": [...], "layer_window": [...]}. Layer g is an attention layer when
    (g + 1) % period == 0 (ModelConfig's layer types, RecurrentGemma's 3); the windows and head
    counts are per attention layer of the model (getNumKvHeadsPerLayerLocalRange)."""
    attention = [g for g in range(period - 1, first_layer + layers, period)]
    first_attention = sum(1 for g in attention if g < first_layer)
    local = [g for g in attention if g >= first_layer]
    layer_window = []
    layer_heads = []
    for i in range(len(local)):
        a = first_attention + i  # the attention layer's index among the model's
        layer_window.append(windows[a % len(windows)] if windows else default_window)
        layer_heads.append(heads[a % len(heads)] if heads else 0)
    layers = len(local)
    # groupLayersByWindowSize: window -> its layers, in layer order
    by_window: dict[int, list[int]] = {}
    for i in range(layers):
        by_window.setdefault(layer_window[i], []).append(i)
    mapping: list[tuple[int, int] | None] = [None] * layers
    layers_in_pool: list[int] = []
    pool_window: list[int] = []
    offset = 0  # the window's absolutePoolsOffset
    for window in sorted(by_window):
        # WindowBlockManager: numLayersPerPool keyed by head count
        per_heads: dict[int, int] = {}
        for i in by_window[window]:
            per_heads[layer_heads[i]] = per_heads.get(layer_heads[i], 0) + 1
        relative = {h: k for k, h in enumerate(sorted(per_heads))}
        seen = {h: 0 for h in per_heads}
        for i in by_window[window]:
            h = layer_heads[i]
            mapping[i] = (offset + relative[h], seen[h])
            seen[h] += 1
        for h in sorted(per_heads):
            layers_in_pool.append(per_heads[h])
            pool_window.append(window)
        offset += len(per_heads)
    return {
        "mapping": mapping,
        "layers_in_pool": layers_in_pool,
        "pool_window": pool_window,
        "layer_window": layer_window,
    }


def reference_offsets(
    block_lists: list[list[int]], layers_in_pool: list[int], width: int, kv_factor: int = 2
) -> list:
    """[pools][sequence][K/V][width] as setOffsets + copyBlockOffsets write them, one window
    (every pool of it takes the same block ids), columns past a list's count 0 (bufc's fix of
    the reference's stale entries)."""
    out = []
    for n_layers in layers_in_pool:
        pool = []
        for blocks in block_lists:
            rows = [[0] * width, [0] * width]
            for j, block in enumerate(blocks):
                for field in (0, 1):
                    rows[field][j] = block * n_layers * kv_factor + (field if kv_factor == 2 else 0)
            pool.append(rows)
        out.append(pool)
    return out
