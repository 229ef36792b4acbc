"""Requests in flight: each slot's KV block ids in one table per pool, checked when written.

A request's block lists (one shared by its beams, or one per beam) are read once, when it
arrives (``put``), and grow by the ids a step hands over (``append``); both check every id
then: an integer in the pool, at most ``width`` per list. A step reads no request's list: the
KV rules gather each sequence's row from ``ids`` (the allocator's ids, as the FlashAttention
and FlashInfer contracts take them) or from ``encoded`` (TensorRT-LLM's block offsets), and
the coverage from ``count``. Both are written where the ids are: ``put``, ``append`` and, for
a failed step, ``undo``; nothing else keeps a copy.

The ids of a list sit at ``ids[slot * lists + k, :count]`` (int32: the id bound keeps every
encoded index within it); the columns past its count hold 0. Each attention window's lists are
one table.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import BatchError
from .values import (
    INT32_MAX,
    in_range,
    int_array,
    is_int,
    is_ordered,
    is_unordered,
    not_a_list,
    show,
)


def id_limit(layers: int, num_kv_blocks: int) -> tuple[int, str]:
    """Block ids lie in 0 .. limit - 1: the pool's blocks (0: unbounded), and at most what the
    int32 index (id * layers * 2 + 1) can encode, `layers` the most layers of one KV pool."""
    encodable = (INT32_MAX - 1) // (2 * layers) + 1
    if num_kv_blocks and num_kv_blocks <= encodable:
        return num_kv_blocks, f"num_kv_blocks={num_kv_blocks}"
    return encodable, f"the int32 block index of a {layers}-layer KV pool"


def raw_id_limit(num_kv_blocks: int) -> tuple[int, str]:
    """Block ids bound as the allocator hands them to an engine that takes them unencoded
    (FlashAttention's block_table, FlashInfer's page indices): the pool's blocks, and the
    int32 table that holds them."""
    if num_kv_blocks and num_kv_blocks <= INT32_MAX:
        return num_kv_blocks, f"num_kv_blocks={num_kv_blocks}"
    return INT32_MAX + 1, "the int32 block table"


class BlockTable:
    """One pool's block ids of the requests in flight (see the module docstring)."""

    def __init__(
        self, slots: int, lists: int, width: int, limit: tuple[int, str], field: str
    ) -> None:
        self.lists, self.width, self.limit, self.field = lists, width, limit, field
        self.ids = np.zeros((slots * lists, width), np.int32)
        self.count = np.zeros(slots * lists, np.int64)
        self.n_lists = np.zeros(slots, np.int64)  # 1 (shared by the beams) or the beam width
        # TensorRT-LLM's KVCacheIndex of every id: [rows, K/V, width], K = id * per_block
        # (2 x the layers of the window's first pool), V = K + 1, 0 past a list's count; made
        # by the first ``encoded`` call (a family whose engine takes the ids as they are never
        # asks), then written beside the ids
        self.enc: np.ndarray | None = None
        self.per_block = 0

    def encoded(self, per_block: int) -> np.ndarray:
        """[rows, K/V, width] int32: every list's ids encoded with `per_block` (see ``enc``)."""
        if self.enc is None or self.per_block != per_block:
            k = self.ids.astype(np.int64) * per_block
            enc = np.empty((len(self.count), 2, self.width), np.int32)
            enc[:, 0] = k
            enc[:, 1] = (k + 1) * (np.arange(self.width) < self.count[:, None])
            self.enc, self.per_block = enc, per_block
        return self.enc

    def check(
        self, lists: Any, beams: int, w: str
    ) -> tuple[list[list[Any]], list[np.ndarray | list[int]]]:
        """An arriving request's lists (one, or one per beam), checked: the request's own
        copy of them (its record of what it was given) and their ids as arrays for ``put``."""
        if type(lists) is list and len(lists) == 1 and type(lists[0]) is list:
            one = lists[0]  # the common case: one list of Python ints, checked one by one
            if len(one) <= self.width and _ids_in(one, self.limit[0]):
                copy = one.copy()
                return [copy], [copy]
        copied = request_lists(w, lists, beams, self.field)
        return copied, [self._checked(x, 0, w) for x in copied]

    def put(self, slot: int, arrays: list[np.ndarray | list[int]]) -> None:
        """The checked lists of the request arriving in `slot`."""
        base = slot * self.lists
        if self.lists == 1:  # one list per slot (no beam search)
            self._write_row(base, arrays[0])
            self.n_lists[slot] = 1
            return
        for k in range(self.lists):
            self._write_row(base + k, arrays[k] if k < len(arrays) else ())
        self.n_lists[slot] = len(arrays)

    def _write_row(self, row: int, ids: Any) -> None:
        """Row `row` holds the list `ids` (checked), 0 past it, in ``ids`` and ``enc``."""
        n = len(ids)
        r = self.ids[row]
        r[:n] = ids
        r[n:] = 0  # past a list's count its ids are 0
        self.count[row] = n
        if self.enc is not None:
            self._encode(row, 0, n)
            self.enc[row, :, n:] = 0

    def lists_of(self, slot: int) -> list[list[int]]:
        """The slot's lists, as lists of ids (copies)."""
        base = slot * self.lists
        return [
            self.ids[row, : self.count[row]].tolist()
            for row in range(base, base + int(self.n_lists[slot]))
        ]

    def clear(self, slot: int) -> None:
        """The slot's request left: its lists are gone (no step reads the slot until ``put``
        gives it new ones, rewriting its rows)."""
        base = slot * self.lists
        self.count[base : base + self.lists] = 0
        self.n_lists[slot] = 0

    def append(self, slot: int, new: Any, w: str) -> list[tuple[int, int]]:
        """Ids handed over for the slot's lists: one list of ids (every list of the request
        gets them) or one list per list it holds. Checked before any is written; returns
        (row, count before) per list changed (what ``undo`` takes)."""
        n = int(self.n_lists[slot])
        base = slot * self.lists
        if n == 1 and type(new) is list and _ids_in(new, self.limit[0]):  # the common case
            before = int(self.count[base])
            after = before + len(new)
            if after > self.width:
                raise BatchError(f"{w}: {after} KV blocks exceed max_blocks_per_seq={self.width}")
            self._extend(base, before, new)
            return [(base, before)]
        if type(new) is not list:
            if not (is_ordered(new) or is_ordered(new, 2)):
                raise not_a_list(w, self.field, new)
            new = list(new)
        # one list per list: every entry a list (or an unordered one, refused below)
        per_list = bool(new) and all(is_ordered(x) or is_unordered(x) for x in new)
        if per_list and len(new) != n:
            raise BatchError(
                f"{w}: {len(new)} lists of block ids for a request with {n} block lists"
            )
        if per_list and not all(map(is_ordered, new)):
            k = next(k for k, x in enumerate(new) if not is_ordered(x))
            raise not_a_list(w, f"{self.field}[{k}]", new[k])
        added = [
            self._checked(new[k] if per_list else new, int(self.count[base + k]), w)
            for k in range(n)
        ]
        done = []
        for k, a in enumerate(added):
            row, before = base + k, int(self.count[base + k])
            self._extend(row, before, a)
            done.append((row, before))
        return done

    def _extend(self, row: int, before: int, new: Any) -> None:
        """Row `row`'s list, `before` ids long, grows by the checked ids `new`."""
        after = before + len(new)
        enc = self.enc
        if after - before == 1:  # a step's usual append: one block, scalar writes
            block = int(new[0])
            self.ids[row, before] = block
            if enc is not None:
                enc[row, 0, before] = block * self.per_block
                enc[row, 1, before] = block * self.per_block + 1
        else:
            self.ids[row, before:after] = new
            if enc is not None:
                self._encode(row, before, after)
        self.count[row] = after

    def _encode(self, row: int, start: int, stop: int) -> None:
        """``enc`` of columns start .. stop - 1 of row `row` from its ids: K = id * per_block,
        V = K + 1 (the bound on ids keeps both within int32)."""
        assert self.enc is not None
        k = self.enc[row, 0, start:stop]
        np.multiply(self.ids[row, start:stop], self.per_block, out=k)
        np.add(k, 1, out=self.enc[row, 1, start:stop])

    def append_many(self, blocks: Mapping[Any, Any], undo: list[tuple[Any, Any, Any]]) -> bool:
        """``append`` for many slots at once, each with one list and a list of Python ints
        handed over (a large batch's decode step: a few numpy calls instead of a call per
        slot), (this table, the rows, their counts before) added to `undo`. False, with
        nothing written, when anything is unusual (a slot that holds no single list, ids that
        are not ints in the pool, a list past the width): the caller then appends slot by
        slot, which names the culprit."""
        slots, values = list(blocks), list(blocks.values())
        n_slots = len(self.n_lists)
        if not _ids_in(slots, n_slots) or not _LIST_ONLY.issuperset(map(type, values)):
            return False
        at = np.fromiter(slots, np.int64, len(slots))
        if np.count_nonzero(self.n_lists[at] != 1):
            return False
        flat = list(itertools.chain.from_iterable(values))
        if not _ids_in(flat, self.limit[0]):
            return False
        counts = np.fromiter(map(len, values), np.int64, len(values))
        rows = at * self.lists
        before = self.count[rows]
        after = before + counts
        if np.count_nonzero(after > self.width):
            return False
        if len(flat) == len(values) and all(values):  # one block each: one scatter
            self.ids[rows, before] = flat
            if self.enc is not None:
                k = np.array(flat, np.int64) * self.per_block
                self.enc[rows, 0, before] = k
                self.enc[rows, 1, before] = k + 1
            self.count[rows] = after
        else:
            for row, b, v in zip(rows.tolist(), before.tolist(), values):
                self._extend(row, b, v)
        undo.append((self, rows, before))
        return True

    def undo(self, rows: Any, counts: Any) -> None:
        """Take back what ``append`` or ``append_many`` wrote (a failed step): each of `rows`
        (a row, or an array of them) holds its list as it was, `counts` ids long."""
        for row, before in zip(np.atleast_1d(rows).tolist(), np.atleast_1d(counts).tolist()):
            self.ids[row, before:] = 0
            if self.enc is not None:
                self.enc[row, :, before:] = 0
            self.count[row] = before

    def _checked(self, values: Any, have: int, w: str) -> np.ndarray | list[int]:
        """`values` as the ids of a list that holds `have` already: at most `width` ids in
        all, each an integer in the pool; a BatchError naming the first bad one otherwise.
        A list of Python ints in range comes back as it is (a request's few ids: cheaper
        checked one by one than converted)."""
        if have + len(values) > self.width:
            raise BatchError(
                f"{w}: {have + len(values)} KV blocks exceed max_blocks_per_seq={self.width}"
            )
        if type(values) is list and _ids_in(values, self.limit[0]):
            return values
        a = int_array(values)
        if a is None or not in_range(a, 0, self.limit[0]):
            name_bad_id(list(values), 0, self.field, w, self.limit, "KV")
            raise BatchError(f"{w}: {self.field} needs lists of block ids, got {show(values)}")
        return a


