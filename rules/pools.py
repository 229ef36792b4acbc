"""TensorRT-LLM's KV-cache pools of one pipeline rank, derived from the per-layer attention
windows and KV head counts (``kvCacheManager.cpp``: ``BlockManager`` and
``WindowBlockManager``).

- Only attention layers hold KV: in a hybrid model (RecurrentGemma) global layer g is one when
  ``(g + 1) % attention_layer_period == 0``, and the pools, the mapping and the per-layer
  windows cover the rank's attention layers alone (``createKvCacheManager`` takes
  ``getNumKvHeadsPerLayerLocalRange``, which counts ``LayerType::kATTENTION`` layers).
- The rank's attention layer i (attention layer ``first_attention + i`` of the model, where
  ``first_attention`` counts the attention layers of the earlier ranks) attends over window
  ``windows[(first_attention + i) % len(windows)]``: the list repeats when it is shorter than
  the layers (``groupLayersByWindowSize``; ``host_max_attention_window_sizes`` reads it the
  same way), and an empty list means one window for every layer. Head counts repeat the same
  way.
- A pool is one (window, KV head count) pair of the rank's layers: windows in ascending order
  (one block manager per window, a ``std::map``), and inside one window one pool per head
  count, in ascending order. A sequence's block ids are per window and span every pool of it.
- ``mapping[i] = (pool, layer index within the pool)``, the index a running count of the
  pool's layers in layer order (``host_kv_cache_pool_mapping``).
- A block id b of a pool with L layers is encoded ``b * L * kv_factor + (0 for K, 1 for V)``
  (``KVCacheIndex``): L is the layers *in that pool*, not the model's (the plugin adds
  ``layer in pool * kv_factor * bytes per block`` to the pool's base).

Plain Python over small tuples, run once when a Config is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class KvPools:
    """The pools of one rank (see the module docstring), each index a pool's."""

    windows: tuple[int, ...]  # each pool's attention window, ascending
    heads: tuple[int, ...]  # each pool's KV heads (0: not given, one count for all layers)
    layers: tuple[int, ...]  # the rank's layers in each pool
    mapping: tuple[tuple[int, int], ...]  # each local attention layer's (pool, index in it)
    layer_windows: tuple[int, ...]  # each local attention layer's attention window

    @property
    def distinct_windows(self) -> tuple[int, ...]:
        """The windows of the rank's layers, ascending: one block list per window."""
        return tuple(sorted(set(self.windows)))


def per_layer(values: Sequence[int], default: int, first_layer: int, num_layers: int) -> list[int]:
    """values[(first_layer + i) % len(values)] for each local layer i (`default` for all when
    `values` is empty)."""
    if not values:
        return [default] * num_layers
    return [values[(first_layer + i) % len(values)] for i in range(num_layers)]


def attention_layers(first_layer: int, num_layers: int, period: int = 1) -> tuple[int, int]:
    """(the model's attention layers before global layer `first_layer`, the attention layers
    among `num_layers` layers from it): layer g holds attention when (g + 1) % period == 0."""
    before = first_layer // period
    return before, (first_layer + num_layers) // period - before


def kv_pools(
    attention_windows: Sequence[int],
    kv_heads_per_layer: Sequence[int],
    max_attention_window: int,
    first_local_layer: int,
    num_local_layers: int,
    attention_layer_period: int = 1,
) -> KvPools:
    """The rank's pools over its attention layers, in TensorRT-LLM's order (window ascending,
    then head count)."""
    first, count = attention_layers(first_local_layer, num_local_layers, attention_layer_period)
    windows = per_layer(attention_windows, max_attention_window, first, count)
    heads = per_layer(kv_heads_per_layer, 0, first, count)
    pools = sorted(set(zip(windows, heads)))
    index = {pool: p for p, pool in enumerate(pools)}
    counts = [0] * len(pools)
    mapping = []
    for pair in zip(windows, heads):
        p = index[pair]
        mapping.append((p, counts[p]))
        counts[p] += 1
    return KvPools(
        windows=tuple(w for w, _ in pools),
        heads=tuple(h for _, h in pools),
        layers=tuple(counts),
        mapping=tuple(mapping),
        layer_windows=tuple(windows),
    )


def encode(block: int, layers_in_pool: int, field: int, kv_factor: int = 2) -> int:
    """The KVCacheIndex of block `block` of a pool of `layers_in_pool` layers: K (field 0) or
    V (field 1; K-only caches, kv_factor 1, write 0 for both)."""
    return block * layers_in_pool * kv_factor + (field if kv_factor == 2 else 0)


# ---------------------------------------------------------------- Config derivations
# Each is called once, when a family's Config is built, with the Config values its `derive:`
# entry reads (by keyword: those of ``rank_pools``); an empty list of windows means
# max_attention_window for every layer, of head counts one count for all.


def rank_pools(
    *,
    num_local_layers: int,
    kv_heads_per_layer: Sequence[int] = (),
    first_local_layer: int = 0,
    attention_windows: Sequence[int] = (),
    max_attention_window: int = 0,
    attention_layer_period: int = 1,
) -> KvPools:
    """The pools of this rank from the Config values a derivation reads."""
    return kv_pools(
        attention_windows,
        kv_heads_per_layer,
        max_attention_window,
        first_local_layer,
        num_local_layers,
        attention_layer_period,
    )


def num_kv_pools(**config: Any) -> int:
    """Pools of this rank: one per distinct (window, KV heads) pair of its layers."""
    return len(rank_pools(**config).layers)


def kv_pool_layers(**config: Any) -> tuple[int, ...]:
    """The rank's attention layers in each pool (what a block id is multiplied by, times the
    KV factor)."""
    return rank_pools(**config).layers


def kv_pool_mapping(**config: Any) -> tuple[int, ...]:
    """host_kv_cache_pool_mapping, flat: (pool, layer index in the pool) of each local
    attention layer."""
    return tuple(x for pair in rank_pools(**config).mapping for x in pair)


def kv_pool_windows(**config: Any) -> tuple[int, ...]:
    """Each pool's window, as its index among the rank's distinct windows (ascending): the
    block list the pool's ids come from."""
    pools = rank_pools(**config)
    order = {w: k for k, w in enumerate(pools.distinct_windows)}
    return tuple(order[w] for w in pools.windows)


def layer_windows(**config: Any) -> tuple[int, ...]:
    """host_max_attention_window_sizes: the attention window of each local attention layer."""
    return rank_pools(**config).layer_windows


def window_sizes(**config: Any) -> tuple[int, ...]:
    """The distinct attention windows of the rank's layers, ascending: a request carries one
    block list per window."""
    return rank_pools(**config).distinct_windows


def widest_window(*, max_attention_window: int, attention_windows: Sequence[int] = ()) -> int:
    """The widest attention window of any layer (what the block table must hold)."""
    return max(attention_windows, default=max_attention_window)
