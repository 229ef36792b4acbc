"""Paged KV-cache block rows, shared by the self- and cross-attention block offsets.

A request carries its block ids per beam (or one list shared by its beams) under a request
field; each sequence row of the step gets its list. The rows use TensorRT-LLM's KVCacheIndex
encoding for a pool laid out [blocks, layers, K/V, ...]: (block_id * num_local_layers + 0) * 2
+ (0 for K, 1 for V); the kernel adds the layer. Columns past a sequence's blocks hold 0.
"""

from __future__ import annotations

import itertools
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from .batch import Batch
from .errors import BatchError

_FIRST = itemgetter(0)


def _block_lists(b: Batch, field: str) -> list | None:
    """Each sequence's block list, in row order; None if a request's `field` is missing or has
    neither one list nor one per beam. A context request is one sequence: its first list."""
    get = attrgetter(field)
    try:
        ctx_ids = list(map(get, b.context))
        gen_ids = list(map(get, b.generation))
    except AttributeError:
        return None
    if not all(ctx_ids) or not all(gen_ids):
        return None
    if any(len(ids) not in (1, r.beam_width) for ids, r in zip(ctx_ids, b.context)):
        return None
    lists = list(map(_FIRST, ctx_ids))
    counts = list(map(len, gen_ids))
    if b.sizes.num_generation_sequences == len(counts) == counts.count(1):
        lists += map(_FIRST, gen_ids)  # one beam, one list each: the common case
    else:
        for ids, beams in zip(gen_ids, b.gen_beam_width):
            if len(ids) not in (1, beams):
                return None
            lists += [ids[k if len(ids) > 1 else 0] for k in range(beams)]
    return lists


def checked_block_lists(b: Batch, field: str, width: int, width_name: str, what: str) -> list:
    """The step's block lists of `field`, or a BatchError naming the first request whose lists
    are malformed or longer than `width` (`width_name` and `what` word the message)."""
    lists = _block_lists(b, field)
    if lists is not None and (not lists or max(map(len, lists)) <= width):
        return lists
    for kind, reqs in (("context", b.context), ("generation", b.generation)):  # the cold path
        for i, r in enumerate(reqs):
            ids = getattr(r, field, None)
            beams = r.beam_width
            if not ids or len(ids) not in (1, beams):
                raise BatchError(
                    f"{kind} request {i} (seq_slot {r.seq_slot}): {field} needs one block list "
                    f"(shared by all beams) or one per beam, got {0 if not ids else len(ids)}"
                )
            for blocks in ids:
                if len(blocks) > width:
                    raise BatchError(
                        f"{kind} request {i} (seq_slot {r.seq_slot}): {len(blocks)} {what} blocks "
                        f"exceed {width_name}={width}"
                    )
    raise AssertionError("unreachable: a malformed block list was not found")  # pragma: no cover


def write_kv_rows(rows: np.ndarray, lists: list, num_local_layers: int) -> None:
    """rows[i] = the [K/V, width] block indices of lists[i], zero-padded."""
    if not lists:
        return
    rows[:] = 0
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    total = int(lengths.sum())
    blocks = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=total)
    seq = np.repeat(np.arange(len(lists)), lengths)
    col = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    index = blocks * (num_local_layers * 2)
    rows[seq, 0, col] = index
    rows[seq, 1, col] = index + 1


def write_at(table: np.ndarray, at: list[int], lists: list, num_local_layers: int) -> None:
    """table[at[k]] = the rows of lists[k]."""
    sub: Any = np.empty((len(at),) + table.shape[1:], dtype=table.dtype)
    write_kv_rows(sub, lists, num_local_layers)
    table[at] = sub
