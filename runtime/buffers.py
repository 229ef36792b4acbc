"""The generic engine behind every generated module's ``RuntimeBuffers``.

Construction evaluates the construct-time conditions once, allocates every tensor at capacity
and builds flat per-step plans (fills, guards, bindings), so ``prepare_step`` runs no flag or
condition checks. Host tensors that are mirrored to the device share one staging arena (pinned
on CUDA) whose layout the device arena repeats: one host-to-device copy per step moves them all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from .batch import Batch, StepSizes
from .decl import DEVICE, PINNED, Constant, Mirror, SizeBound, TensorDecl
from .errors import BatchError
from .fills import Rule, past_key_value_lengths

ALIGN = 256  # bytes; every arena member starts on this boundary
KV_CACHE_LENGTH_ROUND = 256  # the reference's CUDA-graph key rounding


@dataclasses.dataclass(frozen=True)
class Step:
    """One prepared step: engine IO views sized for this step, and its sizes."""

    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    sizes: StepSizes
    max_kv_cache_length_rounded: int


class RuntimeBuffers:
    config_type: ClassVar[type]
    size_bounds: ClassVar[tuple[SizeBound, ...]]
    tensor_decls: ClassVar[tuple[TensorDecl, ...]]

    def __init__(self, config: Any, device: str | torch.device = "cpu") -> None:
        if not isinstance(config, self.config_type):
            raise TypeError(
                f"expected {self.config_type.__module__}.Config, got {type(config).__name__}"
            )
        self.config = config
        self.device = torch.device(device)
        c = config
        decls = [d for d in self.tensor_decls if d.when is None or d.when(c)]
        self.decls: dict[str, TensorDecl] = {d.name: d for d in decls}
        self._numel = {d.name: math.prod(d.capacity(c)) for d in decls}
        self._dtype = {
            d.name: d.dtype if isinstance(d.dtype, torch.dtype) else d.dtype(c) for d in decls
        }
        pin = self.device.type == "cuda"

        # staging arena (mirror sources) and its device twin, same offsets
        sources = [self.decls[d.fill.source] for d in decls if isinstance(d.fill, Mirror)]
        offsets: dict[str, int] = {}
        end = 0
        for s in sources:
            offsets[s.name] = end
            end += -(-self._numel[s.name] * self._dtype[s.name].itemsize // ALIGN) * ALIGN
        self._host_arena = torch.zeros(end, dtype=torch.uint8, pin_memory=pin)
        self._device_arena = torch.zeros(end, dtype=torch.uint8, device=self.device)

        self._flat: dict[str, torch.Tensor] = {}
        mirror_of = {d.fill.source: d.name for d in decls if isinstance(d.fill, Mirror)}
        for d in decls:
            if isinstance(d.fill, Mirror):  # same dtype and capacity as its source (generator)
                flat = self._arena_view(self._device_arena, offsets[d.fill.source], d.name)
            elif d.name in mirror_of:
                flat = self._arena_view(self._host_arena, offsets[d.name], d.name)
            elif d.memory == DEVICE:
                flat = torch.empty(
                    self._numel[d.name], dtype=self._dtype[d.name], device=self.device
                )
            else:
                flat = torch.empty(
                    self._numel[d.name],
                    dtype=self._dtype[d.name],
                    pin_memory=pin and d.memory == PINNED,
                )
            fill_value = d.fill.value(c) if isinstance(d.fill, Constant) else (d.pad or 0)
            flat.fill_(fill_value)
            self._flat[d.name] = flat
        if end:
            self._device_arena.copy_(self._host_arena)  # mirrors start with their pads
        self.tensors: dict[str, torch.Tensor] = {
            d.name: self._flat[d.name].view(d.capacity(c)) for d in decls
        }

        # per-step plans, decided here once
        self._bounds = tuple((b.size, b.bound(c)) for b in self.size_bounds)
        self._guards = tuple((d.name, d.shape, self._numel[d.name]) for d in decls if d.checked)
        rules = [(d.name, d.fill) for d in decls if isinstance(d.fill, Rule)]
        self._checks = tuple(dict.fromkeys(r.check for _, r in rules if r.check is not None))
        self._fills = tuple(
            (name, rule, self._flat[name].numpy(), self.decls[name].pad) for name, rule in rules
        )
        self._high_water = dict.fromkeys(self._flat, 0)
        self._inputs = tuple(
            (b.engine_name, d.name, d.shape)
            for d in decls
            for b in d.inputs
            if b.when is None or b.when(c)
        )
        self._outputs = tuple(
            (b.engine_name, d.name, d.shape)
            for d in decls
            for b in d.outputs
            if b.when is None or b.when(c)
        )
        self._views: dict[str, dict[tuple[int, ...], torch.Tensor]] = {
            name: {} for name in self._flat
        }
        self._past_kv = next((n for n, r in rules if r is past_key_value_lengths), None)
        # recorded after each step's copy; waited on before the host rewrites the staging arena
        self._copy_done = torch.cuda.Event() if self.device.type == "cuda" else None
        self._last: Batch | None = None

    # ------------------------------------------------------------------------- helpers
    def _arena_view(self, arena: torch.Tensor, offset: int, name: str) -> torch.Tensor:
        dtype = self._dtype[name]
        return arena[offset : offset + self._numel[name] * dtype.itemsize].view(dtype)

    def _view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        # the reference's reshape: the step tensor is the leading part of the capacity. Views
        # are cached per shape, so a repeated shape hands out the very same tensor object.
        cache = self._views[name]
        view = cache.get(shape)
        if view is None:
            view = cache[shape] = self._flat[name][: math.prod(shape)].view(shape)
        return view

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self._inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self._outputs)

    # ------------------------------------------------------------------------ per step
    def prepare_step(
        self, context_requests: Sequence[Any], generation_requests: Sequence[Any]
    ) -> Step:
        """Fill every buffer for one step and return the engine IO views.

        Raises BatchError, with the buffers untouched, when the batch is invalid or over capacity.
        """
        c = self.config
        batch = Batch.build(
            context_requests,
            generation_requests,
            max_beam_width=getattr(c, "max_beam_width", 1),
            max_draft_tokens=getattr(c, "max_draft_tokens", 0),
        )
        s = batch.sizes
        for size, bound in self._bounds:
            value = getattr(s, size)
            if value > bound:
                raise BatchError(
                    f"{size} = {value} exceeds its capacity {bound}; schedule fewer requests or tokens"
                )
        for name, shape_fn, capacity in self._guards:
            shape = shape_fn(c, s)
            if math.prod(shape) > capacity:
                raise BatchError(
                    f"tensor {name!r} needs shape {list(shape)}, beyond its capacity of {capacity} elements"
                )
        for check in self._checks:
            check(batch, c)

        if self._copy_done is not None:
            self._copy_done.synchronize()  # last step's copy has left the staging arena
        for name, rule, out, pad in self._fills:
            n = rule.fill(out, batch, c)
            if pad is not None and self._high_water[name] > n:
                out[n : self._high_water[name]] = pad  # rows past this step hold the pad value
            self._high_water[name] = n
        if self._host_arena.numel():
            self._device_arena.copy_(self._host_arena, non_blocking=True)
            if self._copy_done is not None:
                self._copy_done.record()
        self._last = batch
        return Step(
            inputs={e: self._view(n, f(c, s)) for e, n, f in self._inputs},
            outputs={e: self._view(n, f(c, s)) for e, n, f in self._outputs},
            sizes=s,
            max_kv_cache_length_rounded=self._max_kv_rounded(batch),
        )

    def _max_kv_rounded(self, batch: Batch) -> int:
        if self._past_kv is None or batch.sizes.num_sequences == 0:
            return 0
        longest = int(batch.past_key_value_lengths().max())
        return -(-longest // KV_CACHE_LENGTH_ROUND) * KV_CACHE_LENGTH_ROUND

    def prepare_for_cuda_graph(self, max_sequence_length: int) -> None:
        """Before capturing the last (generation-only) step as a CUDA graph: raise its
        past-KV lengths to min(max_sequence_length - 1, the rounded max KV length), so the
        captured attention grid covers the next steps, as the reference does."""
        batch = self._last
        if batch is None:
            raise BatchError("prepare_for_cuda_graph needs a prepared step")
        if batch.sizes.num_context_requests:
            raise BatchError(
                f"prepare_for_cuda_graph needs a generation-only step; the last step had "
                f"{batch.sizes.num_context_requests} context requests"
            )
        if self._past_kv is None:
            return
        value = min(max_sequence_length - 1, self._max_kv_rounded(batch))
        self._flat[self._past_kv][: batch.sizes.num_sequences] = value


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A host tensor as numpy (tests and tools)."""
    return t.detach().cpu().numpy()
