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
from ..requests.blocks import id_limit, name_bad_id, request_lists
from ..requests.values import in_range, int_array, is_ordered

_FIRST = itemgetter(0)
_LISTS = frozenset((list, tuple))
_EMPTY = np.zeros(0, np.int64)
_EMPTY.flags.writeable = False
FEW = 8  # stale rows past which from_slots rewrites whole rows in a few numpy calls
FEW_CHANGED = 64  # changed lists past which a decode step rewrites whole rows at once
FEW_ROWS = 32  # lists write_lists encodes V for row by row (past them, with a mask)


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
    # requests in flight: the rows of every (slot, list) of each block table (one per attention
    # window), by the table's identity: a step takes its rows from here
    slots: dict[int, SlotRows] = dataclasses.field(default_factory=dict)


class SlotRows:
    """Requests in flight: the encoded KV rows of every row of the request table's block
    table (``blocks``: a slot's list), with the version of the list each was written from. A
    step takes its sequences' rows from here, whatever row each lands on (finish condenses,
    prompts join), once the rows whose list changed are rewritten; nothing follows rows from
    step to step."""

    def __init__(self, blocks: Any) -> None:
        self.blocks = blocks  # the block table these rows are of (held: its versions count)
        self.rows: np.ndarray | None = None  # [block table rows, K/V, width], the fill's dtype
        self.version = np.full(len(blocks.count), -1, np.int64)
        self.born = np.full(len(blocks.count), -1, np.int64)  # of the list each row is from
        self.length = np.zeros(len(blocks.count), np.int64)  # the ids each row holds
        self.synced = -1  # the table's log position these rows are current to (-1: none)
        # per buffer half and offset in it: what its sequence rows were copied from (``Held``),
        # so a step copies only the rows that differ from what that half holds (written two
        # steps back)
        self.halves: dict[tuple[int, int], Held] = {}


class Held:
    """What a buffer half's KV rows hold: the rows of the sequences laid out by `index` (the
    block-table row of each) with every change the table logged before `synced`; `inverse`
    maps a block-table row to its sequence (made when a decode step first needs it; `shared`
    where two sequences read one list, and the step copies every row instead)."""

    __slots__ = ("out", "index", "synced", "held", "inverse", "counts", "shared")

    def __init__(self, out: np.ndarray, index: np.ndarray, synced: int, held: np.ndarray):
        self.out, self.index, self.synced = out, index, synced
        self.held = held  # the ids each sequence's row held when the layout was written
        # made when a decode step first needs them (plain lists: a few are read one by one)
        self.inverse: list[int] | None = None  # each block-table row's sequence (-1: none)
        self.counts: list[int] = []  # the ids each sequence's row holds
        self.shared = False

    def sequence_of(self, rows: int) -> list[int] | None:
        """Each block-table row's sequence in this layout (-1: none), made once; None where
        two sequences read one list."""
        if self.inverse is None and not self.shared:
            n = len(self.index)
            inverse = np.full(rows, -1, np.int64)
            inverse[self.index] = np.arange(n)
            self.shared = not bool((inverse[self.index] == np.arange(n)).all())
            if not self.shared:
                self.inverse, self.counts = inverse.tolist(), self.held.tolist()
        return self.inverse


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
    slots: FlightLists | None = None  # requests in flight: the rows come from ``SlotRows``


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
        plain = _LISTS.issuperset(map(type, ctx_ids)) and _LISTS.issuperset(map(type, gen_ids))
        # a set or a dict of lists has no order of its own (is_ordered); a 2-D array has one
        if not plain and not all(is_ordered(x, 2) for x in itertools.chain(ctx_ids, gen_ids)):
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
    except (AttributeError, TypeError, LookupError):
        return None
    if not _LISTS.issuperset(map(type, lists)):  # e.g. numpy rows: compare as lists
        if not all(map(is_ordered, lists)):  # a set, a dict, bytes: refused (_diagnose)
            return None
        try:
            lists = [x if type(x) in _LISTS else list(x) for x in lists]
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
    """check_block_lists for requests in flight: every sequence's list, as the block table
    counts it, covers its tokens after the step (length * tokens_per_block >= tokens, or the
    list fills the window); the ids were checked when the table took them. The cold path
    walks the requests to name the first short list."""
    flight = b.flight
    assert flight is not None
    for k, table in enumerate(flight.per_window()):
        lengths = table.count[flight.index]
        below = lengths * tpb < tokens  # short, unless the list fills the window
        if below.any() and (below & (lengths < width)).any():
            need = required_blocks(tokens, tpb, width)
            if flight.tables:  # name the window and the sequence
                short = np.flatnonzero(below & (lengths < width))
                _short_window(b, k, int(short[0]), int(lengths[short[0]]), int(need[short[0]]))
            _diagnose(b, "kv_block_ids", need, width, width_name, limit, what)
    return BlockPlan([], _EMPTY, _EMPTY, None, kept, slots=flight)


