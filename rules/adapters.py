"""LoRA's fill rules (docs/contract.md): each request's adapter rows parsed once when it
arrives (``admit_lora``) and per step for the stateless path (``check_lora``, memoised per
request), then the per-sequence weight pointers and ranks the engine reads, laid out
[modules, local layers, sequences]. Same contract as ``core``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..errors import BatchError
from ..requests.batch import Batch
from ..requests.values import INT32_MAX, INT64_MAX, check_int, show
from .batch_rows import all_requests, where


def admit_lora(
    r: Any,
    *,
    lora_modules: tuple[str, ...],
    first_local_layer: int,
    num_local_layers: int,
    num_layers: int,
) -> None:
    """A request arriving in flight: its lora_weights rows are parsed and checked now, and the
    entry keeps a copy of them (rows the caller edits afterwards do not reach a step)."""
    rows = getattr(r, "lora_weights", None)
    if rows is None:
        return
    w = f"request (seq_slot {r.seq_slot})"
    _parse_lora(w, rows, lora_modules, first_local_layer, num_local_layers, num_layers)
    r.lora_weights = tuple(tuple(row) for row in rows)


def _parse_lora(
    w: str,
    rows: Any,
    lora_modules: tuple[str, ...],
    first_local_layer: int,
    num_local_layers: int,
    num_layers: int,
) -> np.ndarray:
    """One request's adapter rows as an [n, 6] array (module index, local layer, A, B, scale,
    rank), keeping the rows of this pipeline rank's layers; raises on a bad row."""
    modules = {m: k for k, m in enumerate(lora_modules)}
    first, count = first_local_layer, num_local_layers
    if len(rows) == 0:
        raise BatchError(f"{w}: lora_weights is empty; give None for no adapter")
    parsed = []
    for row in rows:
        if isinstance(row, (str, bytes)) or not hasattr(row, "__len__") or len(row) != 6:
            raise BatchError(
                f"{w}: a lora_weights row is (module, layer, A address, "
                f"B address, DoRA scale address or None, rank), got {show(row)}"
            )
        module, layer, a, weights, scale, rank = row
        if not isinstance(module, str) or module not in modules:
            raise BatchError(
                f"{w}: LoRA module {show(module)} is not one of the engine's "
                f"lora_modules ({', '.join(lora_modules)})"
            )
        check_int(layer, "LoRA layer", w, 0, num_layers, f"num_layers={num_layers}")
        for what, address in (("A", a), ("B", weights), ("DoRA scale", scale or 0)):
            check_int(address, f"LoRA {what} address", w, 0, INT64_MAX + 1)
        check_int(rank, "LoRA rank", w, 0, INT32_MAX + 1)
        if first <= layer < first + count:  # other rows belong to other pipeline ranks
            parsed.append((modules[module], layer - first, a, weights, scale or 0, rank))
    return np.asarray(parsed, dtype=np.int64).reshape(-1, 6)


@dataclasses.dataclass
class LoraMemo:
    """Each scheduled request's parsed adapter rows, by request, with the snapshot of its
    lora_weights they were parsed from (kept between steps)."""

    rows: dict[int, tuple[Any, np.ndarray]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LoraRows:
    """The step's adapter rows, one per (sequence, module, layer), as columns."""

    seq: np.ndarray
    module: np.ndarray
    layer: np.ndarray
    a: np.ndarray
    b: np.ndarray
    scale: np.ndarray
    rank: np.ndarray


def check_lora(
    b: Batch,
    memo: LoraMemo,
    *,
    lora_modules: tuple[str, ...],
    first_local_layer: int,
    num_local_layers: int,
    num_layers: int,
) -> LoraRows:
    """Every request's adapter rows, one row per sequence, as (sequence, module, layer, a, b,
    scale, rank) columns. A request's parsed rows are memoised while its lora_weights compare
    equal to the copy they were parsed from, so steady steps convert nothing."""
    seq_of_request = np.concatenate(
        (np.arange(len(b.context)), len(b.context) + np.cumsum(b.gen_beam_width) - b.gen_beam_width)
    ).astype(np.int64)
    widths = np.concatenate((np.ones(len(b.context), np.int64), b.gen_beam_width))
    seen = {}
    parts = []
    for i, r in enumerate(all_requests(b)):
        rows = getattr(r, "lora_weights", None)
        if rows is None:
            continue
        kept = memo.rows.get(id(r))
        try:  # a deep copy of the rows with each value's type, so that a row edited in place
            # is seen, even to an equal value of another type (8.0 == 8)
            snapshot = tuple(tuple((type(v), v) for v in row) for row in rows)
        except TypeError:
            snapshot = None  # not rows at all: _parse_lora names the problem
        if kept is None or snapshot is None or kept[0] != snapshot:
            kept = (
                snapshot,
                _parse_lora(
                    where(b, i),
                    rows,
                    lora_modules,
                    first_local_layer,
                    num_local_layers,
                    num_layers,
                ),
            )
        seen[id(r)] = kept
        parsed = kept[1]
        # One row per sequence: the reference indexes the rows by request, so the beams of a
        # beam-search request overwrite the next request's rows (a bug).
        for k in range(int(widths[i])):
            parts.append(
                np.column_stack((np.full(len(parsed), seq_of_request[i] + k, np.int64), parsed))
            )
    table = np.concatenate(parts) if parts else np.zeros((0, 7), np.int64)
    memo.rows = seen  # requests no longer scheduled are forgotten (every row parsed)
    return LoraRows(*(table[:, j] for j in range(7)))


def lora_weights_pointers(
    out: np.ndarray, b: Batch, lora: LoraRows, *, num_lora_modules: int, num_local_layers: int
) -> int:
    """[modules, local layers, sequences, 3]: (A, B, DoRA scale or 0) of each adapter row;
    zero where a sequence has no adapter for that module and layer."""
    s = b.sizes.num_sequences
    view = out[: num_lora_modules * num_local_layers * s * 3].reshape(
        num_lora_modules, num_local_layers, s, 3
    )
    view[:] = 0
    if len(lora.seq):
        view[lora.module, lora.layer, lora.seq] = np.stack((lora.a, lora.b, lora.scale), axis=-1)
    return view.size


def lora_ranks(
    out: np.ndarray, b: Batch, lora: LoraRows, *, num_lora_modules: int, num_local_layers: int
) -> int:
    """[modules, local layers, sequences]: the adapter rank, 0 without an adapter."""
    s = b.sizes.num_sequences
    view = out[: num_lora_modules * num_local_layers * s].reshape(
        num_lora_modules, num_local_layers, s
    )
    view[:] = 0
    view[lora.module, lora.layer, lora.seq] = lora.rank
    return view.size