def _ids_in(values: list, limit: int) -> bool:
    """Every value is a Python int in 0 .. limit - 1 (a step's few new ids: cheaper than an
    array; the types, least and most compared by C loops)."""
    return not values or (
        _INT_ONLY.issuperset(map(type, values)) and min(values) >= 0 and max(values) < limit
    )


_INT_ONLY = frozenset((int,))
_LIST_ONLY = frozenset((list,))


def window_lists(ids: Any, windows: list[int], w: str) -> Mapping[int, Any]:
    """A request's block lists with several attention windows: {window: lists} with exactly
    the windows of the model's layers; a BatchError otherwise."""
    keys = list(ids) if isinstance(ids, Mapping) else None
    if keys is not None:
        check_window_keys(keys, f"{w}: kv_block_ids")
    if keys is None or sorted(keys) != windows:
        got = f"the windows {keys}" if keys is not None else show(ids)
        raise BatchError(
            f"{w}: kv_block_ids needs one set of block lists per attention window, "
            f"{{window: lists}} for the windows {windows}; got {got}"
        )
    return ids


def check_window_keys(keys: Any, w: str) -> None:
    """A BatchError naming the first of the attention windows `keys` that is no integer (a
    Python or numpy int; a float, a bool or a string is not)."""
    for key in keys:
        if not is_int(key):
            raise BatchError(
                f"{w} window key {show(key)} is a {type(key).__name__}, not an integer"
            )


