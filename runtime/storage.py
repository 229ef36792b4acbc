"""Where each tensor of a family lives: one record per tensor, allocated once.

``allocate`` evaluates the construct-time conditions, lays the mirrored host tensors out in the
staging arena (smallest first, so the step's one copy can stop inside the last, largest member;
the gather indices of device tokens lead it), and gives every tensor its storage: a mirror its
slice of the device arena, a staged host tensor one slice per half, a host tensor a rule fills
one storage per half (so a step that fails half-way never touches the last step's values), a
device tensor or a constant one storage. Without double buffering both halves are one: each
staged tensor has one slice and each rule tensor one storage. Every storage starts at its pad or
constant value. ``check_allocatable`` refuses a Config the machine's memory cannot hold.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..requests.values import int_array
from .decl import DEVICE, PINNED, Constant, Mirror, Rule, Static, TensorDecl
from .staging import ALIGN, HALVES, Staging, Target, written
from .tokens import region_bytes


@dataclasses.dataclass(eq=False)
class Stored:
    """One tensor as allocated: its declaration, element count, dtype and capacity shape, its
    flat storage per staging half (one tensor twice where both halves share it), its place in
    the staging arena (mirror sources), its fill target per half (rule tensors), and the
    views handed out per half, by shape (the `limit` most recent shapes kept)."""

    decl: TensorDecl
    numel: int
    dtype: torch.dtype
    capacity: tuple[int, ...]
    flat: tuple[torch.Tensor, ...] = ()
    offset: int | None = None
    targets: tuple[Target, ...] = ()
    views: tuple[dict[tuple[int, ...], torch.Tensor], ...] = ((), ())  # type: ignore[assignment]

    @property
    def name(self) -> str:
        return self.decl.name

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def view(self, half: int, shape: tuple[int, ...], limit: int) -> torch.Tensor:
        """The leading part of the storage at `shape` (the reference's reshape); a repeated
        shape (steady decoding, a CUDA-graph bucket) hands out the very same tensor object."""
        cache = self.views[half]
        view = cache.get(shape)
        if view is None:
            if len(cache) >= limit:
                del cache[next(iter(cache))]  # the oldest shape
            view = cache[shape] = self.flat[half][: math.prod(shape)].view(shape)
        return view

    def capacity_view(self, half: int = 0) -> torch.Tensor:
        return self.flat[half].view(self.capacity)


@dataclasses.dataclass(eq=False)
class Storage:
    """Every tensor's record, by name, and the staging arena the mirrored ones live in."""

    tensors: dict[str, Stored]
    staging: Staging
    sources: list[Stored]  # the mirrored host tensors in arena order (smallest first)
    end: int  # bytes of the arena in use


def records(decls: list[TensorDecl], config: Any) -> dict[str, Stored]:
    """Each tensor's record before allocation (sizes and dtypes from the Config)."""
    out = {}
    for d in decls:
        dtype = d.dtype if isinstance(d.dtype, torch.dtype) else d.dtype(config)
        capacity = tuple(d.capacity(config))
        out[d.name] = Stored(d, math.prod(capacity), dtype, capacity, views=({}, {}))
    return out


def allocate(
    tensors: dict[str, Stored],
    config: Any,
    device: torch.device,
    gather_rows: int,
    double_buffered: bool = True,
) -> Storage:
    """Lay out the arena and give each record its storage, at its pad or constant value;
    `gather_rows` > 0 reserves the gather indices of device tokens at the arena's start.
    Without `double_buffered`, each rule tensor has one storage (and one fill target) that
    both halves name."""
    pin = device.type == "cuda"
    mirror_of = {t.decl.fill.source for t in tensors.values() if isinstance(t.decl.fill, Mirror)}
    sources = sorted((tensors[n] for n in mirror_of), key=lambda t: t.nbytes)
    end = region_bytes(gather_rows) if gather_rows else 0
    for t in sources:
        t.offset = end
        end += -(-t.nbytes // ALIGN) * ALIGN
    staging = Staging(end, device, double_buffered)
    halves = HALVES if double_buffered else 1
    for t in tensors.values():
        d = t.decl
        if isinstance(d.fill, Mirror):  # same dtype and capacity as its source (generator)
            source = tensors[d.fill.source]
            assert source.offset is not None
            flats = [staging.view(None, source.offset, t.nbytes, t.dtype)] * HALVES
        elif t.offset is not None:
            flats = [staging.view(h, t.offset, t.nbytes, t.dtype) for h in range(halves)]
            flats *= HALVES // halves
        elif d.memory == DEVICE:
            flats = [torch.empty(t.numel, dtype=t.dtype, device=device)] * HALVES
        else:
            one = [
                torch.empty(t.numel, dtype=t.dtype, pin_memory=pin and d.memory == PINNED)
                for _ in range(halves if isinstance(d.fill, Rule) else 1)
            ]
            flats = one * (HALVES // len(one))
        held = isinstance(d.fill, (Constant, Static)) and d.fill.value is not None
        value = d.fill.value(config) if held else d.initial  # type: ignore[union-attr,misc]
        for flat in dict.fromkeys(flats):  # each distinct storage once
            if isinstance(value, tuple):  # a list of ints, element by element
                flat.copy_(_listed(d.name, value, t.numel, t.dtype))
            else:
                flat.fill_(value)
        t.flat = tuple(flats)
    staging.start()  # mirrors start with their pads
    for t in tensors.values():
        if isinstance(t.decl.fill, Rule):
            t.targets = _targets(t, double_buffered)
    return Storage(tensors, staging, sources, end)


def _listed(name: str, values: tuple[int, ...], numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A constant fill's list of ints as the tensor's elements: exactly as many, each in the
    dtype's range (ConfigError otherwise)."""
    if len(values) != numel:
        raise ConfigError(
            f"{name}: its constant fill has {len(values)} values for {numel} elements"
        )
    info = torch.iinfo(dtype)
    bad = [v for v in values if not info.min <= v <= info.max]
    if bad:
        raise ConfigError(f"{name}: its constant fill holds {bad[0]}, outside {dtype}")
    return torch.tensor(values, dtype=dtype)


def _targets(t: Stored, double_buffered: bool = True) -> tuple[Target, ...]:
    """The fill target of rule tensor `t` in each half: host rules write numpy views of their
    storage, device rules the torch tensor (copies of request tensors, enqueued on the current
    stream). The elements the last fill of a storage wrote are counted per storage (shared by
    the halves where the storage is), so rows past a shorter step are re-padded. Without
    double buffering both halves have the one target (a rule's state keyed by its target, such
    as the KV rows a half holds, then follows every step)."""
    d = t.decl
    shared = written()
    halves = HALVES if double_buffered else 1
    targets = tuple(
        Target(
            t.flat[h] if d.memory == DEVICE else t.flat[h].numpy(),
            d.pad,
            shared if t.flat[0] is t.flat[1] else written(),
            d.name,
            d.fill.impl,  # type: ignore[union-attr]
        )
        for h in range(halves)
    )
    return targets * (HALVES // halves)


def static_values(name: str, values: Any, dtype: torch.dtype) -> torch.Tensor:
    """`values` as a tensor of `dtype`, refusing what the dtype would not hold exactly."""
    try:
        a = (
            values.detach().cpu().numpy()
            if isinstance(values, torch.Tensor)
            else np.asarray(values)
        )
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise ConfigError(f"{name}: cannot read {type(values).__name__} values ({exc})") from None
    if dtype.is_floating_point:
        if a.dtype.kind not in "biuf":
            raise ConfigError(f"{name}: needs numbers, got {a.dtype}")
        return torch.as_tensor(a.astype(np.float64), dtype=dtype)
    if dtype == torch.bool:
        if a.dtype.kind != "b":
            raise ConfigError(f"{name}: needs booleans, got {a.dtype}")
        return torch.as_tensor(a)
    info = torch.iinfo(dtype)
    flat = int_array(a.reshape(-1)) if a.dtype.kind in "iu" else None
    if flat is None or not (not flat.size or (flat.min() >= info.min and flat.max() <= info.max)):
        raise ConfigError(
            f"{name}: needs integers in {info.min}..{info.max} ({dtype}), got "
            f"{a.dtype} values"
            + (f" from {flat.min()} to {flat.max()}" if flat is not None else "")
        )
    return torch.as_tensor(flat.reshape(a.shape), dtype=dtype)


def check_allocatable(
    tensors: dict[str, Stored],
    decls: list[TensorDecl],
    device: torch.device,
    double_buffered: bool = True,
) -> None:
    """A ConfigError with the bytes needed when the Config asks for more memory than the
    machine has (instead of a failure deep inside torch, or an out-of-memory kill while
    the pads are written)."""
    halves = HALVES if double_buffered else 1
    on_device = sum(tensors[d.name].nbytes for d in decls if d.memory == DEVICE)
    host = sum(
        (halves if isinstance(d.fill, Rule) else 1) * tensors[d.name].nbytes
        for d in decls
        if d.memory != DEVICE
    )
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        physical = None
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        needs = [("device", on_device, total), ("host", host, physical)]
    else:
        needs = [("host", on_device + host, physical)]
    for where, nbytes, available in needs:
        if available is not None and nbytes > available:
            raise ConfigError(
                f"these buffers need {nbytes:,} bytes of {where} memory, more than the "
                f"{available:,} bytes the machine has; lower the Config's capacities "
                f"(`bufc report` shows each tensor's share)"
            )
