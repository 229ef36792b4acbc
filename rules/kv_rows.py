"""Paged KV-cache block rows, shared by the self- and cross-attention block offsets.

A request carries its block ids per beam (or one list shared by its beams) under a request
field; each sequence row of the step gets its list. The rows use TensorRT-LLM's KVCacheIndex
encoding for a pool laid out [blocks, layers, K/V, ...]: (block_id * num_local_layers + 0) * 2
+ (0 for K, 1 for V); the kernel adds the layer. Columns past a sequence's blocks hold 0.

Every list is checked before a row is written: it must cover the sequence's tokens after the
step (the attention kernel reads exactly those columns; an uncovered column would hold 0, which
is block 0, another sequence's memory), hold at most `width` blocks, and hold integer ids in
the pool (``num_kv_blocks``) whose index fits the int32 rows.
"""

from __future__ import annotations

import dataclasses
import itertools
from operator import attrgetter, itemgetter
from typing import Any, NoReturn

import numpy as np

from ..errors import BatchError
from ..requests.batch import Batch, FlightLists
from ..requests.values import INT32_MAX, in_range, int_array, is_int, show

_FIRST = itemgetter(0)
_EMPTY = np.zeros(0, np.int64)
_EMPTY.flags.writeable = False
MANY = 16  # stale lists past which their ids are checked and written as one array


def id_limit(num_local_layers: int, num_kv_blocks: int) -> tuple[int, str]:
    """Block ids lie in 0 .. limit - 1: the pool's blocks (0: unbounded), and at most what the
    int32 index (id * num_local_layers * 2 + 1) can encode."""
    encodable = (INT32_MAX - 1) // (2 * num_local_layers) + 1
    if num_kv_blocks and num_kv_blocks <= encodable:
        return num_kv_blocks, f"num_kv_blocks={num_kv_blocks}"
    return encodable, f"the int32 block index with num_local_layers={num_local_layers}"


