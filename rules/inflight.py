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
the request object for the fields fixed in flight and this state's values for those a step
changes (the KV block lists, the step's draft tokens and context chunk).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from itertools import chain
from typing import Any

import numpy as np

from ..errors import BatchError
from ..requests.values import (
    BOOLS,
    INT32_MAX,
    check_token_dtype,
    in_range,
    int_array,
    is_int,
    show,
)
from .batch import Batch, FlightRows, Limits, check_request, view
from .decode import Sampled

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


class Entry:
    """One request in flight, as the rules read it: the fields a step changes are set here,
    every other field is the request's own (fixed while it is in flight)."""

    __slots__ = (
        "request",
        "seq_slot",
        "prompt",
        "beam_width",
        "position_ids",
        "kv_block_ids",
        "draft_tokens",
        "context_position",
        "context_chunk_size",
        "context_drafts",
        "__dict__",  # what a rule stores on a request (GLM's mask position)
    )

    def __init__(
        self, request: Any, slot: int, blocks: list[list[Any]] | None, arrival: Arrival
    ) -> None:
        self.request = request
        self.seq_slot = slot
        # the checked copies taken at add(): the caller's objects may change afterwards
        self.prompt = arrival.prompt
        self.beam_width = int(request.beam_width)
        self.position_ids = arrival.positions
        self.kv_block_ids = blocks
        self.context_drafts = arrival.drafts  # ride on the last chunk
        self.draft_tokens: Any = self.context_drafts  # this step's (an array in generation)
        self.context_position = request.context_position
        self.context_chunk_size: int | None = None

    def __getattr__(self, name: str) -> Any:  # a field no step changes: the request's own
        return getattr(self.request, name)

    @property
    def generated(self) -> Any:
        raise BatchError(
            "a request in flight has no `generated` lists: its token counts and last tokens "
            "are the batch columns (seq_num_tokens, seq_last_token)"
        )


@dataclasses.dataclass(frozen=True)
class OnDevice:
    """Sampled tokens that stay on the buffers' device: what the host knows of them (the
    runtime checked the tensor's shape and dtype)."""

    columns: int  # per seq slot: tokens[slot] (1) or tokens[slot, beam]


@dataclasses.dataclass(frozen=True)
class TokenGather:
    """A step's gather of tokens that stay on the device: value i is the flat element
    ``src[i]`` of the tokens; the first ``len(dst)`` go to input position ``dst[i]`` (the
    others only go back to the host)."""

    src: np.ndarray
    dst: np.ndarray


@dataclasses.dataclass
class Plan:
    """One checked step of the requests in flight, not yet committed: the batch its rules
    fill (None for a steady decode step, which continues from the last step's buffers with
    `tokens`) and the state it leaves once it has run."""

    batch: Batch | None
    tokens: Sampled | None  # steady: each sequence's new input token, in row order (checked)
    grown: tuple[tuple[int, int], ...]  # steady: (sequence, list length before) of grown lists
    generated: np.ndarray | None  # None: a steady step, applied to the rows at commit
    last: np.ndarray | None
    ndraft: np.ndarray
    drafted: list[int]
    positions: list[tuple[int, int]]  # context slots and their prompt position after the step
    promoted: list[int]  # last step's finished prompts, generation rows from this step
    completing: list[int]  # context slots whose last chunk this step runs
    undo_blocks: list[tuple[list, int]]
    undo_drafts: list[tuple[Entry, Any]]
    generation: bool = True  # the generation rows ran (and produce tokens)
    grew: set[int] = dataclasses.field(default_factory=set)  # slots whose block lists grew
    # tokens that stay on the device: the gather the step runs there, and the (slot, beam) of
    # each value it copies back (their state entries once they land)
    gather: TokenGather | None = None
    gathered: tuple[np.ndarray, np.ndarray] | None = None

    def undo(self) -> None:
        """The step failed: the block lists and drafts it set are as they were."""
        _undo(self.undo_blocks, self.undo_drafts)


def _undo(blocks: list[tuple[list, int]], drafts: list[tuple[Entry, Any]]) -> None:
    for ids, n in blocks:
        del ids[n:]
    for entry, values in drafts:
        entry.draft_tokens = values


class InFlight:
    """The per-slot state of the requests in flight (see the module docstring)."""

    def __init__(self, limits: Limits, *, encoder: bool = False) -> None:
        n, w = limits.max_batch_size, limits.max_beam_width
        self.limits, self.encoder = limits, encoder
        self.entries: list[Entry | None] = [None] * n
        self.serial = np.zeros(n, np.int64)  # bumped when a slot's request arrives or leaves
        self.prompt_len = np.zeros(n, np.int64)
        self.beam_width = np.ones(n, np.int64)
        self.position = np.zeros(n, np.int64)  # context phase: prompt tokens computed
        self.generated = np.zeros(n, np.int64)  # tokens generated per beam
        self.last = np.zeros((n, w), np.int64)  # the last token of each beam
        self.ndraft = np.zeros(n, np.int64)  # draft tokens of the last step (generation)
        self.drafted: list[int] = []  # the slots that had drafts in the last step
        self.no_drafts = np.zeros(n, np.int64)  # the drafts column of a step without any
        self.no_drafts.flags.writeable = False
        self.explicit_last = np.full(n, -1, np.int64)  # last explicit position id (-1: none)
        self.prompt_arrays: list[np.ndarray | None] = [None] * n
        self.n_explicit = 0
        self.n_wide = 0  # requests in flight with more than one beam
        self.waiting: dict[int, None] = {}  # context phase, in arrival order
        self.rows = np.zeros(n, np.int64)  # generation rows: their slots, rows[:n_rows]
        self.n_rows = 0
        self.row_entries: list[Entry] = []
        self.row_of = np.full(n, -1, np.int64)
        # what the last step produces tokens for: its generation rows and finished prompts,
        # each with its slot's serial then (a slot finished or reused since produces nothing)
        self.produced, self.produced_serial = _EMPTY, _EMPTY
        self.completing: list[tuple[int, int]] = []
        self.changed = True  # requests arrived or finished since the last step
        # the KV rows the fills keep: each slot's first sequence among the generation rows of
        # the last full step (`full`, its serial; -1: none), and the slots whose block lists
        # grew in the steps in place since
        self.full = 0
        self.kept_first = np.full(n, -1, np.int64)
        self.kept_rows = 0  # generation sequences of the last full step
        self.kept_one_beam = True  # ... one per row (kept_first then indexes rows)
        self.refilled: set[int] = set()  # rows finish() has moved another request into since
        # each slot's KV block lists: how many (0: none, or not one per beam or one for all:
        # the KV check walks the lists) and each one's length, as of the last step
        self.n_lists = np.zeros(n, np.int64)
        self.n_unlisted = 0  # requests in flight with n_lists 0
        self.n_blocks = np.zeros((n, w), np.int64)
        # tokens gathered on the device in the last step: (slot, beam, the slot's serial) of
        # each value on its way back; and the slots a step sampled an out-of-range token for
        self.pending: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None
        # a steady run's gather, laid out once: (columns, src, dst, slots, beams); None once
        # the rows change (a finish, or a full step)
        self.steady_gather: tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.bad: dict[int, int] = {}

    # -------------------------------------------------------------------- arrivals, finishes
    def add(self, request: Any) -> None:
        """A request arrives in its seq_slot, in the context phase: every field is checked
        now (prompt tokens, beam width, drafts, explicit positions), once."""
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
            arrival = _arrival(request, L)
            if arrival is None:  # walk the fields to name the culprit
                check_request(request, w, L, True)
                raise BatchError(f"{w}: the request is invalid")  # pragma: no cover
            ids = request.kv_block_ids
            blocks = None if ids is None else [list(x) for x in ids]
        except BatchError:
            raise
        except Exception as exc:
            raise BatchError(f"{w}: malformed request ({type(exc).__name__}: {exc})") from None
        if request.context_chunk_size is not None:
            raise BatchError(
                f"{w}: in flight, context chunks are scheduled per step (step(chunks=...)); "
                "leave context_chunk_size None"
            )
        entry = Entry(request, slot, blocks, arrival)
        prompt = arrival.prompt
        self.entries[slot] = entry
        # lists absent, or more than the beams: 0, and the KV check walks (and refuses) them
        n_lists = 0 if blocks is None or not 1 <= len(blocks) <= L.max_beam_width else len(blocks)
        self.n_lists[slot] = n_lists
        self.n_unlisted += not n_lists
        self._count_blocks(slot, blocks, self.n_blocks)
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
            self.refilled.add(row)
        self.waiting.pop(slot, None)
        self.entries[slot] = None
        self.prompt_arrays[slot] = None
        self._serials_pending()
        self.serial[slot] += 1
        self.kept_first[slot] = -1
        self.n_unlisted -= not self.n_lists[slot]
        self.n_lists[slot] = 0
        if slot in self.drafted:
            self.drafted.remove(slot)
            self.ndraft[slot] = 0
        self.n_explicit -= self.explicit_last[slot] >= 0
        self.explicit_last[slot] = -1
        self.n_wide -= entry.beam_width > 1
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

    # ------------------------------------------------------------------------------ a step
    def plan(
        self,
        tokens: Any,
        *,
        accepted: Mapping[int, int] | None = None,
        drafts: Mapping[int, Any] | None = None,
        chunks: Mapping[int, int] | None = None,
        blocks: Mapping[int, Any] | None = None,
        generation: bool = True,
        steady: bool = False,
        on_device: bool = False,
    ) -> Plan:
        """Check the next step and lay it out; nothing is committed (``commit``) and only the
        block lists and drafts are set on the entries (``Plan.undo`` restores them).

        `steady`: the last step can be continued in place (generation only, no drafts); the
        plan then has no batch when nothing but the tokens changed. `on_device`: `tokens` is
        ``OnDevice``, a tensor on the buffers' device gathered there (``Plan.gather``)."""
        self._refuse_bad()
        if (
            steady
            and generation
            and not (self.changed or self.completing or self.waiting)
            and not (drafts or accepted or self.drafted)
            and self.n_rows
        ):
            return self._steady(tokens, blocks, on_device)
        undo_blocks: list[tuple[list, int]] = []
        undo_drafts: list[tuple[Entry, Any]] = []
        try:
            # the tokens the last step produced: its generation rows still in flight and the
            # prompts it finished (they join the generation rows now)
            if self.changed:  # requests left or arrived: only those still in flight produce
                alive = self.produced[self.serial[self.produced] == self.produced_serial]
            else:
                alive = self.produced
            promoted = [s for s, serial in self.completing if self.serial[s] == serial]
            promoted_a = np.array(promoted, np.int64) if promoted else _EMPTY
            producers = np.concatenate((promoted_a, alive)) if promoted else alive
            generated, last = self._produced_tokens(tokens, producers, on_device)
            if accepted:
                generated = self._accepted(accepted, generated, producers, promoted)
            # this step's generation rows: the rows in flight, then the promoted prompts
            n_old = self.n_rows
            rows = (
                np.concatenate((self.rows[:n_old], promoted_a)) if promoted else self.rows[:n_old]
            )
            row_entries = self.row_entries + [self._held(s) for s in promoted]
            if not generation:  # the generation requests sit this step out
                if drafts:
                    raise BatchError(
                        "step(): drafts given, but generation=False runs no generation"
                    )
                rows, row_entries = _EMPTY, []
            ndraft, drafted = self._step_drafts(drafts, promoted, rows, undo_drafts)
            grew = self._grow(blocks, undo_blocks)
            context, positions, completing = self._context(chunks)
            batch = self._batch(context, rows, row_entries, generated, last, ndraft, set(grew))
            gather, gathered = (
                self._gather(batch, tokens.columns, producers)
                if on_device and producers.size
                else (None, None)
            )
            return Plan(
                batch,
                None,
                (),
                generated,
                last,
                ndraft,
                drafted,
                positions,
                promoted,
                completing,
                undo_blocks,
                undo_drafts,
                generation,
                set(grew),
                gather,
                gathered,
            )
        except BaseException:
            _undo(undo_blocks, undo_drafts)
            raise

    def _refuse_bad(self) -> None:
        """A step sampled an out-of-range token on the device: no step until it is finished."""
        if self.bad:
            slot, value = next(iter(self.bad.items()))
            L = self.limits
            raise BatchError(
                f"step(): a step sampled token {value} for seq_slot {slot}, outside 0 .. "
                f"{L.token_limit - 1} ({L.token_limit_text}); the device wrote the pad token "
                f"in its place. Finish that request (finish({slot})) before the next step"
            )

    def _produced_tokens(
        self, tokens: Any, producers: np.ndarray, on_device: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """The slots' generated counts and last tokens once the producers' tokens are in
        (copies; the state's own arrays when no slot produced). Tokens that stay on the
        device are counted only: their values land later (``tokens_back``)."""
        L = self.limits
        generated, last = self.generated, self.last
        if not producers.size:
            if tokens is not None and (on_device or not _empty(tokens)):
                raise BatchError(
                    "step(): no request in flight produced a token in the last step; pass "
                    "tokens=None"
                )
            return generated, last
        if on_device:
            k = tokens.columns
            widest = int(self.beam_width[producers].max()) if self.n_wide else 1
            if widest > k:
                raise BatchError(
                    f"step(): tokens has {k} column(s) per slot, but a request in flight has "
                    f"{widest} beams"
                )
            generated = generated.copy()
            generated[producers] += 1
            return generated, last
        tok = _token_table(tokens, L)
        if self.n_wide:
            widths = self.beam_width[producers]
            if int(widths.max()) > tok.shape[1]:
                raise BatchError(
                    f"step(): tokens has {tok.shape[1]} column(s) per slot, but a request in "
                    f"flight has {int(widths.max())} beams"
                )
            values = _beam_values(tok, producers, widths)
        else:
            values = tok[:, 0][producers]
        _check_tokens(values, L)
        generated = generated.copy()
        generated[producers] += 1
        last = last.copy()
        if self.n_wide:
            k = min(tok.shape[1], L.max_beam_width)
            last[producers, :k] = tok[producers, :k]
        else:  # one beam each: the values just checked (a one-axis scatter)
            last[:, 0][producers] = values
        return generated, last

    def _accepted(
        self,
        accepted: Mapping[int, int],
        generated: np.ndarray,
        producers: np.ndarray,
        promoted: list[int],
    ) -> np.ndarray:
        """The generated counts once each slot's accepted drafts are in (checked)."""
        generated = generated if producers.size else generated.copy()
        produced = set(producers.tolist())
        for slot, n in accepted.items():
            before = self._drafts_run(slot, promoted)
            if slot not in produced or not before:
                raise BatchError(
                    f"step(): accepted[{show(slot)}]: that slot verified no draft tokens in "
                    "the last step"
                )
            if not is_int(n) or not 0 <= n <= before:
                raise BatchError(
                    f"step(): accepted[{slot}] = {show(n)}, not a count in 0 .. {before} (the "
                    "drafts it verified)"
                )
            generated[slot] += n
        return generated

    def _step_drafts(
        self,
        drafts: Mapping[int, Any] | None,
        promoted: list[int],
        rows: np.ndarray,
        undo: list[tuple[Entry, Any]],
    ) -> tuple[np.ndarray, list[int]]:
        """Each slot's draft count in this step and the slots with drafts (checked); the
        entries get this step's drafts, none for the others (a promoted prompt's drafts rode
        on its last chunk), each change recorded in `undo`."""
        L = self.limits
        ndraft, drafted = self.ndraft, self.drafted
        if drafts or drafted or any(self._held(s).context_drafts for s in promoted):
            ndraft = ndraft.copy()
            ndraft[drafted] = 0
            drafted = []
            given: dict[int, np.ndarray] = {}
            for slot, values in (drafts or {}).items():
                entry = self._entry(slot, "drafts")
                if not (promoted and slot in promoted) and self.row_of[slot] < 0:
                    raise BatchError(
                        f"step(): drafts[{slot}]: seq_slot {slot} is not a generation request "
                        "in this step"
                    )
                a = _drafts(values, slot, entry, L)
                ndraft[slot] = len(a)
                if len(a):
                    drafted.append(slot)
                    given[slot] = a
            for slot in dict.fromkeys(self.drafted + promoted + drafted):
                held = self._held(slot)
                undo.append((held, held.draft_tokens))
                held.draft_tokens = given.get(slot, ())
        if L.exact_drafts and len(rows) and (ndraft[rows] != L.max_draft_tokens).any():
            slot = int(rows[np.flatnonzero(ndraft[rows] != L.max_draft_tokens)[0]])
            raise BatchError(
                f"step(): generation request in seq_slot {slot}: Medusa verifies a fixed tree, "
                f"so every generation request carries max_draft_tokens={L.max_draft_tokens} "
                f"draft tokens; got {int(ndraft[slot])}"
            )
        return ndraft, drafted

    def _grow(
        self, blocks: Mapping[int, Any] | None, undo: list[tuple[list, int]]
    ) -> dict[int, list[int]]:
        """Append the step's KV blocks to their slots' lists: each slot's lists' lengths
        before, each append recorded in `undo`."""
        grew: dict[int, list[int]] = {}
        for slot, new in (blocks or {}).items():
            done = _append_blocks(self._entry(slot, "blocks"), new, slot)
            undo += done
            grew[int(slot)] = [n for _, n in done]
        return grew

    def _steady(self, tokens: Any, blocks: Mapping[int, Any] | None, on_device: bool) -> Plan:
        """A step of the same generation rows where only the tokens changed (and block lists
        may grow): the fewest calls, the state updated at commit."""
        L = self.limits
        rows = self.rows[: self.n_rows]
        widths = self.beam_width[rows] if self.n_wide else _EMPTY
        if on_device:
            k = tokens.columns
        else:
            tok = _token_table(tokens, L)
            k = tok.shape[1]
        if self.n_wide and int(widths.max()) > k:
            raise BatchError(
                f"step(): tokens has {k} column(s) per slot, but a request in flight has "
                f"{int(widths.max())} beams"
            )
        gather, gathered = None, None
        if not on_device:
            values = _sequence_values(tok, rows, widths, self.n_wide)
            _check_tokens(values, L)
        else:  # the host writes the last tokens it knows; the device then writes the new
            values = _sequence_values(self.last, rows, widths, self.n_wide)
            held = self.steady_gather
            if held is None or held[0] != k:  # the rows changed since: laid out once a run
                if not self.n_wide or not (widths > 1).any():
                    slots, beams = rows.copy(), np.zeros(len(rows), np.int64)
                else:
                    slots, beams = _beam_index(rows, widths)
                held = self.steady_gather = (
                    k,
                    slots * k + beams,
                    np.arange(len(slots)),
                    slots,
                    beams,
                )
            gather = TokenGather(held[1], held[2])
            gathered = (held[3], held[4])
        undo: list[tuple[list, int]] = []
        try:
            grew = self._grow(blocks, undo)
        except BaseException:
            _undo(undo, [])
            raise
        grown = self._grown(grew, rows) if grew else ()
        return Plan(
            None,
            Sampled(values),
            grown,
            None,
            None,
            self.ndraft,
            [],
            [],
            [],
            [],
            undo,
            [],
            True,
            set(grew),
            gather,
            gathered,
        )

    def commit(self, plan: Plan) -> None:
        """The planned step ran: the state is the one it leaves."""
        steady = plan.generated is None
        if plan.gathered is not None:
            slots, beams = plan.gathered
            # a steady step of one-beam rows: the serials are read only if a request arrives
            # or leaves before the values are back (_serials_pending)
            one_beam = steady and not self.n_wide
            self.pending = (slots, beams, None if one_beam else self.serial[slots])
        if steady:  # the same rows, each one token longer
            assert plan.tokens is not None
            rows = self.rows[: self.n_rows]
            self.generated[rows] += 1
            widths = self.beam_width[rows] if self.n_wide else None
            if plan.gathered is not None:
                pass  # the tokens are the device's: tokens_back sets them
            elif widths is None or not (widths > 1).any():
                self.last[:, 0][rows] = plan.tokens.values  # one axis: a cheaper scatter
            else:
                self.last[_beam_index(rows, widths)] = plan.tokens.values
            for slot in plan.grew:
                self._count_blocks(slot, self._held(slot).kv_block_ids, self.n_blocks)
            return
        assert plan.last is not None and plan.generated is not None
        self.steady_gather = None  # rows may have joined
        self.generated, self.last, self.ndraft, self.drafted = (
            plan.generated,
            plan.last,
            plan.ndraft,
            plan.drafted,
        )
        for slot in plan.promoted:
            n = self.n_rows
            self.rows[n] = slot
            self.row_of[slot] = n
            self.row_entries.append(self.entries[slot])  # type: ignore[arg-type]
            self.n_rows = n + 1
        for slot, position in plan.positions:
            self.position[slot] = position
        for slot in plan.completing:
            del self.waiting[slot]
        self.completing = [(s, int(self.serial[s])) for s in plan.completing]
        for slot in plan.grew:
            self._count_blocks(slot, self._held(slot).kv_block_ids, self.n_blocks)
        self.produced = self.rows[: self.n_rows].copy() if plan.generation else _EMPTY
        self.produced_serial = self.serial[self.produced]
        self.changed = False
        self.full += 1
        self.refilled = set()
        self.kept_first[:] = -1
        b = plan.batch
        assert b is not None
        gen = b.seq_slot[b.sizes.num_context_requests :]
        self.kept_rows = b.sizes.num_generation_sequences
        self.kept_one_beam = b.sizes.num_generation_sequences == len(gen)
        if len(gen) and self.kept_one_beam:
            self.kept_first[gen] = np.arange(len(gen))
        elif len(gen):
            self.kept_first[gen] = b.seq_first

    # ---------------------------------------------------------------------------- helpers
    def _gather(
        self, b: Batch, k: int, producers: np.ndarray
    ) -> tuple[TokenGather, tuple[np.ndarray, np.ndarray]]:
        """The device gather of a full step: each generation sequence of a producing slot
        takes ``tokens[slot, beam]`` into its first input token (core.token_ids' layout:
        context tokens, then per request each beam's token and the drafts); the tokens of
        producing slots without a row this step are only taken back."""
        n_ctx = b.sizes.num_context_requests
        slots = b.seq_slot[n_ctx:]
        bw, starts = b.gen_beam_width, b.gen_starts
        if self.n_wide and (bw > 1).any():
            seq_slots, beams = _beam_index(slots, bw)
            dst = np.repeat(starts, bw) + beams
        else:
            seq_slots, beams, dst = slots, np.zeros(len(slots), np.int64), starts
        mask = np.zeros(self.limits.max_batch_size, bool)
        mask[producers] = True
        take = mask[seq_slots]
        if not take.all():
            seq_slots, beams, dst = seq_slots[take], beams[take], dst[take]
        if len(seq_slots) < int(self.beam_width[producers].sum()):  # producers without a row
            mask[seq_slots] = False
            rest = producers[mask[producers]]
            s, bm = _beam_index(rest, self.beam_width[rest])
            seq_slots, beams = np.concatenate((seq_slots, s)), np.concatenate((beams, bm))
        gather = TokenGather(seq_slots * k + beams, dst)
        return gather, (seq_slots, beams)

    def _count_blocks(self, slot: int, lists: Any, into: np.ndarray) -> None:
        """The lengths of the slot's block lists into `into` (its `n_lists` of them)."""
        n = int(self.n_lists[slot])
        if n == 1:  # the common case: one list, one scalar write
            into[slot, 0] = len(lists[0])
        elif n:
            into[slot, :n] = [len(x) for x in lists[:n]]

    def _held(self, slot: int) -> Entry:
        entry = self.entries[slot]
        assert entry is not None
        return entry

    def _entry(self, slot: Any, what: str) -> Entry:
        entry = (
            self.entries[slot] if is_int(slot) and 0 <= slot < self.limits.max_batch_size else None
        )
        if entry is None:
            raise BatchError(f"step(): {what}[{show(slot)}]: that seq slot holds no request")
        return entry

    def _grown(self, grew: dict[int, list[int]], rows: np.ndarray) -> tuple:
        """(sequence, length before) for each sequence of a slot whose lists grew."""
        if not self.n_wide:  # one sequence per row
            return tuple((int(self.row_of[slot]), before[0]) for slot, before in grew.items())
        widths = self.beam_width[rows]
        first = np.cumsum(widths) - widths if self.n_wide else None
        out = []
        for slot, before in grew.items():
            row = int(self.row_of[slot])
            seq = row if first is None else int(first[row])
            for k in range(int(self.beam_width[slot])):
                out.append((seq + k, before[k if len(before) > 1 else 0]))
        return tuple(out)

    def _drafts_run(self, slot: Any, promoted: list[int]) -> int:
        """The draft tokens `slot` verified in the last step (0 for an unknown slot)."""
        if not is_int(slot) or not 0 <= slot < self.limits.max_batch_size:
            return 0
        entry = self.entries[slot]
        if entry is None:
            return 0
        if slot in promoted:
            return len(entry.context_drafts)
        return int(self.ndraft[slot])

    def _context(
        self, chunks: Mapping[int, int] | None
    ) -> tuple[list[tuple[Entry, int, int]], list[tuple[int, int]], list[int]]:
        """This step's context requests (entry, position, chunk) in arrival order, each
        slot's prompt position after the step, and the slots whose prompt it finishes."""
        if chunks is None:
            scheduled: dict[int, int | None] = {s: None for s in self.waiting}
        else:
            for slot in chunks:
                if slot not in self.waiting:
                    raise BatchError(
                        f"step(): chunks[{show(slot)}]: that seq slot holds no request in its "
                        "context phase"
                    )
            scheduled = {s: chunks[s] for s in self.waiting if s in chunks}
        context, positions, completing = [], [], []
        for slot, size in scheduled.items():
            entry = self.entries[slot]
            assert entry is not None
            begin, n = int(self.position[slot]), int(self.prompt_len[slot])
            if size is None:
                size = n - begin
            elif not is_int(size) or not 1 <= size <= n - begin:
                raise BatchError(
                    f"step(): chunks[{slot}] = {show(size)}, not a chunk size in 1 .. "
                    f"{n - begin} (the prompt tokens left)"
                )
            size = int(size)
            entry.context_position, entry.context_chunk_size = begin, size
            context.append((entry, begin, size))
            positions.append((slot, begin + size))
            if begin + size == n:
                completing.append(slot)
        return context, positions, completing

    def _batch(
        self,
        context: list[tuple[Entry, int, int]],
        rows: np.ndarray,
        row_entries: list[Entry],
        generated: np.ndarray,
        last: np.ndarray,
        ndraft: np.ndarray,
        grew: set[int],
    ) -> Batch:
        n_ctx = len(context)
        ctx = tuple(e for e, _, _ in context)
        # one conversion for the context columns (rows of one table: a step has few context
        # requests, and numpy's cost per call outweighs its loops at these sizes)
        prompt_len = self.prompt_len
        columns = np.array(
            [
                (e.seq_slot, begin, chunk, prompt_len[e.seq_slot], len(e.context_drafts))
                for e, begin, chunk in context
            ],
            np.int64,
        ).reshape(-1, 5)
        ctx_slots, c_begin, c_chunk, c_plen, c_ndraft = columns.T
        g_bw = self.beam_width[rows]
        # no drafts in the last step nor in this one: the zero column without a gather
        undrafted = not self.drafted and ndraft is self.ndraft
        g_ndraft = self.no_drafts[: len(rows)] if undrafted else ndraft[rows]
        g_max = generated[rows]
        wide = bool(self.n_wide) and bool((g_bw > 1).any())
        explicit: tuple[int, ...] = ()
        if self.n_explicit:
            c_explicit = [i for i, e in enumerate(ctx) if e.position_ids is not None]
            g_last = self.explicit_last[rows]
            g_explicit = np.flatnonzero(g_last >= 0)
            after = g_last[g_explicit] + g_max[g_explicit]
            if after.size and int(after.max()) > INT32_MAX:
                slot = int(rows[g_explicit[np.argmax(after)]])
                raise BatchError(
                    f"generation request in seq_slot {slot}: its generated tokens' positions "
                    "run past the int32 range"
                )
            explicit = tuple(c_explicit + (g_explicit + n_ctx).tolist())
        return view(
            ctx,
            tuple(row_entries),
            self.limits,
            ctx=(c_begin, c_chunk, c_plen, c_ndraft),
            gen=(g_bw, prompt_len[rows], g_ndraft, g_max),
            slots=np.concatenate((ctx_slots, rows)),
            last=_sequence_values(last, rows, g_bw, self.n_wide),
            explicit=explicit,
            prompts={id(e): (e.prompt, self.prompt_arrays[e.seq_slot]) for e in ctx},
            encoder=self.encoder,
            flight=self._flight_rows(rows, g_bw, wide, grew),
        )

    def _flight_rows(
        self, rows: np.ndarray, widths: np.ndarray, wide: bool, grew: set[int]
    ) -> FlightRows:
        """Where this step's generation sequences are among the last step's KV rows (every
        step keeps its rows, ``core.advance_kv`` too, so a list grown in a step in place is in
        them), the sequences to rebuild (new ones, and those of slots whose lists grew in this
        step), each sequence's list length and the lists to rebuild.

        One beam each, the rows kept from the last full step are where they were, but those
        that ``finish`` refilled; the finished prompts follow them. With beams, each sequence's
        row is looked up (a refilled row of another width shifts the sequences after it)."""
        n_old = self.n_rows if len(rows) else 0  # kept rows, then the promoted ones
        moved: np.ndarray | None = None
        same = 0
        refill: tuple[tuple[int, int], ...] = ()
        if wide:
            slots, beam = _beam_index(rows, widths)
            base = self.kept_first[slots]
            moved = np.where(base >= 0, base + beam, -1)
            changed = (moved < 0).nonzero()[0].tolist()
        elif not self.kept_rows:  # the last full step ran no generation rows: none is kept
            slots, changed = rows, list(range(len(rows)))
        elif self.kept_one_beam:
            slots, same = rows, n_old
            refill = tuple(
                (i, int(self.kept_first[rows[i]])) for i in sorted(self.refilled) if i < n_old
            )
            changed = list(range(n_old, len(rows)))
        else:  # the kept rows are a step's with beams: each sequence's is looked up
            slots, moved = rows, self.kept_first[rows]
            changed = (moved < 0).nonzero()[0].tolist()
        # the sequences of kept rows whose lists grew (new rows are rebuilt anyway)
        if grew and len(changed) < len(slots):
            first = np.cumsum(widths) - widths if wide else None
            for slot in grew:
                row = int(self.row_of[slot])
                if not 0 <= row < n_old:  # in its context phase, or promoted in this step
                    continue
                seq = row if first is None else int(first[row])
                if moved is None or moved[seq] >= 0:
                    changed.extend(range(seq, seq + int(self.beam_width[slot])))
            changed.sort()
        if self.n_unlisted:  # a request in flight whose lists the KV check walks
            n_lists = self.n_lists[slots]
            if len(slots) and not n_lists.all():
                return FlightRows(
                    self.full, self.full + 1, moved, changed, same=same, refill=refill
                )
        at = slots[changed].tolist()
        entries = self.entries
        if wide:
            counts = self.n_blocks
            if grew:
                counts = counts.copy()
                for slot in grew:
                    self._count_blocks(slot, self._held(slot).kv_block_ids, counts)
            column = np.where(self.n_lists[slots] > 1, beam, 0)
            lengths = counts[slots, column]
            columns = column[changed].tolist()
            lists = [entries[s].kv_block_ids[k] for s, k in zip(at, columns)]  # type: ignore[union-attr]
        else:  # one sequence per slot: its first list (the grown ones' lengths patched in,
            # rather than a copy of the whole count table)
            lengths = self.n_blocks[:, 0][slots]
            if grew:
                tail = rows[n_old:].tolist()
                for slot in grew:
                    row = int(self.row_of[slot])
                    if row < 0 and slot in tail:
                        row = n_old + tail.index(slot)
                    if 0 <= row < len(rows):  # a slot in its context phase has no row
                        lengths[row] = len(self._held(slot).kv_block_ids[0])  # type: ignore[index]
            lists = [entries[s].kv_block_ids[0] for s in at]  # type: ignore[union-attr]
        return FlightRows(
            self.full, self.full + 1, moved, changed, lengths, lists, same=same, refill=refill
        )


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
    d = int_array(drafts)
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
    return Arrival(_frozen(prompt, r.prompt), p, tuple(d.tolist()))


def _check_tokens(values: np.ndarray, L: Limits) -> None:
    if not in_range(values, 0, L.token_limit):
        bad = np.flatnonzero((values < 0) | (values >= L.token_limit))[0]
        raise BatchError(
            f"step(): token {values[bad]} of a request in flight is outside 0 .. "
            f"{L.token_limit - 1} ({L.token_limit_text})"
        )


def _empty(tokens: Any) -> bool:
    try:
        return len(tokens) == 0
    except TypeError:
        return False


def _token_table(tokens: Any, L: Limits) -> np.ndarray:
    """The sampled tokens as an int64 [slots, k] table (k columns per slot, one per beam)."""
    slots = L.max_batch_size
    if tokens is None:
        raise BatchError(
            "step(): the last step produced tokens; pass them (tokens[seq_slot], or "
            "tokens[seq_slot, beam])"
        )
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int64 and len(tokens) >= slots:
        if tokens.ndim == 2:  # the common cases: already a table, or one column of it
            return tokens
        if tokens.ndim == 1:
            return tokens.reshape(len(tokens), 1)
    try:
        a = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError):
        raise BatchError("step() needs integer tokens indexed by seq slot") from None
    if a.dtype.kind not in "iu" or a.ndim not in (1, 2) or len(a) < slots:
        raise BatchError(
            f"step() needs integer tokens indexed by seq slot: an array of {slots} rows "
            f"(max_batch_size), or [{slots}, beams]; got {a.dtype} of shape {list(a.shape)}"
        )
    if isinstance(tokens, np.ndarray):  # a list's ints are read as int64
        check_token_dtype(a.dtype, L.token_limit, L.token_limit_text, "step()", False)
    elif _has_bool(tokens, a.ndim):
        raise BatchError("step() needs integer tokens indexed by seq slot; got a bool among them")
    if a.dtype.kind == "u" and a.size and int(a.max()) > INT32_MAX:
        raise BatchError("step(): a token is outside the int32 range")
    a = a.astype(np.int64, copy=False)
    return a.reshape(len(a), 1) if a.ndim == 1 else a


def _has_bool(values: Any, ndim: int) -> bool:
    """A bool among a list's (or a list of lists') values, which numpy reads as 0 or 1."""
    rows = values if ndim == 1 else chain.from_iterable(values)
    return not BOOLS.isdisjoint(frozenset(map(type, rows)))


def _beam_index(slots: np.ndarray, widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(slot, beam) of each beam of each slot, for a [slots, beams] table."""
    seq = np.repeat(slots, widths)
    return seq, np.arange(len(seq)) - np.repeat(np.cumsum(widths) - widths, widths)


def _beam_values(tok: np.ndarray, slots: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """tok[slot, beam] for each beam of each slot."""
    return tok[_beam_index(slots, widths)]


def _sequence_values(
    last: np.ndarray, rows: np.ndarray, widths: np.ndarray, wide: int
) -> np.ndarray:
    """Each generation sequence's last token, in row order."""
    if not wide or not (widths > 1).any():
        return last[rows, 0]
    return _beam_values(last, rows, widths)


def _drafts(values: Any, slot: int, entry: Entry, L: Limits) -> np.ndarray:
    a = int_array(values)
    w = f"step(): drafts[{slot}]"
    if a is None:
        raise BatchError(f"{w} must be a list of token ids, got {show(values)}")
    if len(a) > L.max_draft_tokens:
        raise BatchError(f"{w}: {len(a)} draft tokens exceed max_draft_tokens={L.max_draft_tokens}")
    if len(a) and entry.beam_width > 1:
        raise BatchError(f"{w}: draft tokens need beam_width 1, got {entry.beam_width}")
    if not in_range(a, 0, L.token_limit):
        raise BatchError(
            f"{w}: a draft token is outside 0 .. {L.token_limit - 1} ({L.token_limit_text})"
        )
    return a


def _append_blocks(entry: Entry, new: Any, slot: int) -> list[tuple[list, int]]:
    """Append KV block ids to the slot's lists: one list of ids (every list of the request
    gets them) or one list per list the request holds. Returns what undoes it. The ids are
    checked with the step's other block lists, before anything is written."""
    lists = entry.kv_block_ids
    w = f"step(): blocks[{slot}]"
    if lists is None:
        raise BatchError(f"{w}: the request arrived without kv_block_ids")
    if type(new) is not list:
        try:
            new = list(new)
        except TypeError:
            raise BatchError(f"{w} must be a list of block ids, got {show(new)}") from None
    if len(lists) == 1 and new and type(new[0]) is int:  # the common case: ids for one list
        blocks = lists[0]
        undo = [(blocks, len(blocks))]
        blocks.extend(new)  # a value other than an id is refused by the step's KV check
        return undo
    per_list = bool(new) and all(isinstance(x, (list, tuple)) for x in new)
    if per_list and len(new) != len(lists):
        raise BatchError(
            f"{w}: {len(new)} lists of block ids for a request with {len(lists)} block lists"
        )
    undo = [(x, len(x)) for x in lists]
    for i, blocks in enumerate(lists):
        blocks.extend(new[i] if per_list else new)
    return undo