def _short_window(b: Batch, window: int, seq: int, have: int, need: int) -> NoReturn:
    """A sequence whose block list of one attention window (its index, ascending) does not
    cover its tokens after the step."""
    n_ctx = b.sizes.num_context_requests
    if seq < n_ctx:
        kind, req, r = "context", seq, b.context[seq]
    else:
        req = int(b.seq_request[seq - n_ctx])
        kind, r = "generation", b.generation[req]
    windows = sorted(r.kv_block_ids)
    raise BatchError(
        f"{kind} request {req} (seq_slot {r.seq_slot}): its block list of attention window "
        f"{windows[window]} holds {have} blocks, but its tokens after this step need {need}; "
        "allocate the blocks before scheduling"
    )


def from_slots(
    kept: KeptRows,
    blocks: Any,
    index: np.ndarray,
    out: np.ndarray,
    offset: int,
    width: int,
    per_block: int,
) -> int:
    """Each sequence's row [K/V, width] (sequence i's list at row index[i] of the block table
    `blocks`) into `out` (a buffer half's rows, flat) from `offset` on, from ``SlotRows``, once
    the slot rows whose list changed since they were written are rewritten from the table (the
    table's change log says which). A decode step (the layout this half holds) writes only the
    rows whose list changed since the half was written; another step copies every row.
    Returns the elements written."""
    slots = kept.slots.get(id(blocks))
    if slots is None or slots.blocks is not blocks:  # the first step of this table
        slots = kept.slots[id(blocks)] = SlotRows(blocks)
    n = len(index)
    rows = out[offset : offset + n * 2 * width].reshape(n, 2, width)
    key = (id(out), offset)
    half = slots.halves.get(key)
    now = blocks.log_end
    if half is not None and half.out is out and half.index is index:
        changed = blocks.changed_since(half.synced)
        inverse = half.sequence_of(len(blocks.count)) if changed is not None else None
        if inverse is not None:  # a decode step: only the rows whose list changed since,
            if changed:  # from the block table (the slot rows catch up at the next full step)
                _write_changed(rows, blocks, inverse, half.counts, changed, per_block)
            half.synced = now
            return rows.size
    if slots.rows is None:
        slots.rows = np.zeros((len(blocks.count), 2, width), out.dtype)
    _refresh(slots, per_block)
    # a new layout: every row (one copy; comparing rows first costs more than it saves)
    np.take(slots.rows, index, axis=0, out=rows, mode="clip")
    slots.halves[key] = Held(out, index, now, blocks.count[index])
    return rows.size


def _write_changed(
    rows: np.ndarray,
    blocks: Any,
    inverse: list[int],
    counts: list[int],
    changed: list[int],
    per_block: int,
) -> None:
    """Each changed block-table row that is a sequence of this layout rewritten from the
    block table: a list that grew gets its new columns (a decode step's usual change: one
    block, two scalar writes), one taken back (a failed step) its whole row; one by one up to
    FEW_CHANGED (cheaper than numpy's calls: about 0.3 µs a list), past it whole rows at once.
    `counts` (the ids each row holds) follows."""
    if len(changed) <= FEW_CHANGED:
        width = rows.shape[-1]
        flat, stride = rows.reshape(-1), 2 * width  # rows is a contiguous half of the buffer
        count, ids = blocks.count.item, blocks.ids.item
        for r in changed:
            seq = inverse[r]
            if seq < 0:
                continue
            n, had = count(r), counts[seq]
            if n == had + 1:
                k = ids(r, had) * per_block
                at = seq * stride + had
                flat[at] = k
                flat[at + width] = k + 1
            elif n != had:
                start = had if n > had else 0
                k = blocks.ids[r, start:n] * per_block
                rows[seq, 0, start:n] = k
                rows[seq, 1, start:n] = k + 1
                rows[seq, :, n:] = 0
            counts[seq] = n
        return
    pairs = [(inverse[r], r) for r in dict.fromkeys(changed) if inverse[r] >= 0]
    if not pairs:
        return
    at_rows = np.array([s for s, _ in pairs], np.int64)
    table_rows = np.array([r for _, r in pairs], np.int64)
    n_ids = write_lists(rows, at_rows, blocks, table_rows, per_block)
    for (seq, _), held in zip(pairs, n_ids):
        counts[seq] = held


