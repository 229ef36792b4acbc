"""Which tensor each engine name binds, decided once per RuntimeBuffers from the declarations.

Static tensors of a fixed shape are bound once (``static_inputs``); those with a step shape
(Medusa's tree, set once and read [num_generation_requests, ...]) are bound every step at it,
as views of their storage, as the reference resizes them; a ring tensor binds one slot per
step; every other tensor is bound every step at its step shape.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .decl import Static, TensorDecl

Shape = Callable[[Any, Any], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Bindings:
    inputs: tuple[
        tuple[str, str, Shape, tuple[int, ...]], ...
    ]  # (engine name, tensor, shape, index)
    outputs: tuple[tuple[str, str, Shape, tuple[int, ...]], ...]
    rings: tuple[tuple[str, str, str, int], ...]  # (inputs or outputs, engine name, tensor, ring)
    static: dict[str, tuple[str, tuple[int, ...]]]  # engine name -> (tensor, index)


def bindings(decls: list[TensorDecl], config: Any, sizes_type: type) -> Bindings:
    """The engine bindings of `decls` under `config` (each binding's condition evaluated)."""
    c = config
    zero = sizes_type(**{f.name: 0 for f in dataclasses.fields(sizes_type)})
    step_shaped = {d.name for d in decls if tuple(d.shape(c, zero)) != tuple(d.capacity(c))}

    def per_step(which: str) -> tuple:
        return tuple(
            (name, d.name, d.shape, index)
            for d in decls
            if (not isinstance(d.fill, Static) or d.name in step_shaped) and d.ring is None
            for b in getattr(d, which)
            if b.when is None or b.when(c)
            for name, index in b.expand(c)
        )

    rings = tuple(
        (which, b.engine_name, d.name, d.ring)
        for d in decls
        if d.ring is not None
        for which in ("inputs", "outputs")
        for b in getattr(d, which)
        if b.when is None or b.when(c)
    )
    static = {
        name: (d.name, index)
        for d in decls
        if isinstance(d.fill, Static) and d.name not in step_shaped
        for b in d.inputs
        if b.when is None or b.when(c)
        for name, index in b.expand(c)
    }
    return Bindings(per_step("inputs"), per_step("outputs"), rings, static)


def repeated(b: Bindings) -> dict[str, tuple[str, ...]]:
    """The engine names of each tensor bound once per member of index sets (``each``), in
    their order: what a typed step record hands out as one tuple."""
    out: dict[str, list[str]] = {}
    for engine_name, tensor, _, index in b.inputs:
        if index:
            out.setdefault(tensor, []).append(engine_name)
    return {tensor: tuple(names) for tensor, names in out.items()}


def step_sizes(sizes: Any, sizes_type: type) -> Any:
    """`sizes`, a `sizes_type` (the family's StepSizes) handed to views(), with every size a
    plain non-negative int (numpy integers converted); ValueError otherwise."""
    if not isinstance(sizes, sizes_type):
        raise ValueError(f"views() takes StepSizes, got {type(sizes).__name__}")
    numpy_ints = {}
    for f in dataclasses.fields(sizes_type):
        v = getattr(sizes, f.name)
        if v.__class__ is int and v >= 0:
            continue
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"views(): step size {f.name} must be a non-negative int, got {v!r}")
        numpy_ints[f.name] = int(v)
    return dataclasses.replace(sizes, **numpy_ints) if numpy_ints else sizes  # type: ignore[type-var]


def prefix_layout(small: tuple[int, ...], large: tuple[int, ...]) -> bool:
    """True when a row-major tensor of shape `small` is the leading part of one of shape
    `large`: the shapes differ at most in one dimension, and only 1s come before it."""
    k = next((i for i, (a, b) in enumerate(zip(small, large)) if a != b), None)
    return k is None or (math.prod(small[:k]) == 1 and small[k + 1 :] == large[k + 1 :])