def request_lists(w: str, ids: Any, beams: int, field: str) -> list[list[Any]]:
    """A request's block lists of `field`, one (shared by all beams) or one per beam, each as
    a list of its own; a BatchError otherwise (each list an ordered sequence: ``is_ordered``)."""
    if ids is not None and not is_ordered(ids, 2):
        raise not_a_list(w, field, ids, 2)
    if ids is not None and not all(map(is_ordered, ids)):
        k, x = next((k, x) for k, x in enumerate(ids) if not is_ordered(x))
        if isinstance(x, Iterable):  # not an id: an unordered or nested container
            raise not_a_list(w, f"{field}[{k}]", x)
    try:
        count = len(ids) if ids is not None else 0
    except TypeError:
        count = 0
    try:
        lists: list[list[Any]] | None = [list(x) for x in ids] if count else []
    except TypeError:  # an entry that is not a list of ids
        lists = None
    if not count or count not in (1, beams) or lists is None:
        got = f"{count} lists" if count else show(ids)
        raise BatchError(
            f"{w}: {field} needs one block list (shared by all beams) or one per beam, got {got}"
        )
    return lists


def name_bad_id(
    blocks: Any, start: int, field: str, w: str, limit: tuple[int, str], what: str
) -> None:
    """A BatchError naming the first id of `blocks` from `start` on that is not an integer in
    0 .. limit - 1 (none when all are)."""
    for j, block in enumerate(blocks[start:], start):
        if not is_int(block):
            raise BatchError(f"{w}: {field} block {j} is {show(block)}, not an integer")
        if not 0 <= block < limit[0]:
            raise BatchError(
                f"{w}: {what} block id {block} is outside 0 .. {limit[0] - 1} ({limit[1]})"
            )