def write_lists(
    rows: np.ndarray, at: np.ndarray, blocks: Any, table_rows: np.ndarray, per_block: int
) -> list[int]:
    """rows[at] = the block lists of `table_rows` of the block table `blocks`, encoded
    (K = id * per_block, V = K + 1, 0 past each list), vectorised; returns each list's count.
    Up to FEW_ROWS lists, V's zeros past a list are written row by row (cheaper than the mask
    at those sizes, measured)."""
    k = blocks.ids[table_rows] * per_block  # past a list's count its ids are 0
    rows[at, 0] = k
    held = blocks.count[table_rows]
    counts = held.tolist()
    if len(counts) <= FEW_ROWS:
        k += 1
        for i, n in enumerate(counts):
            k[i, n:] = 0
    else:
        k += np.arange(k.shape[1]) < held[:, None]
    rows[at, 1] = k
    return counts


def _refresh(slots: SlotRows, per_block: int) -> None:
    """Rewrite the slot rows whose list changed since they were: those the table's log lists
    since ``slots.synced``, or, when it reaches back no further, those whose version moved."""
    blocks = slots.blocks
    changed = blocks.changed_since(slots.synced) if slots.synced >= 0 else None
    if changed is None:
        stale = np.flatnonzero(slots.version != blocks.version)
    elif not changed:
        return
    elif len(changed) <= FEW:
        _rewrite_few(slots, list(dict.fromkeys(changed)), per_block)
        slots.synced = blocks.log_end
        return
    else:
        # not np.unique: its first call imports numpy.ma (about 10 ms), a stall in the middle
        # of serving the first time many lists change at once
        stale = np.array(sorted(set(changed)), np.int64)
    if len(stale) > FEW:  # many: whole rows, vectorised
        assert slots.rows is not None
        write_lists(slots.rows, stale, blocks, stale, per_block)
        slots.version[stale] = blocks.version[stale]
        slots.born[stale] = blocks.born[stale]
        slots.length[stale] = blocks.count[stale]
    elif len(stale):
        _rewrite_few(slots, stale.tolist(), per_block)
    slots.synced = blocks.log_end


def forget_halves(kept: KeptRows) -> None:
    """A step written without ``from_slots`` (a stateless one): no half is known to hold
    any slot's row."""
    for slots in kept.slots.values():
        slots.halves.clear()


def _rewrite_few(slots: SlotRows, stale: list[int], per_block: int) -> None:
    """from_slots' rewrite of a few rows: a list that only grew since its row was written
    (the same arrival, more ids) gets its new columns; any other its whole row."""
    blocks, table = slots.blocks, slots.rows
    assert table is not None
    for r in stale:
        n, had = int(blocks.count[r]), int(slots.length[r])
        start = had if slots.born[r] == blocks.born[r] and had <= n else 0
        if not start:
            table[r] = 0
        k = blocks.ids[r, start:n] * per_block
        table[r, 0, start:n] = k
        table[r, 1, start:n] = k + 1
        slots.version[r], slots.born[r], slots.length[r] = blocks.version[r], blocks.born[r], n


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
                name_bad_id(blocks, 0, field, w, limit, what)
            seq += beams
    raise BatchError(f"the {field} of this step are malformed")  # pragma: no cover


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
    return request_lists(w, getattr(r, field, None), r.beam_width, field)


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
        name_bad_id(blocks, start, field, w, limit, what)


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
