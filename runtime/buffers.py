"""The generic engine behind every generated module's ``RuntimeBuffers``.

Construction evaluates the construct-time conditions once, allocates every tensor at capacity
and builds flat per-step plans (fills, guards, bindings), so ``prepare_step`` runs no flag or
condition checks and allocates no tensor.

Host tensors that are mirrored to the device live in one staging arena at fixed, aligned
offsets (smallest first), and their device mirrors in one device arena with the same layout:
one host-to-device copy per step moves them all, and only up to the used part of the largest
member. The staging arena is double-buffered (pinned on CUDA): step t writes half t % 2, and
before writing a half the host waits on the event recorded after that half's last copy, so a
copy still in flight is never overwritten while the host runs a step ahead of the GPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from .batch import ENCODER_SIZES, STEP_SIZES, Batch, Limits, StepSizes
from .decl import DEVICE, PINNED, STATIC, Constant, Mirror, SizeBound, TensorDecl
from .errors import BatchError, ConfigError
from .fills import Decode, Rule, past_key_value_lengths
from .values import INT32_MAX, check_int, in_range, int_array

ALIGN = 256  # bytes; every arena member starts on this boundary
KV_CACHE_LENGTH_ROUND = 256  # the reference's CUDA-graph key rounding
HALVES = 2


@dataclasses.dataclass(frozen=True)
class Step:
    """One prepared step: engine IO views sized for this step, and its sizes."""

    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    sizes: StepSizes
    max_kv_cache_length_rounded: int
    ring_slots: dict[str, int] = dataclasses.field(default_factory=dict)
    """The slot each ring tensor (e.g. generation_logits_cache) binds in this step."""


class RuntimeBuffers:
    config_type: ClassVar[type]
    size_bounds: ClassVar[tuple[SizeBound, ...]]
    tensor_decls: ClassVar[tuple[TensorDecl, ...]]
    step_sizes: ClassVar[tuple[str, ...]] = ()
    flags: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        config: Any,
        device: str | torch.device = "cpu",
        static_inputs: dict[str, Any] | None = None,
    ) -> None:
        """Allocate every tensor of the family for `config` on `device` (staging in pinned
        memory on CUDA). `static_inputs` gives the values of the static tensors (tensor name
        -> array-like broadcastable to its capacity shape; see ``set_static``)."""
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
        self._check_allocatable(decls)

        # the staging layout: mirror sources, smallest first, so the per-step copy can stop
        # inside the last (largest) member
        mirror_of = {d.fill.source: d.name for d in decls if isinstance(d.fill, Mirror)}
        sources = sorted(
            (self.decls[name] for name in mirror_of), key=lambda d: self._nbytes(d.name)
        )
        offsets: dict[str, int] = {}
        end = 0
        for s in sources:
            offsets[s.name] = end
            end += -(-self._nbytes(s.name) // ALIGN) * ALIGN
        self._host_arenas = [
            torch.empty(end, dtype=torch.uint8, pin_memory=pin) for _ in range(HALVES)
        ]
        self._device_arena = torch.empty(end, dtype=torch.uint8, device=self.device)
        self._numpy_arenas = (
            (self._device_arena.numpy(), [a.numpy() for a in self._host_arenas])
            if self.device.type == "cpu"
            else None
        )

        # per half, the flat storage of every tensor (only mirror sources differ between halves)
        self._flat: list[dict[str, torch.Tensor]] = [{} for _ in range(HALVES)]
        for d in decls:
            if isinstance(d.fill, Mirror):  # same dtype and capacity as its source (generator)
                flats = [
                    self._arena_view(self._device_arena, offsets[d.fill.source], d.name)
                ] * HALVES
            elif d.name in offsets:
                flats = [self._arena_view(a, offsets[d.name], d.name) for a in self._host_arenas]
            elif d.memory == DEVICE:
                flats = [
                    torch.empty(self._numel[d.name], dtype=self._dtype[d.name], device=self.device)
                ] * HALVES
            else:
                # host tensors a rule fills get one storage per half, like the staged ones, so a
                # step that fails half-way never touches the last step's values
                flats = [
                    torch.empty(
                        self._numel[d.name],
                        dtype=self._dtype[d.name],
                        pin_memory=pin and d.memory == PINNED,
                    )
                    for _ in range(HALVES if isinstance(d.fill, Rule) else 1)
                ]
                flats *= HALVES // len(flats)
            value = d.fill.value(c) if isinstance(d.fill, Constant) else (d.pad or 0)
            for flat in dict.fromkeys(flats):  # each distinct storage once
                flat.fill_(value)
            for h in range(HALVES):
                self._flat[h][d.name] = flats[h]
        if end:
            self._device_arena.copy_(self._host_arenas[0])  # mirrors start with their pads
        self._capacity_shape = {d.name: tuple(d.capacity(c)) for d in decls}

        # per-step plans, decided here once
        self._bounds = tuple((b.size, b.bound(c)) for b in self.size_bounds)
        self._guards = tuple((d.name, d.shape, self._numel[d.name]) for d in decls if d.checked)
        rules = [(d.name, d.fill) for d in decls if isinstance(d.fill, Rule)]
        self._checks = tuple(dict.fromkeys(r.check for _, r in rules if r.check is not None))
        # host rules write numpy views of the staging storage; device rules write the torch
        # tensor (copies of request tensors, enqueued on the current stream)
        self._fills = [
            tuple(
                (
                    name,
                    rule,
                    self._flat[h][name]
                    if self.decls[name].memory == DEVICE
                    else self._flat[h][name].numpy(),
                    self.decls[name].pad,
                )
                for name, rule in rules
            )
            for h in range(HALVES)
        ]
        # elements written by the last fill of each storage (a one-item list, shared by the
        # halves where the storage is), so the rows past a shorter step are re-padded
        shared = {name: [0] for name in self.decls if self._flat[0][name] is self._flat[1][name]}
        self._high_water: list[dict[str, list[int]]] = [
            {name: shared.get(name) or [0] for name in self.decls} for _ in range(HALVES)
        ]
        # the copy: whole members but the last, whose used prefix is copied (with the rows the
        # device still holds from a longer earlier step, now pads)
        last = sources[-1].name if sources else None
        self._copy_last = (
            last if last is not None and isinstance(self.decls[last].fill, Rule) else None
        )
        self._copy_base = offsets[self._copy_last] if self._copy_last else end
        self._copy_itemsize = self._dtype[last].itemsize if last else 0
        self._device_high_water = 0
        self.copies_per_step = 1 if end else 0

        # engine bindings: (engine name, tensor, step shape, index into its leading dims);
        # static tensors of a fixed shape are bound once (static_inputs); those with a step
        # shape (Medusa's tree, set once, read [num_generation_requests, ...]) are bound every
        # step at it, as views of their storage, as the reference resizes them; ring tensors
        # bind one slot per step
        zero = StepSizes(**dict.fromkeys(STEP_SIZES, 0))
        step_shaped = {
            d.name for d in decls if tuple(d.shape(c, zero)) != self._capacity_shape[d.name]
        }

        def bindings(which: str) -> tuple:
            return tuple(
                (name, d.name, d.shape, index)
                for d in decls
                if (d.fill is not STATIC or d.name in step_shaped) and d.ring is None
                for b in getattr(d, which)
                if b.when is None or b.when(c)
                for name, index in b.expand(c)
            )

        self._inputs = bindings("inputs")
        self._outputs = bindings("outputs")
        self._rings = tuple(
            (which, b.engine_name, d.name, d.ring)
            for d in decls
            if d.ring is not None
            for which in ("inputs", "outputs")
            for b in getattr(d, which)
            if b.when is None or b.when(c)
        )
        self._ring_step = 0
        self._static_bindings = {
            name: (d.name, index)
            for d in decls
            if d.fill is STATIC and d.name not in step_shaped
            for b in d.inputs
            if b.when is None or b.when(c)
            for name, index in b.expand(c)
        }
        for name, values in (static_inputs or {}).items():
            self.set_static(name, values)
        self._encoder_sizes = any(z in self.step_sizes for z in ENCODER_SIZES)
        self._reuse: dict = {}  # per-request columns kept from the last step (Batch.build)
        self._views: list[dict[str, dict[tuple[int, ...], torch.Tensor]]] = [
            {name: {} for name in self.decls} for _ in range(HALVES)
        ]
        self._past_kv = next((n for n, r in rules if r is past_key_value_lengths), None)
        self._copy_done = [torch.cuda.Event() for _ in range(HALVES)] if pin else None
        self._half = 1  # the first step writes half 0
        self._step_views: list[tuple[StepSizes, dict, dict] | None] = [None] * HALVES
        self._last: StepSizes | None = None
        self._longest = 0  # the longest past-KV length of the last step
        self._decode: Decode | None = None  # set after a step that advance() may follow
        # the run of decode steps (a prepare_step and the advance() calls after it) whose
        # values each half holds: advance() skips what a half already has
        self._run = 0
        self._half_run: list[int | None] = [None] * HALVES
        self._no_advance = tuple(
            dict.fromkeys(r.name for _, r in rules if r.advance is None)
        )  # rules without an advance form: advance() is not possible for this family
        self._can_advance = not self._no_advance
        self._limits = Limits.of(c, self.flags)
        self._advance_checks = tuple(
            dict.fromkeys(r.advance_check for _, r in rules if r.advance_check is not None)
        )

    # ------------------------------------------------------------------------- helpers
    def _check_allocatable(self, decls: list[TensorDecl]) -> None:
        """A ConfigError with the bytes needed when the Config asks for more memory than the
        machine has (instead of a failure deep inside torch, or an out-of-memory kill while
        the pads are written)."""
        device = sum(self._nbytes(d.name) for d in decls if d.memory == DEVICE)
        host = sum(
            (HALVES if isinstance(d.fill, Rule) else 1) * self._nbytes(d.name)
            for d in decls
            if d.memory != DEVICE
        )
        try:
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
            physical = None
        if self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[1]
            needs = [("device", device, total), ("host", host, physical)]
        else:
            needs = [("host", device + host, physical)]
        for where, nbytes, available in needs:
            if available is not None and nbytes > available:
                raise ConfigError(
                    f"these buffers need {nbytes:,} bytes of {where} memory, more than the "
                    f"{available:,} bytes the machine has; lower the Config's capacities "
                    f"(`bufc report` shows each tensor's share)"
                )

    def _nbytes(self, name: str) -> int:
        return self._numel[name] * self._dtype[name].itemsize

    def _arena_view(self, arena: torch.Tensor, offset: int, name: str) -> torch.Tensor:
        return arena[offset : offset + self._nbytes(name)].view(self._dtype[name])

    def _view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        # the reference's reshape: the step tensor is the leading part of the capacity. Views
        # are cached per shape, so a repeated shape hands out the very same tensor object.
        cache = self._views[self._half][name]
        view = cache.get(shape)
        if view is None:
            view = cache[shape] = self._flat[self._half][name][: math.prod(shape)].view(shape)
        return view

    def set_static(self, name: str, values: Any) -> None:
        """Write a static tensor (broadcast to its capacity shape), e.g. the KV pool pointers
        once the pools exist. Its engine bindings are in ``static_inputs``. Raises ConfigError
        (nothing written) for an unknown name, values that do not broadcast to the shape, or
        values the dtype cannot hold exactly (a float or out-of-range value for an integer
        tensor)."""
        d = self.decls.get(name)
        if d is None or d.fill is not STATIC:
            statics = ", ".join(n for n, x in self.decls.items() if x.fill is STATIC) or "none"
            raise ConfigError(f"{name!r} is not a static tensor of this family (static: {statics})")
        target = self._flat[0][name].view(self._capacity_shape[name])
        source = _static_values(name, values, target.dtype)
        try:
            target.copy_(source.expand_as(target))
        except RuntimeError:
            raise ConfigError(
                f"{name}: values of shape {list(source.shape)} do not broadcast to its shape "
                f"{list(self._capacity_shape[name])}"
            ) from None

    @property
    def static_inputs(self) -> dict[str, torch.Tensor]:
        """Engine inputs bound once (the reference's setStaticInputTensors)."""
        out = {}
        for engine_name, (name, index) in self._static_bindings.items():
            view = self._flat[0][name].view(self._capacity_shape[name])
            out[engine_name] = view[index] if index else view
        return out

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor at its capacity shape (staged host tensors: the half of the last step)."""
        flat = self._flat[self._half]
        return {name: flat[name].view(shape) for name, shape in self._capacity_shape.items()}

    # ------------------------------------------------------------------------ per step
    def prepare_step(
        self, context_requests: Sequence[Any], generation_requests: Sequence[Any]
    ) -> Step:
        """Fill every buffer for one step and return the engine IO views.

        Raises BatchError, with the buffers untouched, when the batch is invalid or over
        capacity. The engine must run on the current CUDA stream (the copy is ordered on it).
        """
        c = self.config
        batch = Batch.build(
            context_requests,
            generation_requests,
            self._limits,
            reuse=self._reuse,
            encoder=self._encoder_sizes,
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
        try:
            for check in self._checks:
                check(batch, c)
        except BatchError:
            raise
        except Exception as exc:  # a value a check could not even read (an odd type)
            raise BatchError(
                f"a request value could not be checked ({type(exc).__name__}: {exc})"
            ) from exc

        h = self._half ^ 1
        self._wait_for_half(h)
        high = self._high_water[h]
        last_used = 0
        try:
            for name, rule, out, pad in self._fills[h]:
                n = rule.fill(out, batch, c)
                written = high[name]
                if pad is not None and written[0] > n:
                    out[n : written[0]] = pad  # rows past this step hold the pad value
                written[0] = n
                if name == self._copy_last:
                    last_used = n
        except Exception as exc:  # a fill raised although every check passed: a bug
            self._abandon_half(h)
            raise BatchError(
                f"a fill failed after the checks passed ({type(exc).__name__}: {exc}); the "
                "step was abandoned and the last step stays current (host buffers as they were; "
                "a device tensor a fill copies request tensors into may be partly written). "
                "Please report this batch."
            ) from exc
        self._half = h
        self._copy(h, last_used)
        self._run += 1
        self._half_run[h] = self._run
        self._longest = int(batch.past_key_value_lengths.max()) if s.num_sequences else 0
        self._last = s
        ready = self._can_advance and s.num_sequences and not s.num_context_requests
        self._decode = (
            Decode(batch, batch.seq_last_token, batch.seq_num_tokens)
            if ready and not batch.gen_drafts.any()
            else None
        )
        return self._step(s)

    def advance(self, tokens: Sequence[int] | np.ndarray | torch.Tensor) -> Step:
        """The next decode step of the same generation requests, each beam one token longer.

        `tokens[i]` is sequence i's new token (as sampled from row i of the last step's logits).
        It may follow a generation-only step without draft tokens (prepared by prepare_step or
        advance). The buffers are updated from the last step's values in O(1) Python work; the
        requests are read only where a sequence starts a new KV block, whose id must already be
        in its kv_block_ids. The caller still appends the tokens to its requests (a later
        prepare_step reads them). Raises BatchError, with the buffers untouched, otherwise.
        """
        if self._no_advance:
            raise BatchError(
                f"advance() is not available for this family: its fill rule(s) "
                f"{', '.join(self._no_advance)} have no advance form; use prepare_step"
            )
        d = self._decode
        if d is None:
            raise BatchError(
                "advance() follows a generation-only step without draft tokens; use prepare_step"
            )
        prev = self._half
        h = prev ^ 1
        try:
            new = self._checked_tokens(tokens, len(d.tokens))
            step_decode = Decode(
                d.batch, new, d.seq_tokens + 1, self._half_run[h] == self._run, d.kv_new
            )
            for check in self._advance_checks:
                check(step_decode, self.config)
        except BatchError:
            raise
        except Exception as exc:  # e.g. a request's block list replaced by something odd
            raise BatchError(
                f"advance(): a value could not be checked ({type(exc).__name__}: {exc})"
            ) from exc
        self._wait_for_half(h)
        high = self._high_water[h]
        last_used = 0
        try:
            for (name, rule, out, pad), (_, _, before, _) in zip(self._fills[h], self._fills[prev]):
                assert rule.advance is not None  # _can_advance held when the decode state was kept
                n = rule.advance(out, before, step_decode, self.config)
                written = high[name]
                if pad is not None and written[0] > n:
                    out[n : written[0]] = pad
                written[0] = n
                if name == self._copy_last:
                    last_used = n
        except Exception as exc:  # a bug: the checks passed
            self._abandon_half(h)
            raise BatchError(
                f"advance() failed after its checks passed ({type(exc).__name__}: {exc}); the "
                "buffers are as they were after the last step. Please report this step."
            ) from exc
        self._half = h
        self._half_run[h] = self._run
        self._copy(h, last_used)
        self._longest += 1
        self._decode = step_decode
        assert self._last is not None  # set by the prepare_step that created the decode state
        return self._step(self._last)

    def _checked_tokens(self, tokens: Any, count: int) -> np.ndarray:
        """advance()'s tokens as an int64 array: `count` integers in the vocabulary."""
        if isinstance(tokens, torch.Tensor):
            if tokens.is_floating_point() or tokens.is_complex() or tokens.layout != torch.strided:
                raise BatchError(f"advance() needs integer tokens, got a {tokens.dtype} tensor")
            tokens = tokens.detach().cpu().numpy()
        a = int_array(np.ravel(tokens) if isinstance(tokens, np.ndarray) else tokens)
        if a is None:
            raise BatchError("advance() needs integer tokens, one per sequence")
        if a.size != count:
            raise BatchError(f"advance() needs {count} tokens, one per sequence, got {a.size}")
        limits = self._limits
        if not in_range(a, 0, limits.token_limit):
            i = int(np.flatnonzero((a < 0) | (a >= limits.token_limit))[0])
            raise BatchError(
                f"advance(): token {a[i]} of sequence {i} is outside 0 .. "
                f"{limits.token_limit - 1} ({limits.token_limit_text})"
            )
        return a

    def _wait_for_half(self, h: int) -> None:
        if self._copy_done is not None:
            self._copy_done[h].synchronize()  # this half's last copy has left it

    def _abandon_half(self, h: int) -> None:
        """Half h was partly written by a step that failed: the current half stays the last
        step's, h holds no run any more, and every row of h is re-padded when it is next
        written (its high-water marks at capacity). Rule state is rebuilt from the requests."""
        self._half_run[h] = None
        for name, written in self._high_water[h].items():
            written[0] = self._numel[name]
        self._reuse.clear()

    def _copy(self, h: int, last_used: int) -> None:
        """The one host-to-device copy of the step: whole members but the last, and of the
        last the used prefix plus the rows the device still holds from a longer step."""
        if not self.copies_per_step:
            return
        span = self._copy_base
        if self._copy_last is not None:
            used = max(last_used, self._device_high_water)
            self._device_high_water = last_used
            span += used * self._copy_itemsize
        else:
            span = self._device_arena.numel()
        if self._numpy_arenas is not None:
            # a CPU "device": a plain memcpy on this thread (torch's copy_ would hand a large
            # copy to its intra-op thread pool, which stalls on a loaded host)
            device, hosts = self._numpy_arenas
            np.copyto(device[:span], hosts[h][:span])
            return
        self._device_arena[:span].copy_(self._host_arenas[h][:span], non_blocking=True)
        if self._copy_done is not None:
            self._copy_done[h].record()

    def _step(self, s: StepSizes) -> Step:
        cached = self._step_views[self._half]
        if cached is None or cached[0] != s:  # steady decoding repeats the sizes: reuse the views
            cached = self._step_views[self._half] = (s, *self.views(s))
        inputs, outputs = dict(cached[1]), dict(cached[2])
        slots = {}
        for which, engine_name, name, ring in self._rings:
            slot = self._ring_step % ring
            view = self._view(name, self._capacity_shape[name])[slot]
            (inputs if which == "inputs" else outputs)[engine_name] = view
            slots[name] = slot
        if self._rings:
            self._ring_step += 1
        return Step(
            inputs=inputs,
            outputs=outputs,
            sizes=s,
            max_kv_cache_length_rounded=self._max_kv_rounded(),
            ring_slots=slots,
        )

    def views(self, sizes: StepSizes) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Engine IO views for arbitrary sizes (e.g. a CUDA-graph batch bucket larger than the
        step): the same storage as the step's views, with the rows past the step holding their
        pad values."""
        c = self.config
        if not isinstance(sizes, StepSizes):
            raise ValueError(f"views() takes StepSizes, got {type(sizes).__name__}")
        if any(v < 0 for v in dataclasses.astuple(sizes)):
            raise ValueError(f"views(): step sizes cannot be negative: {sizes}")
        last = self._last
        if last is not None and sizes != last:
            # a bucket: only a tensor whose step rows lead its shape keeps them in place
            # ([rows, ...], or [1, rows, ...]); one laid out [.., rows, ..] (LoRA's [modules,
            # layers, sequences], ChatGLM's [2, tokens]) would put the step's values elsewhere
            moved = sorted(
                {
                    e
                    for e, n, f, _ in self._inputs + self._outputs
                    if not _prefix_layout(tuple(f(c, last)), tuple(f(c, sizes)))
                }
            )
            if moved:
                raise ValueError(
                    f"views(): {', '.join(moved)} change shape past their first dimension at "
                    "these sizes, so the step's values would not line up with a view at them; "
                    "this family's steps cannot be padded to a bucket"
                )

        def view(n: str, f: Any, index: tuple[int, ...]) -> torch.Tensor:
            shape = tuple(f(c, sizes))
            if math.prod(shape) > self._numel[n]:
                raise ValueError(
                    f"views(): {n!r} would be {list(shape)} at these sizes, beyond its "
                    f"capacity {list(self._capacity_shape[n])}"
                )
            v = self._view(n, shape)
            return v[index] if index else v

        inputs = {e: view(n, f, i) for e, n, f, i in self._inputs}
        outputs = {e: view(n, f, i) for e, n, f, i in self._outputs}
        for which, engine_name, name, ring in self._rings:  # the slot the next step binds
            slot_view = self._view(name, self._capacity_shape[name])[self._ring_step % ring]
            (inputs if which == "inputs" else outputs)[engine_name] = slot_view
        return inputs, outputs

    def _max_kv_rounded(self) -> int:
        if self._past_kv is None:
            return 0
        return -(-self._longest // KV_CACHE_LENGTH_ROUND) * KV_CACHE_LENGTH_ROUND

    def prepare_for_cuda_graph(self, max_sequence_length: int) -> None:
        """Before capturing the last (generation-only) step as a CUDA graph: raise its
        past-KV lengths to min(max_sequence_length - 1, the rounded max KV length), so the
        captured attention grid covers the next steps, as the reference does."""
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
        if self._past_kv is None:
            return
        value = min(max_sequence_length - 1, self._max_kv_rounded())
        self._flat[self._half][self._past_kv][: s.num_sequences] = value
        self._decode = None  # the past-KV lengths no longer follow the tokens
        self._half_run[self._half] = None


def _prefix_layout(small: tuple[int, ...], large: tuple[int, ...]) -> bool:
    """True when a row-major tensor of shape `small` is the leading part of one of shape
    `large`: the shapes differ at most in one dimension, and only 1s come before it."""
    k = next((i for i, (a, b) in enumerate(zip(small, large)) if a != b), None)
    return k is None or (math.prod(small[:k]) == 1 and small[k + 1 :] == large[k + 1 :])


def _static_values(name: str, values: Any, dtype: torch.dtype) -> torch.Tensor:
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
