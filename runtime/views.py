"""What ``RuntimeBuffers`` hands the engine beside the step's program: each step's views (and
views at a CUDA-graph bucket's sizes), the static inputs, and the capture values written before
a CUDA graph is captured. A mixin of ``RuntimeBuffers`` (``buffers.py``), on its storage.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import BatchError, ConfigError
from ..requests.values import INT32_MAX, check_int
from .bindings import prefix_layout, step_sizes
from .decl import Static
from .guards import exclusive as _exclusive
from .staging import HALVES
from .step import Step, StepInputs, StepMode
from .storage import static_values

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .bindings import Bindings
    from .decl import TensorDecl
    from .staging import Targets
    from .storage import Stored


class Views:
    """The views, statics and CUDA-graph preparation of ``RuntimeBuffers``, which sets what
    they read."""

    config: Any
    sizes_type: ClassVar[type]  # the StepSizes the batch builder computes
    decls: dict[str, TensorDecl]
    double_buffered: bool
    captures: ClassVar[bool] = False  # the family has ``_capture`` (prepare_for_cuda_graph)
    step_inputs: ClassVar[type[StepInputs]] = StepInputs  # the family's typed inputs record
    VIEW_CACHE: ClassVar[int] = 16  # shapes whose views each tensor keeps, per staging half
    _t: dict[str, Stored]
    _bind: Bindings
    _each: dict[str, tuple[str, ...]]  # a repeated binding's engine names, by tensor
    _targets: list[Targets]
    _half: int
    _last: Any
    _layout: Any
    _half_run: list[int | None]
    _step_views: list[tuple[Any, dict, dict] | None]
    _scalars_now: Mapping[str, int]
    _ring_step: int
    _decode: Any

    def _capture(
        self, targets: Targets, sizes: Any, scalars: Mapping[str, int], max_sequence_length: int
    ) -> None:
        raise NotImplementedError

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """A step shape within the tensor's capacity (the generated checks call this for the
        shapes the generator could not prove)."""
        if math.prod(shape) > self._t[name].numel:
            raise BatchError(
                f"tensor {name!r} needs shape {list(shape)}, beyond its capacity of "
                f"{self._t[name].numel} elements"
            )

    def _view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self._t[name].view(self._half, shape, self.VIEW_CACHE)

    @property
    def cached_views(self) -> int:
        """Views held for reuse, over every tensor and half (at most VIEW_CACHE each)."""
        return sum(len(cache) for t in self._t.values() for cache in t.views)

    @_exclusive
    def set_static(self, name: str, values: Any) -> None:
        """Write a static tensor (broadcast to its capacity shape), e.g. the KV pool pointers
        once the pools exist. Its engine bindings are in ``static_inputs``. Raises ConfigError
        (nothing written) for an unknown name, values that do not broadcast to the shape, or
        values the dtype cannot hold exactly (a float or out-of-range value for an integer
        tensor)."""
        d = self.decls.get(name)
        if d is None or not isinstance(d.fill, Static):
            statics = (
                ", ".join(n for n, x in self.decls.items() if isinstance(x.fill, Static)) or "none"
            )
            raise ConfigError(f"{name!r} is not a static tensor of this family (static: {statics})")
        t = self._t[name]
        target = t.capacity_view()
        source = static_values(name, values, target.dtype)
        try:
            target.copy_(source.expand_as(target))
        except RuntimeError:
            raise ConfigError(
                f"{name}: values of shape {list(source.shape)} do not broadcast to its shape "
                f"{list(t.capacity)}"
            ) from None

    @property
    @_exclusive
    def static_inputs(self) -> dict[str, torch.Tensor]:
        """Engine inputs bound once (the reference's setStaticInputTensors)."""
        out = {}
        for engine_name, (name, index) in self._bind.static.items():
            view = self._t[name].capacity_view()
            out[engine_name] = view[index] if index else view
        return out

    def _step(self, s: Any, layout: Any) -> Step:
        """The step of sizes `s`, its views at `layout` (its bucket's sizes, or `s`)."""
        cached = self._step_views[self._half]
        # steady decoding and serving churn repeat the sizes (often the one StepSizes): reuse
        # the views
        if cached is None or (cached[0] is not layout and cached[0] != layout):
            cached = self._step_views[self._half] = (layout, *self._views_at(layout))
        # the inputs record is read-only: it shares the cached views unless a ring adds its slot
        inputs, outputs = cached[1], dict(cached[2])
        slots = {}
        if self._bind.rings:
            inputs = dict(inputs)
        for which, engine_name, name, ring in self._bind.rings:
            slot = self._ring_step % ring
            view = self._view(name, self._t[name].capacity)[slot]
            (inputs if which == "inputs" else outputs)[engine_name] = view
            slots[name] = slot
        if self._bind.rings:
            self._ring_step += 1
        return Step(
            inputs=self.step_inputs(inputs, self._scalars_now, StepMode.of(s), self._each),
            outputs=outputs,
            sizes=s,
            scalars=self._scalars_now,
            ring_slots=slots,
        )

    @_exclusive
    def views(self, sizes: Any) -> tuple[StepInputs, dict[str, torch.Tensor]]:
        """Engine IO views for arbitrary sizes (e.g. a CUDA-graph batch bucket larger than the
        step): the same storage as the step's views, with the rows past the step holding their
        pad values. The inputs are the family's typed record, with the last step's scalars and
        mode (padded rows run nothing)."""
        if getattr(self, "_device", None) is not None:
            raise BatchError(
                "views() reads the host build's layout; these buffers build='device': build "
                "each step at its bucket instead, step(..., bucket=(tokens, rows))"
            )
        inputs, outputs = self._views_at(sizes)
        mode = StepMode.of(self._last) if self._last is not None else StepMode.IDLE
        return self.step_inputs(inputs, self._scalars_now, mode, self._each), outputs

    def _views_at(self, sizes: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        c = self.config
        sizes = step_sizes(sizes, self.sizes_type)
        last = self._layout
        if last is not None and sizes != last:
            # a bucket: only a tensor whose step rows lead its shape keeps them in place
            # ([rows, ...], or [1, rows, ...]); one laid out [.., rows, ..] (LoRA's [modules,
            # layers, sequences], ChatGLM's [2, tokens]) would put the step's values elsewhere
            moved = sorted(
                {
                    e
                    for e, n, f, _ in self._bind.inputs + self._bind.outputs
                    if not prefix_layout(tuple(f(c, last)), tuple(f(c, sizes)))
                }
            )
            if moved:
                raise ValueError(
                    f"views(): {', '.join(moved)} change shape past their first dimension at "
                    "these sizes, so the step's values would not line up with a view at them; "
                    "build the step at its bucket instead: step(..., bucket=(tokens, rows)) or "
                    "prepare_step(..., bucket=(tokens, rows))"
                )

        def view(n: str, f: Any, index: tuple[int, ...]) -> torch.Tensor:
            shape = tuple(f(c, sizes))
            if math.prod(shape) > self._t[n].numel:
                raise ValueError(
                    f"views(): {n!r} would be {list(shape)} at these sizes, beyond its "
                    f"capacity {list(self._t[n].capacity)}"
                )
            v = self._view(n, shape)
            return v[index] if index else v

        inputs = {e: view(n, f, i) for e, n, f, i in self._bind.inputs}
        outputs = {e: view(n, f, i) for e, n, f, i in self._bind.outputs}
        for which, engine_name, name, ring in self._bind.rings:  # the slot the next step binds
            slot_view = self._view(name, self._t[name].capacity)[self._ring_step % ring]
            (inputs if which == "inputs" else outputs)[engine_name] = slot_view
        return inputs, outputs

    @_exclusive
    def prepare_for_cuda_graph(self, max_sequence_length: int) -> None:
        """Before capturing the last (generation-only) step as a CUDA graph: each tensor with
        a declared `capture` value gets it in the elements the step wrote (in the TensorRT-LLM
        families, the past KV lengths become min(max_sequence_length - 1, the longest rounded
        up), so the captured attention grid covers the steps it is replayed for, as the
        reference does). Nothing to do in a family that declares none."""
        check_int(
            max_sequence_length, "max_sequence_length", "prepare_for_cuda_graph", 1, INT32_MAX + 1
        )
        s = self._last
        if s is None:
            raise BatchError("prepare_for_cuda_graph needs a prepared step")
        if s.num_context_requests:
            raise BatchError(
                f"prepare_for_cuda_graph needs a generation-only step; the last step had "
                f"{s.num_context_requests} context requests"
            )
        if not self.captures:
            return
        self._capture(self._targets[self._half], s, self._scalars_now, int(max_sequence_length))
        self._decode = None  # the captured values no longer follow the tokens
        self._half_run[self._half] = None
        if not self.double_buffered:  # the other half is this one
            self._half_run[:] = [None] * HALVES
