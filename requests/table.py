"""Requests in flight: per-slot state that a step updates in proportion to what changed.

An engine loop drives the buffers with three calls (``RuntimeBuffers.add``, ``finish`` and
``step``): a request is read and checked once, when it arrives; after that a step reads only
what changed: the sampled tokens of the last step (one array indexed by seq slot, the layout of
TensorRT-LLM's decoder outputs), the drafts accepted and the new drafts, the context chunks, the
KV blocks added to a slot and the requests that finished. The per-slot columns (prompt length,
tokens generated, last token per beam, beam width, drafts, explicit positions) live in numpy
arrays here, so a step's columns are a constant number of numpy calls over them, whatever the
batch size, and its Python work grows with the requests that changed.

Rows: context requests first, in arrival order, then the generation requests. A request that
finishes leaves a hole in the generation rows, which the last row fills (vLLM's condense), so
every other row stays where it was and only the moved row's KV blocks follow it; a request whose
prompt is done joins at the end.

The rules read the same ``Batch`` as in a stateless step: its requests are ``Entry`` records,
with copies of the fields the family reads, taken by ``add``, and this state's values for those
a step changes (the KV block lists, the step's draft tokens and context chunk). ``step.plan`` lays
out and checks a step against this table, ``rows.step_view`` makes its ``Batch``, and
``step.commit`` applies it once it has run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import BatchError
from .batch import Limits
from .blocks import BlockTable, window_lists
from .diagnose import check_request
from .values import (
    EMPTY,
    INT32_MAX,
    in_range,
    int_array,
    is_int,
    show,
    unread_error,
    unread_set,
)


class Entry:
    """One request in flight, as the rules read it: copies of the fields the family reads,
    taken when it arrives (the caller's request object is not kept: nothing the caller
    changes afterwards reaches a step), and the fields a step changes."""

    __slots__ = (
        "seq_slot",
        "prompt",
        "beam_width",
        "position_ids",
        "_blocks",
        "_tables",
        "draft_tokens",
        "context_position",
        "context_chunk_size",
        "context_drafts",
        "__dict__",  # the family's other fields (`read`), and what a rule stores (GLM's mask)
    )

    def __init__(
        self,
        request: Any,
        slot: int,
        blocks: list[list[Any]] | None,
        arrival: Arrival,
        read: tuple[tuple[str, Any], ...] = (),
    ) -> None:
        for name, default in read:  # the fields beyond these that the family reads
            setattr(self, name, _own(getattr(request, name, default)))
        self.seq_slot = slot
        # the checked copies taken at add(): the caller's objects may change afterwards
        self.prompt = arrival.prompt
        self.beam_width = int(request.beam_width)
        self.position_ids = arrival.positions
        # the checked copies of its KV block lists until the block tables hold them (``held``)
        self._blocks: Any = blocks
        self._tables: tuple[tuple[int, BlockTable], ...] = ()
        self.context_drafts = arrival.drafts  # ride on the last chunk
        self.draft_tokens: Any = self.context_drafts  # this step's (an array in generation)
        self.context_position = request.context_position
        self.context_chunk_size: int | None = None

    @property
    def kv_block_ids(self) -> Any:
        """The KV block lists as the block tables hold them (they grow in flight), copies: a
        list of lists, or with several attention windows {window: lists}."""
        if not self._tables:
            return self._blocks
        if len(self._tables) == 1:
            return self._tables[0][1].lists_of(self.seq_slot)
        return {w: table.lists_of(self.seq_slot) for w, table in self._tables}

    def held(self, tables: tuple[tuple[int, BlockTable], ...]) -> None:
        """The block tables (window, table) hold the lists from now on (none: the request
        left, and its entry no longer names any)."""
        if not tables:
            self._blocks = None
        self._tables = tables

    @property
    def generated(self) -> Any:
        raise BatchError(
            "a request in flight has no `generated` lists: its token counts and last tokens "
            "are the batch columns (seq_num_tokens, seq_last_token)"
        )


class RequestTable:
    """The per-slot state of the requests in flight (see the module docstring): ``add``,
    ``finish``, ``tokens_back`` and ``step.commit`` are its only writers."""

    def __init__(self, limits: Limits, *, encoder: bool = False) -> None:
        n, w = limits.max_batch_size, limits.max_beam_width
        self.limits, self.encoder = limits, encoder
        self.entries: list[Entry | None] = [None] * n
        # bumped when a slot's request arrives or leaves while tokens are on their way back from
        # the device (``pending``): what they are kept with, to tell a slot's new request
        self.serial = np.zeros(n, np.int64)
        self.prompt_len = np.zeros(n, np.int64)
        self.beam_width = np.ones(n, np.int64)
        self.position = np.zeros(n, np.int64)  # context phase: prompt tokens computed
        self.generated = np.zeros(n, np.int64)  # tokens generated per beam
        self.last = np.zeros((n, w), np.int64)  # the last token of each beam
        self.ndraft = np.zeros(n, np.int64)  # draft tokens of the last step (generation)
        self.drafted: list[int] = []  # the slots that had drafts in the last step
        self.no_drafts = np.zeros(n, np.int64)  # the drafts column of a step without any
        self.no_drafts.flags.writeable = False
        self.one_beam = np.ones(n, np.int64)  # the beam widths of a step without beam search
        self.one_beam.flags.writeable = False
        self.explicit_last = np.full(n, -1, np.int64)  # last explicit position id (-1: none)
        self.prompt_arrays: list[np.ndarray | None] = [None] * n
        self.n_explicit = 0
        self.n_wide = 0  # requests in flight with more than one beam
        self.waiting: dict[int, None] = {}  # context phase, in arrival order
        self.rows = np.zeros(n, np.int64)  # generation rows: their slots, rows[:n_rows]
        self.n_rows = 0
        self.row_entries: list[Entry] = []
        self.row_of = np.full(n, -1, np.int64)
        # what the last step produces tokens for: its generation rows and finished prompts
        # (a slot whose request left since produces nothing)
        self.produced = EMPTY
        self.left: list[int] = []  # slots whose request left since the last step
        self.rows_produced = True  # the last step ran its generation rows (each produced)
        self.completing: list[int] = []  # prompts the last step finished (rows from this one)
        self.changed = True  # requests arrived or finished since the last step
        # each slot's KV block ids, checked when they arrive or grow (a family with a paged
        # KV cache; the KV rules read the ids and counts, and rewrite what changed)
        # one table per attention window (ascending), its lists laid out alike; `kv` the first
        windows = limits.kv_windows or (0,)
        self.kv_windows: tuple[tuple[int, BlockTable], ...] = (
            tuple(
                (window, BlockTable(n, w, limits.kv_width, limits.kv_limit, "kv_block_ids"))
                for window in windows
            )
            if limits.kv_width
            else ()
        )
        self.kvs = tuple(table for _, table in self.kv_windows)
        self.kv = self.kvs[0] if self.kvs else None
        # tokens gathered on the device in the last step: (slot, beam, the slot's serial) of
        # each value on its way back; and the slots a step sampled an out-of-range token for
        self.pending: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None
        # a steady run's gather, laid out once: (columns, src, dst, slots, beams); None once
        # the rows change (a finish, or a full step)
        self.steady_gather: tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.bad: dict[int, int] = {}

    # -------------------------------------------------------------------- arrivals, finishes
    def add(self, request: Any, admit: Callable[[Entry], None] | None = None) -> None:
        """A request arrives in its seq_slot, in the context phase: every field is checked
        now (prompt tokens, beam width, drafts, explicit positions, and by `admit`, the
        family's arrival checks, the fields its rules read), once; nothing is kept unless
        every check passes."""
        L = self.limits
        if L.encoder_engine:
            raise BatchError(
                "the encoder engine runs each request once, in one step: use prepare_step"
            )
        given = getattr(request, "seq_slot", None)
        if not is_int(given) or not 0 <= given < L.max_batch_size:  # type: ignore[operator]
            raise BatchError(
                f"request (seq_slot {show(given)}): seq_slot must be an integer in 0 .. "
                f"{L.max_batch_size - 1}"
            )
        slot = int(given)  # type: ignore[arg-type]
        w = f"request (seq_slot {slot})"
        if self.entries[slot] is not None:
            raise BatchError(f"{w}: seq_slot {slot} already holds a request in flight")
        try:
            unread = unread_set(request, L.unread, L.unread_getter) if L.unread else None
            if unread is not None:
                raise unread_error(w, unread, L.family)
            arrival = _arrival(request, L)
            if arrival is None:  # walk the fields to name the culprit
                check_request(request, w, L, True)
                raise BatchError(f"{w}: the request is invalid")  # pragma: no cover
            ids = request.kv_block_ids
            beams = int(request.beam_width)
            blocks: Any
            if len(self.kvs) > 1 or (
                self.kv is not None and type(ids) is not list and isinstance(ids, Mapping)
            ):
                # one set of lists per window (with one window, either form)
                per = window_lists(ids, [win for win, _ in self.kv_windows], w)
                checked = [
                    table.check(per[win], beams, f"{w}: window {win}")
                    for win, table in self.kv_windows
                ]
                blocks = {win: c[0] for (win, _), c in zip(self.kv_windows, checked)}
                arrays = [c[1] for c in checked]
            elif self.kv is not None:
                blocks, one = self.kv.check(ids, beams, w)
                arrays = [one]
            else:
                blocks, arrays = (None if ids is None else [list(x) for x in ids]), []
        except BatchError:
            raise
        except Exception as exc:
            raise BatchError(f"{w}: malformed request ({type(exc).__name__}: {exc})") from None
        if request.context_chunk_size is not None:
            raise BatchError(
                f"{w}: in flight, context chunks are scheduled per step (step(chunks=...)); "
                "leave context_chunk_size None"
            )
        entry = Entry(request, slot, blocks, arrival, L.read)
        if admit is not None:
            admit(entry)
        prompt = arrival.prompt
        self.entries[slot] = entry
        for table, lists in zip(self.kvs, arrays):
            table.put(slot, lists)
        entry.held(self.kv_windows)
        if self.pending is not None:  # tokens on their way back: none is this request's
            self._serials_pending()
            self.serial[slot] += 1
        self.prompt_len[slot] = len(prompt)
        self.prompt_arrays[slot] = prompt
        self.beam_width[slot] = entry.beam_width
        self.position[slot] = entry.context_position
        self.generated[slot] = 0
        if entry.position_ids is not None:
            self.explicit_last[slot] = int(entry.position_ids[-1])
            self.n_explicit += 1
        self.n_wide += entry.beam_width > 1
        self.waiting[slot] = None
        self.changed = True

    def finish(self, slot: Any) -> None:
        """The request in `slot` leaves (finished or cancelled): its slot is free at once."""
        if type(slot) is not int or not 0 <= slot < self.limits.max_batch_size:
            if not is_int(slot) or not 0 <= slot < self.limits.max_batch_size:
                raise BatchError(f"finish(): {show(slot)} is not a seq slot")
            slot = int(slot)
        entry = self.entries[slot]
        if entry is None:
            raise BatchError(f"finish(): seq_slot {slot} holds no request in flight")
        self.steady_gather = None
        row = int(self.row_of[slot])
        if row >= 0:  # condense: the last row fills the hole
            last = self.n_rows - 1
            moved = int(self.rows[last])
            self.rows[row] = moved
            self.row_of[moved] = row
            self.row_entries[row] = self.row_entries[last]
            self.row_entries.pop()
            self.n_rows = last
            self.row_of[slot] = -1
        self.waiting.pop(slot, None)
        if slot in self.completing:  # a prompt the last step finished: it joins no rows now
            self.completing = [s for s in self.completing if s != slot]
        self.left.append(slot)
        self.entries[slot] = self.prompt_arrays[slot] = None
        if self.pending is not None:  # tokens on their way back: this slot's are stale now
            self._serials_pending()
            self.serial[slot] += 1
        entry.held(())
        for table in self.kvs:
            table.clear(slot)
        if self.drafted and slot in self.drafted:
            self.drafted.remove(slot)
            self.ndraft[slot] = 0
        if self.n_explicit and self.explicit_last[slot] >= 0:  # (-1 everywhere without any)
            self.n_explicit -= 1
            self.explicit_last[slot] = -1
        if entry.beam_width > 1:
            self.n_wide -= 1
        if self.bad:
            self.bad.pop(slot, None)
        self.changed = True

    def _serials_pending(self) -> None:
        """Before a slot's serial changes: a steady step's pending tokens, kept without their
        serials, get them now (they have not changed since that step)."""
        pending = self.pending
        if pending is not None and pending[2] is None:
            self.pending = (pending[0], pending[1], self.serial[pending[0]])

    def tokens_back(self, values: np.ndarray) -> None:
        """The tokens the last step gathered on the device, back on the host: they become the
        last tokens of their beams (of requests still in flight); an out-of-range one marks its
        slot, and every step refuses until that request is finished."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        slots, beams, serials = pending
        L = self.limits
        if serials is None:  # a steady step's, one beam each, and nothing arrived or left since
            self.last[:, 0][slots] = values
            if in_range(values, 0, L.token_limit):
                return
            alive = np.ones(len(slots), bool)
        else:
            alive = self.serial[slots] == serials
            self.last[slots[alive], beams[alive]] = values[alive]
        bad = np.flatnonzero(alive & ((values < 0) | (values >= L.token_limit)))
        for i in bad.tolist():
            self.bad[int(slots[i])] = int(values[i])

    # ---------------------------------------------------------------------------- helpers

    def held(self, slot: int) -> Entry:
        entry = self.entries[slot]
        assert entry is not None
        return entry

    def entry(self, slot: Any, what: str) -> Entry:
        entry = (
            self.entries[slot] if is_int(slot) and 0 <= slot < self.limits.max_batch_size else None
        )
        if entry is None:
            raise BatchError(f"step(): {what}[{show(slot)}]: that seq slot holds no request")
        return entry

    def drafts_run(self, slot: Any, promoted: list[int]) -> int:
        """The draft tokens `slot` verified in the last step (0 for an unknown slot)."""
        if not is_int(slot) or not 0 <= slot < self.limits.max_batch_size:
            return 0
        entry = self.entries[slot]
        if entry is None:
            return 0
        if slot in promoted:
            return len(entry.context_drafts)
        return int(self.ndraft[slot])


def _own(value: Any) -> Any:
    """A request field's value as a request in flight keeps it: lists and tuples copied (one
    level down too: lists of lists), anything else (ints, tensors) as it is."""
    if type(value) is list:
        return [list(x) if type(x) is list else x for x in value]
    if type(value) is tuple:
        return tuple(list(x) if type(x) is list else x for x in value)
    return value


@dataclasses.dataclass(frozen=True)
class Arrival:
    """An arriving request's token fields, checked and copied: nothing the caller changes
    afterwards reaches a step (the prompt and positions as read-only int64 arrays)."""

    prompt: np.ndarray
    positions: np.ndarray | None
    drafts: tuple[int, ...]


def _frozen(a: np.ndarray, source: Any) -> np.ndarray:
    """`a` as a read-only array of its own (not the caller's `source` array)."""
    if isinstance(source, np.ndarray) and np.shares_memory(a, source):
        a = a.copy()
    a.flags.writeable = False
    return a


def _arrival(r: Any, L: Limits) -> Arrival | None:
    """An arriving request's prompt as a checked int64 array, with every other field it
    brings checked too (vectorised: a prompt is long); None if any is wrong (``check_request``
    then names it)."""
    prompt = int_array(r.prompt)
    if prompt is None or not len(prompt) or not in_range(prompt, 0, L.token_limit):
        return None
    n, beam, begin = len(prompt), r.beam_width, r.context_position
    if not is_int(beam) or not 1 <= beam <= L.max_beam_width:
        return None
    if not is_int(begin) or not 0 <= begin < n:
        return None
    g = r.generated
    if g is not None and len(g) and any(map(len, g)):
        return None
    drafts = () if r.draft_tokens is None else r.draft_tokens
    none = type(drafts) in (list, tuple) and not drafts  # most requests bring none
    d = EMPTY if none else int_array(drafts)
    if (
        d is None
        or len(d)
        and (len(d) > L.max_draft_tokens or beam > 1 or not in_range(d, 0, L.token_limit))
    ):
        return None
    p = None
    if r.position_ids is not None:
        p = int_array(r.position_ids)
        if p is None or len(p) != n or not in_range(p, 0, INT32_MAX + 1):
            return None
        if int(p[-1]) + len(drafts) > INT32_MAX:
            return None
        p = _frozen(p, r.position_ids)
    return Arrival(_frozen(prompt, r.prompt), p, tuple(d.tolist()) if len(d) else ())
