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
from ..requests.values import EMPTY, in_range, int_array, is_ordered, same_requests

_FIRST = itemgetter(0)
_LISTS = frozenset((list, tuple))


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
    sequence's list. In flight only `slots` is set (the rows come from the block tables)."""

    lists: list
    blocks: np.ndarray
    lengths: np.ndarray
    changed: list[int] | None
    kept: KeptRows | None = None  # the state the fill updates (self-attention rows)
    # where the generation requests changed: each generation row's position in the kept table
    # (-1: a sequence the table does not hold), and the rows' sequence keys
    moved: list[int] | np.ndarray | None = None
    keys: list | None = None
    slots: FlightLists | None = None  # requests in flight: the rows come from the tables


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
    same = kept is not None and same_requests(kept.requests, b.generation)
    if snapshot is None:
        changed, convert = None, lists
    elif same and snapshot == gen:
        changed, convert = [], lists[:n_ctx]
    elif same:
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
    """check_block_lists for requests in flight: ``check_cover``; the ids were checked when
    the table took them."""
    check_cover(b, tokens, tpb, width, width_name, limit, what)
    return BlockPlan([], EMPTY, EMPTY, None, kept, slots=b.flight)


def check_cover(
    b: Batch,
    tokens: np.ndarray,
    tpb: int,
    width: int,
    width_name: str = "max_blocks_per_seq",
    limit: tuple[int, str] | None = None,
    what: str = "KV",
) -> None:
    """Requests in flight: every sequence's block list, as its window's block table counts it,
    covers the sequence's `tokens` after the step (length * tokens_per_block >= tokens, or the
    list fills the window's `width` blocks). Every step that checks coverage in flight checks
    it here, with one message; the cold path walks the requests to name the first short list."""
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
            bound = b.limits.kv_limit if limit is None else limit  # the table's own id bound
            _diagnose(b, "kv_block_ids", need, width, width_name, bound, what)


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