def required_blocks(tokens: np.ndarray, tokens_per_block: int, width: int) -> np.ndarray:
    """Blocks a sequence of `tokens` tokens reads: its tokens in blocks, at most the window."""
    return np.minimum(-(-tokens // tokens_per_block), width)


@dataclasses.dataclass
class KeptRows:
    """The self-attention KV rows' state between steps: the generation rows of the last step
    with a copy of the block lists they came from (compared by value, so a list changed in
    place is seen; None before the first step), and the blocks that advance() entered in the
    last decode step (a buffer half two steps behind still lacks them)."""

    snapshot: list | None = None
    table: np.ndarray | None = None
    entered: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    # the generation requests the rows were last laid out for, and each row's sequence key
    # (request, beam): when the requests change (finishes, arrivals), a kept row follows its
    # sequence to its new position instead of being rebuilt
    requests: tuple[Any, ...] = ()
    keys: list | None = None
    # requests in flight: the rows of every (slot, list) of the request table (a full step
    # takes its rows from here; a decode step continues the last step's, as advance() does)
    slots: SlotRows | None = None


class SlotRows:
    """Requests in flight: the KV rows of every (seq slot, list) of the request table, encoded,
    with the serial of the slot's request, the length and the version of the list each was
    written from (the request table's `list_version`). A
    step takes its sequences' rows from here, whatever row each lands on (finish condenses,
    prompts join), and first rewrites the rows of lists that are new or grew; nothing follows
    rows from step to step."""

    def __init__(self, slots: int, lists: int, width: int) -> None:
        self.rows: np.ndarray | None = None  # [slots * lists, K/V, width], the fill's dtype
        self.shape = (slots * lists, 2, width)
        self.serial = np.full(slots * lists, -1, np.int64)
        self.length = np.zeros(slots * lists, np.int64)
        self.version = np.full(slots * lists, -1, np.int64)


class SlotPlan:
    """A step's sequences in ``SlotRows`` (`index`), and the rows to rewrite first: `stale`,
    with their lists' request serials, lengths and versions, the column each rewrite starts at
    (`starts`: a grown list keeps the columns it had, another list starts at 0) and the ids
    from there (`tails`, checked), one list each."""

    __slots__ = ("index", "stale", "serials", "lengths", "starts", "tails", "versions")

    def __init__(
        self,
        index: np.ndarray,
        stale: list[int],
        serials: list[int],
        lengths: list[int],
        starts: list[int],
        tails: list[Any],
        versions: list[int],
    ) -> None:
        self.index, self.stale, self.serials, self.lengths = index, stale, serials, lengths
        self.starts, self.tails, self.versions = starts, tails, versions


def sequence_keys(b: Batch) -> list:
    """A key per generation sequence, in row order: its request (by identity) and beam."""
    if b.sizes.num_generation_sequences == len(b.generation):
        return list(map(id, b.generation))
    return [(id(r), k) for r, w in zip(b.generation, b.gen_beam_width.tolist()) for k in range(w)]


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """One step's checked block lists, for the fill: `blocks` and `lengths` are the converted
    ids of the context lists, then of the generation lists to rebuild: all of them when
    `changed` is None, else the generation sequences listed in `changed`. `lists` holds every
    sequence's list. In flight only `slots` is set (the rows come from ``SlotRows``)."""

    lists: list
    blocks: np.ndarray
    lengths: np.ndarray
    changed: list[int] | None
    kept: KeptRows | None = None  # the state the fill updates (self-attention rows)
    # where the generation requests changed: each generation row's position in the kept table
    # (-1: a sequence the table does not hold), and the rows' sequence keys
    moved: list[int] | np.ndarray | None = None
    keys: list | None = None
    slots: SlotPlan | None = None  # requests in flight: the rows come from ``SlotRows``


def _block_lists(b: Batch, field: str) -> list | None:
    """Each sequence's block list, in row order; None if a request's `field` is missing or
    has neither one list nor one per beam. A context request is one sequence: its first list."""
    get = attrgetter(field)
    try:
        ctx_ids = list(map(get, b.context))
        gen_ids = list(map(get, b.generation))
        counts = list(map(len, gen_ids))
        if not all(map(len, ctx_ids)) or not all(counts):
            return None
    except (AttributeError, TypeError):
        return None
    if any(len(ids) not in (1, r.beam_width) for ids, r in zip(ctx_ids, b.context)):
        return None
    lists = list(map(_FIRST, ctx_ids))
    if b.sizes.num_generation_sequences == len(counts) == counts.count(1):
        lists += map(_FIRST, gen_ids)  # one beam, one list each: the common case
    else:
        for ids, beams in zip(gen_ids, b.gen_beam_width):
            if len(ids) not in (1, beams):
                return None
            lists += [ids[k if len(ids) > 1 else 0] for k in range(beams)]
    if not {list, tuple}.issuperset(map(type, lists)):  # e.g. numpy rows: compare as lists
        try:
            lists = [x if type(x) in (list, tuple) else list(x) for x in lists]
        except TypeError:
            return None
    return lists


def check_block_lists(
    b: Batch,
    field: str,
    *,
    tokens: np.ndarray,
    tokens_per_block: int,
    width: int,
    width_name: str,
    limit: tuple[int, str],
    what: str,
    kept: KeptRows | None = None,
) -> BlockPlan:
    """The step's block lists of `field`, checked: each sequence's list holds at least
    `need[i]` and at most `width` blocks, every id converted is an integer in 0 .. limit - 1.
    Of the generation lists, only those that differ from `kept`'s snapshot are converted (the
    others were checked when they were). A BatchError names the first bad request."""
    if b.flight is not None and kept is not None and field == "kv_block_ids":
        # in flight the table counts every list's length: the check reads no list but those
        # whose rows are new or grew
        return _check_flight(b, kept, tokens, tokens_per_block, width, width_name, limit, what)
    snapshot = kept.snapshot if kept is not None else None
    need = required_blocks(tokens, tokens_per_block, width)
    lists = _block_lists(b, field)
    if lists is None:
        _diagnose(b, field, need, width, width_name, limit, what)
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    if len(lengths) and ((lengths > width).any() or (lengths < need).any()):
        _diagnose(b, field, need, width, width_name, limit, what)
    n_ctx = b.sizes.num_context_requests
    gen = lists[n_ctx:]
    changed: list[int] | None
    moved: list[int] | np.ndarray | None = None
    keys = None
    same_requests = kept is not None and kept.requests == b.generation  # identity, then eq
    if snapshot is None:
        changed, convert = None, lists
    elif same_requests and snapshot == gen:
        changed, convert = [], lists[:n_ctx]
    elif same_requests:
        changed = [i for i, (now, then) in enumerate(zip(gen, snapshot)) if now != then]
        convert = lists[:n_ctx] + [gen[i] for i in changed]
    else:  # finishes and arrivals: match the rows to their sequences by key
        assert kept is not None and kept.keys is not None
        keys = sequence_keys(b)
        position = {key: i for i, key in enumerate(kept.keys)}
        moved = [position.get(key, -1) for key in keys]
        changed = [i for i, (j, now) in enumerate(zip(moved, gen)) if j < 0 or snapshot[j] != now]
        convert = lists[:n_ctx] + [gen[i] for i in changed]
    blocks = int_array(list(itertools.chain.from_iterable(convert)))
    if blocks is None or not in_range(blocks, 0, limit[0]):
        _diagnose(b, field, need, width, width_name, limit, what)
    sub = (
        lengths if changed is None else np.concatenate((lengths[:n_ctx], lengths[n_ctx:][changed]))
    )
    return BlockPlan(lists, blocks, sub, changed, kept, moved, keys)


def _check_flight(
    b: Batch,
    kept: KeptRows,
    tokens: np.ndarray,
    tpb: int,
    width: int,
    width_name: str,
    limit: tuple[int, str],
    what: str,
) -> BlockPlan:
    """check_block_lists for requests in flight: every sequence's list length, as the table
    counts them, covers its tokens after the step (length * tokens_per_block >= tokens, or the
    list fills the window) within `width`; the lists whose rows ``SlotRows`` lacks (a new
    request, a list that grew) are converted and their ids checked. The cold path walks the
    requests to name the first bad list."""
    flight = b.flight
    assert flight is not None
    field = "kv_block_ids"

    def fail() -> NoReturn:
        _diagnose(b, field, required_blocks(tokens, tpb, width), width, width_name, limit, what)

    lengths = flight.table.list_lengths[flight.index]
    if len(lengths) and (
        int(lengths.max()) > width or ((lengths * tpb < tokens) & (lengths < width)).any()
    ):
        fail()
    plan = slot_plan(kept, flight, width, limit[0])
    if plan is None:
        fail()
    return BlockPlan([], _EMPTY, _EMPTY, None, kept, slots=plan)


def slot_plan(kept: KeptRows, flight: FlightLists, width: int, limit: int) -> SlotPlan | None:
    """Where the step's lists are in the kept ``SlotRows``, and which of those rows to rewrite:
    those whose list's version (the request table bumps it when a list arrives, grows or is
    undone) is not the one they were written from, with their ids checked (a grown list's
    only past the columns its row has). None when an id is not an integer in the pool or a
    list is longer than `width` (the caller names it)."""
    t, index = flight.table, flight.index
    rows = kept.slots
    if rows is None:  # the first step in flight, or a failed step replaced the state
        rows = kept.slots = SlotRows(t.serial.size, t.limits.max_beam_width, width)
    versions = t.list_version[index]
    stale = np.flatnonzero(rows.version[index] != versions)
    if not len(stale):
        return SlotPlan(index, [], [], [], [], [], [])
    where = index[stale]
    if t.n_wide:  # beams may share one list: each list once
        where, first = np.unique(where, return_index=True)
        stale = stale[first]
    where_l = where.tolist()
    slots = flight.seq_slots[stale].tolist()
    serials = t.serial[slots].tolist()
    new = t.list_lengths[where].tolist()
    had = rows.length[where].tolist()
    same = (rows.serial[where] == t.serial[slots]).tolist()
    entries, starts, tails = t.entries, [], []
    many = len(where_l) > MANY  # then the ids are checked as one array
    for slot, k, n, h, keep in zip(slots, flight.seq_lists[stale].tolist(), new, had, same):
        start = h if keep and h <= n else 0
        tail = entries[slot].kv_block_ids[k][start:n]
        if n > width or not many and not all(is_int(x) and 0 <= x < limit for x in tail):
            return None
        starts.append(start)
        tails.append(tail)
    if many:
        ids = int_array(list(itertools.chain.from_iterable(tails)))
        if ids is None or not in_range(ids, 0, limit):
            return None
        tails = [ids]  # one array, list after list
    return SlotPlan(index, where_l, serials, new, starts, tails, versions[stale].tolist())


def _rewrite(slots: SlotRows, plan: SlotPlan, layers: int) -> None:
    """The plan's stale rows of `slots` [rows, K/V, width]: a row starting at column 0
    zeroed, then each list's ids from its start column encoded (K, and V one further), and the
    serial, length and version each row is now of."""
    table = slots.rows
    assert table is not None
    width = table.shape[-1]
    flat = table.reshape(-1)  # contiguous: K's column j of row r is r * 2w + j, V's w further
    per_block = 2 * layers
    if len(plan.stale) > MANY:  # one scatter by flat position
        _scatter_tails(table, plan, layers)
    else:
        for row, start, n, tail in zip(plan.stale, plan.starts, plan.lengths, plan.tails):
            if not start:
                table[row] = 0
            base = row * 2 * width + start
            if n - start <= 2:  # a grown list's block or two: scalar writes
                for j, block in enumerate(tail, base):
                    flat[j] = k = block * per_block
                    flat[j + width] = k + 1
            elif tail:
                ids = np.array(tail, np.int64) * per_block
                flat[base : base + len(tail)] = ids
                flat[base + width : base + width + len(tail)] = ids + 1
    slots.serial[plan.stale] = plan.serials
    slots.length[plan.stale] = plan.lengths
    slots.version[plan.stale] = plan.versions


def _scatter_tails(table: np.ndarray, plan: SlotPlan, layers: int) -> None:
    """_rewrite's ids for many lists at once: the plan's one array of ids, list after list,
    each from its start column (a row starting at 0 zeroed first)."""
    stale = np.array(plan.stale, np.int64)
    starts = np.array(plan.starts, np.int64)
    fresh = stale[starts == 0]
    if len(fresh):
        table[fresh] = 0
    counts = np.array(plan.lengths, np.int64) - starts
    _scatter(table, stale, plan.tails[0], counts, layers, starts)


def from_slots(kept: KeptRows, plan: SlotPlan, rows: np.ndarray, layers: int) -> None:
    """`rows` [sequences, K/V, width]: each sequence's row from ``SlotRows``, once the rows of
    the plan's new or grown lists are rewritten there."""
    slots = kept.slots
    assert slots is not None  # slot_plan made it
    if slots.rows is None:  # every row is stale before the first (slot_plan saw serials -1)
        slots.rows = np.zeros(slots.shape, rows.dtype)
    if len(plan.stale):
        _rewrite(slots, plan, layers)
    np.take(slots.rows, plan.index, axis=0, out=rows, mode="clip")


def _diagnose(
    b: Batch,
    field: str,
    need: np.ndarray,
    width: int,
    width_name: str,
    limit: tuple[int, str],
    what: str,
) -> NoReturn:
    """Walk the requests and raise a BatchError for the first bad list (the cold path)."""
    seq = 0
    for kind, reqs in (("context", b.context), ("generation", b.generation)):
        for i, r in enumerate(reqs):
            w = f"{kind} request {i} (seq_slot {r.seq_slot})"
            lists = _request_lists(w, r, field)
            beams = 1 if kind == "context" else int(r.beam_width)
            for k in range(beams):
                blocks = lists[k if len(lists) > 1 else 0]
                if len(blocks) > width:
                    raise BatchError(
                        f"{w}: {len(blocks)} {what} blocks exceed {width_name}={width}"
                    )
                if len(blocks) < need[seq + k]:
                    raise BatchError(
                        f"{w}: {field} holds {len(blocks)} blocks, but its tokens after this "
                        f"step need {int(need[seq + k])}; allocate the blocks before scheduling"
                    )
                _name_bad_id(blocks, 0, field, w, limit, what)
            seq += beams
    raise BatchError(f"the {field} of this step are malformed")  # pragma: no cover


def admit_kv_blocks(
    r: Any, *, max_blocks_per_seq: int, num_local_layers: int, num_kv_blocks: int = 0
) -> None:
    """A request arriving in flight: its kv_block_ids (the entry's own copy) are one list, or
    one per beam, of at most max_blocks_per_seq integer ids in the pool. That they cover the
    tokens is checked by the step that runs them (blocks may be appended by then)."""
    admit_lists(
        r,
        "kv_block_ids",
        width=max_blocks_per_seq,
        width_name="max_blocks_per_seq",
        limit=id_limit(num_local_layers, num_kv_blocks),
        what="KV",
    )


def admit_cross_kv_blocks(
    r: Any, *, max_cross_blocks_per_seq: int, num_local_layers: int, num_kv_blocks: int = 0
) -> None:
    """admit_kv_blocks for the cross-attention block lists."""
    admit_lists(
        r,
        "cross_kv_block_ids",
        width=max_cross_blocks_per_seq,
        width_name="max_cross_blocks_per_seq",
        limit=id_limit(num_local_layers, num_kv_blocks),
        what="cross KV",
    )


def admit_lists(
    r: Any, field: str, *, width: int, width_name: str, limit: tuple[int, str], what: str
) -> None:
    """Request `r`'s block lists of `field`: one list (shared by all beams) or one per beam,
    each of at most `width` integer ids in 0 .. limit - 1; a BatchError naming the request and
    the first bad value otherwise."""
    w = f"request (seq_slot {r.seq_slot})"
    for blocks in _request_lists(w, r, field):
        check_ids(blocks, field, w, width=width, width_name=width_name, limit=limit, what=what)


def _request_lists(w: str, r: Any, field: str) -> list:
    """Request `r`'s block lists of `field`, one (shared by all beams) or one per beam; a
    BatchError otherwise."""
    ids: Any = getattr(r, field, None)
    try:
        count = len(ids) if ids is not None else 0
        lists = list(ids) if count else []
    except TypeError:
        count, lists = 0, []
    if not count or count not in (1, r.beam_width) or not all(map(_is_sequence, lists)):
        got = f"{count} lists" if count else show(ids)
        raise BatchError(
            f"{w}: {field} needs one block list (shared by all beams) or one per beam, got {got}"
        )
    return lists


def check_ids(
    blocks: Any,
    field: str,
    w: str,
    *,
    width: int,
    width_name: str,
    limit: tuple[int, str],
    what: str,
    start: int = 0,
) -> None:
    """One block list: at most `width` ids, those from `start` on integers in 0 .. limit - 1."""
    if len(blocks) > width:
        raise BatchError(f"{w}: {len(blocks)} {what} blocks exceed {width_name}={width}")
    a = int_array(blocks[start:])
    if a is None or not in_range(a, 0, limit[0]):
        _name_bad_id(blocks, start, field, w, limit, what)


def _name_bad_id(
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


def _is_sequence(x: Any) -> bool:
    try:
        len(x)
    except TypeError:
        return False
    return True


def write_kv_rows(
    rows: np.ndarray, blocks: np.ndarray, lengths: np.ndarray, num_local_layers: int
) -> None:
    """rows[i] = the [K/V, width] block indices of the i-th list (`lengths[i]` ids of the flat
    `blocks`), zero-padded."""
    if not len(lengths):
        return
    rows[:] = 0
    _scatter(rows, np.arange(len(lengths)), blocks, lengths, num_local_layers)


def write_at(
    table: np.ndarray,
    at: Any,
    blocks: np.ndarray,
    lengths: np.ndarray,
    num_local_layers: int,
) -> None:
    """table[at[k]] = the rows of the k-th list, zero-padded (the other rows stay)."""
    if not len(lengths):
        return
    at = np.asarray(at, dtype=np.int64)
    table[at] = 0
    _scatter(table, at, blocks, lengths, num_local_layers)


def _scatter(
    table: np.ndarray,
    at: np.ndarray,
    blocks: np.ndarray,
    lengths: np.ndarray,
    layers: int,
    starts: np.ndarray | int = 0,
) -> None:
    """The k-th list's indices into lengths[k] columns of row at[k], from column starts[k]
    (0: the first), by flat position: [rows, K/V, width] is contiguous, so K's column j of row
    r is r * 2w + j and V's is w further (fewer numpy calls than a three-axis index; this runs
    every step)."""
    if not table.flags.c_contiguous:  # a reshape would copy, and the writes be lost
        raise ValueError("KV rows to write by flat position must be contiguous")
    flat = table.reshape(-1)
    width = table.shape[-1]
    first = np.add.accumulate(lengths) - lengths  # each list's offset in `blocks`
    at_k = np.repeat(at * (2 * width) + starts - first, lengths) + np.arange(len(blocks))
    index = blocks * (2 * layers)
    flat[at_k] = index
    flat[at_k + width] = index + 1
