"""The generic machinery behind every generated module's ``RuntimeBuffers``.

Construction evaluates the construct-time conditions once, allocates every tensor at capacity,
lays the mirrored host tensors out in the staging arena (``staging.Staging``) and builds each
half's fill targets, so a step allocates no tensor and decides nothing the generator decided.
A step is the family's generated program: ``_check`` (every check, before a byte is written),
``_fill`` (every rule tensor), the one host-to-device copy, the views (``advance``: the
generated ``_advance_check`` and ``_advance``). Nothing here names a tensor or a rule.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic

import numpy as np
import torch

from ..errors import BatchError, FillCountError, RuleError
from ..requests import step as request_step
from .bindings import bindings, repeated
from .buckets import Relayout, at_bucket
from .decl import TensorDecl
from .device_build import device_build_of
from .failures import Failures
from .guards import exclusive as _exclusive
from .program import Program
from .project import ProjectImpl, reading, rule_error
from .staging import HALVES, Targets
from .step import NO_SCALARS, InputsT, Step
from .storage import allocate, check_allocatable, records
from .tokens import Gather, sampled_tokens, tokens_on_device, tokens_on_host
from .transfer import Transfer
from .views import Views


class RuntimeBuffers(Views, Failures, Program, Generic[InputsT]):
    """Subclassed by each generated module, which sets these and defines the step program
    (``_limits``, ``_check``, ``_fill`` and, where every rule has an advance form,
    ``_advance_check`` and ``_advance``)."""

    config_type: ClassVar[type]
    state_type: ClassVar[type]  # what the family's checks keep between steps
    tensor_decls: ClassVar[tuple[TensorDecl, ...]]
    no_advance: ClassVar[tuple[str, ...]] = ()  # rules without an advance form
    # the host tensor whose generation rows take each sequence's sampled token
    sampled_tokens: ClassVar[str | None] = None
    advances_on_device: ClassVar[bool] = False  # the family has ``_advance_on_device``
    device_build: ClassVar[bool] = False  # the family has ``_device_fill`` (build='device')
    device_tensors: ClassVar[tuple[str, ...]] = ()  # the device tensors ``_device_fill`` writes
    # the spec's own implementations the step calls: an exception one raises names it
    project_impls: ClassVar[tuple[ProjectImpl, ...]] = ()

    def __init__(
        self,
        config: Any,
        device: str | torch.device = "cpu",
        static_inputs: dict[str, Any] | None = None,
        *,
        device_tokens: bool | None = None,
        double_buffered: bool = True,
        build: str = "host",
    ) -> None:
        """Allocate every tensor of the family for `config` on `device` (staging in pinned
        memory on CUDA). `static_inputs` gives the values of the static tensors (tensor name
        -> array-like broadcastable to its capacity shape; see ``set_static``).
        `device_tokens`: ``step(tokens)`` with the tokens a tensor on `device` gathers them
        there, without reading them on the host (default: on CUDA).
        `double_buffered` (default): each step writes the other half of the staging arena,
        so the host may write a step while the last one's copy is in flight, and the last
        step's host views keep their values meanwhile. False: one half, written in place (a
        step first waits for the last copy; the last step's host views change with the next
        step; after a fill or device failure past the checks, a bug, the next step is prepared
        in full): half the host memory, and only this step's changes to write.
        `build`: ``'host'`` (default), or ``'device'``: only what changed is sent, the device
        tensors are written on the device, a CUDA graph per bucket (``device_build.py``)."""
        if not isinstance(config, self.config_type):
            raise TypeError(
                f"expected {self.config_type.__module__}.Config, got {type(config).__name__}"
            )
        self.config = config
        self.device = torch.device(device)
        self._busy = threading.Lock()
        c = config
        decls = [d for d in self.tensor_decls if d.when is None or d.when(c)]
        self.decls: dict[str, TensorDecl] = {d.name: d for d in decls}
        self._t = records(decls, c)  # one record per tensor: storage, targets, views
        check_allocatable(self._t, decls, self.device, double_buffered)
        self.limits = self._limits()
        self._sizes_within = self._size_bounds()
        if device_tokens is None:
            device_tokens = self.device.type == "cuda"
        sampled, mirror = (
            sampled_tokens(decls, self.sampled_tokens) if device_tokens else (None, None)
        )
        gather_rows = self.limits.max_batch_size * self.limits.max_beam_width
        storage = allocate(self._t, c, self.device, gather_rows if mirror else 0, double_buffered)
        self.double_buffered = double_buffered
        self._staging = storage.staging
        self._targets = [
            Targets({t.name: t.targets[h] for t in self._t.values() if t.targets})
            for h in range(HALVES)
        ]
        self._io = Transfer(storage, self.device, sampled, mirror, gather_rows)
        self._tokens = self._io.tokens  # None: sampled tokens are read on the host
        self._replays = self._io.replays
        self.copies_per_step = self._io.copies_per_step
        self._bind = bindings(decls, c, self.sizes_type)
        self._each = repeated(self._bind)
        self._relayout = Relayout(self.decls, c, self._bind)
        self._ring_step = 0
        for name, values in (static_inputs or {}).items():
            self.set_static(name, values)
        self._half = 1  # the first step writes half 0
        self._step_views: list[tuple[Any, dict, dict] | None] = [None] * HALVES
        self._last: Any = None  # the sizes of the last step
        self._layout: Any = None  # the sizes its tensors are laid out at (its bucket's, if any)
        self._scalars_now: Mapping[str, int] = NO_SCALARS  # the last step's scalars
        self._decode: Any = None  # the state a following advance() continues from, if any
        self._by_step = False  # the last step was step()'s: advance() does not continue it
        # the run of decode steps (a prepare_step and the advance() calls after it) whose
        # values each half holds: advance() skips what a half already has
        self._run = 0
        self._half_run: list[int | None] = [None] * HALVES
        self.state = self.state_type()
        self._flight = self._in_flight()  # the requests in flight (add, finish, step)
        # the Request fields the family never reads: refused when set (add, prepare_step)
        self.limits = self._flight.limits = reading(self)
        self._device = device_build_of(self, build)  # None: the host build

    # ------------------------------------------------------------------------- helpers
    def _rule_error(self, exc: Exception, where: str = "") -> RuleError | None:
        """The RuleError naming the spec's own implementation whose call by the generated
        step raised `exc` (None when bufc's own code raised it)."""
        return rule_error(type(self), exc, where) if self.project_impls else None

    @property
    def bytes_to_device(self) -> int:
        """Bytes the steps have copied from the host to the device so far."""
        return self._staging.bytes_up

    @property
    @_exclusive
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor at its capacity shape (staged host tensors: the half of the last step;
        where the last step gathered sampled tokens on the device, once they are back)."""
        self._tokens_back()
        return {name: t.capacity_view(self._half) for name, t in self._t.items()}

    # ------------------------------------------------------------------------ per step
    @_exclusive
    def prepare_step(
        self,
        context_requests: Sequence[Any],
        generation_requests: Sequence[Any],
        *,
        bucket: tuple[int, int] | None = None,
    ) -> Step[InputsT]:
        """Fill every buffer for one step and return the engine IO views (the stateless entry
        point: every scheduled request is read). `bucket`: (tokens, rows) of the CUDA graph
        the step runs in; every tensor is then laid out at those sizes, and so are the views.

        Raises BatchError, with the buffers untouched, when the batch is invalid or over
        capacity. The engine must run on the current CUDA stream (the copy is ordered on it).
        """
        self._not_in_flight("prepare_step")
        step = self._prepare(lambda: self._batch(context_requests, generation_requests), bucket)
        self._by_step = False
        return step

    def _prepare(
        self, batch: Callable[[], Any], bucket: Any, gather: Gather | None = None
    ) -> Step[InputsT]:
        """Check and fill the step of the batch `batch()` reads (laid out at `bucket`, if not
        None), copy it (and gather the sampled tokens of `gather` on the device), and hand out
        its views."""
        try:
            b = batch()
            s = layout = b.sizes
            if bucket is not None:
                layout = at_bucket(s, bucket)
                self._relayout.check(self._targets[0], s, layout)
            checked = self._check(b)
        except BatchError:
            raise
        except Exception as exc:  # a value a check could not even read (an odd type)
            named = self._rule_error(exc)
            if named is not None:  # a project's check raised
                self.state = self.state_type()  # it may have changed its state: rebuilt
                raise named from exc
            raise BatchError(
                f"a request value could not be checked ({type(exc).__name__}: {exc})"
            ) from exc
        h = self._half ^ 1
        self._staging.wait(h)
        targets = self._targets[h]
        try:
            decode = self._fill(targets, checked)
            scalars = self._scalars(targets, s)
            if layout is not s:
                self._relayout.apply(targets, s, layout)
                decode = None  # no advance() from a step laid out at a bucket
        except FillCountError as exc:  # a rule returned a bad count: the error names it
            self._abandon_half(h)
            raise self._noted(exc) from None
        except Exception as exc:  # a fill raised although every check passed: a bug
            self._abandon_half(h)
            named = self._rule_error(exc)
            if named is not None:  # a project's fill raised: the error names it
                raise self._noted(named) from exc
            raise self._noted(
                BatchError(
                    f"a fill failed after the checks passed ({type(exc).__name__}: {exc}); the "
                    "step was abandoned and the last step stays current (host buffers as they were; "
                    "a device tensor a fill copies request tensors into may be partly written). "
                    "Please report this batch."
                )
            ) from exc
        self._to_device(h, lambda: self._io.copy(h, targets, gather))
        self._half = h
        self._run += 1
        self._half_run[h] = self._run
        self._scalars_now = scalars
        self._last, self._layout = s, layout
        self._decode = decode
        return self._step(s, layout)

    @_exclusive
    def advance(self, tokens: Sequence[int] | np.ndarray | torch.Tensor) -> Step[InputsT]:
        """The next decode step of the same generation requests, each beam one token longer.

        `tokens[i]` is sequence i's new token (as sampled from the last step's output row i).
        It may follow a generation-only step without draft tokens (prepared by prepare_step or
        advance). The buffers are updated from the last step's values in O(1) Python work; the
        requests are read only where a sequence starts a new KV block, whose id must already be
        in its kv_block_ids: between advance() calls a block list may only grow (a block
        replaced in place is not seen: call prepare_step, or use step(), whose lists are its
        own). The caller still appends the tokens to its requests (a later prepare_step reads
        them). Raises BatchError, with the buffers untouched, otherwise.
        """
        self._not_in_flight("advance")
        if self._by_step:
            raise BatchError(
                "advance() continues a prepare_step or advance step, but the last step was "
                "step()'s; call prepare_step to start a stateless run"
            )
        return self._advance_step(tokens_on_host(tokens, self.limits, "advance()"))

    def _advance_step(self, tokens: Any, gather: Gather | None = None) -> Step[InputsT]:
        if self.no_advance:
            raise BatchError(
                f"advance() is not available for this family: its fill rule(s) "
                f"{', '.join(self.no_advance)} have no advance form; use prepare_step"
            )
        if self._decode is None:
            raise BatchError(
                "advance() follows a generation-only step without draft tokens; use prepare_step"
            )
        prev = self._half
        h = prev ^ 1
        try:
            advancing = self._advance_check(self._decode, tokens, self._half_run[h] == self._run)
        except BatchError:
            raise
        except Exception as exc:  # e.g. a request's block list replaced by something odd
            named = self._rule_error(exc)
            if named is not None:  # a project's advance check raised
                self.state = self.state_type()
                raise named from exc
            raise BatchError(
                f"advance(): a value could not be checked ({type(exc).__name__}: {exc})"
            ) from exc
        self._staging.wait(h)
        targets = self._targets[h]
        try:
            self._advance(targets, self._targets[prev], advancing)
        except FillCountError as exc:  # an advance form returned a bad count: named
            self._abandon_half(h)
            raise self._noted(exc.in_advance()) from None
        except Exception as exc:  # a bug: the checks passed
            self._abandon_half(h)
            named = self._rule_error(exc)
            if named is not None:  # a project's advance form raised
                raise self._noted(named) from exc
            raise self._noted(
                BatchError(
                    f"advance() failed after its checks passed ({type(exc).__name__}: {exc}); the "
                    "buffers are as they were after the last step. Please report this step."
                )
            ) from exc
        if gather is not None and self.advances_on_device:
            # the tokens stay on the device: so does the step (the mirrors updated in place,
            # only what has no device form copied up)
            self._to_device(
                h,
                lambda: self._io.device_step(
                    h, gather, self._last, lambda v: self._advance_on_device(v, advancing)
                ),
            )
        else:
            self._to_device(h, lambda: self._io.copy(h, targets, gather))
        self._half = h
        self._half_run[h] = self._run
        self._scalars_now = self._scalars(targets, self._last)
        self._layout = self._last
        self._decode = advancing.decode
        return self._step(self._last, self._last)

    # ------------------------------------------------------------- requests in flight
    @_exclusive
    def add(self, request: Any) -> None:
        """A request arrives, in the context phase, in its ``seq_slot``: its prompt, beam
        width, drafts, explicit position ids and KV block lists are read and checked now, once
        (BatchError otherwise, nothing kept). Its first step is the next ``step``."""
        try:
            device = self._device  # the device build's own arrival checks too
            self._flight.add(request, self._admit if device is None else device.admitting)
            if device is not None:  # the slot's block rows go up with the next step
                device.arrived_at(int(request.seq_slot))
        except BatchError:
            raise
        except Exception as exc:  # a value an arrival check could not even read
            named = self._rule_error(exc)
            if named is not None:  # a project's arrival check raised
                raise named from exc
            raise BatchError(
                f"add(): a request value could not be checked ({type(exc).__name__}: {exc})"
            ) from exc

    @_exclusive
    def finish(self, seq_slot: int) -> None:
        """The request in ``seq_slot`` leaves (finished or cancelled); the slot is free for
        the next ``add``. The last generation row moves into its row."""
        self._flight.finish(seq_slot)

    @_exclusive
    def step(
        self,
        tokens: Any = None,
        *,
        accepted: Mapping[int, int] | None = None,
        drafts: Mapping[int, Sequence[int]] | None = None,
        chunks: Mapping[int, int] | None = None,
        blocks: Mapping[int, Any] | None = None,
        generation: bool = True,
        bucket: tuple[int, int] | None = None,
    ) -> Step[InputsT]:
        """The next step of the requests in flight, from what changed since the last one.

        - `tokens`: what the last step sampled, indexed by seq slot (``tokens[slot]``, or
          ``tokens[slot, beam]`` with beam search: TensorRT-LLM's decoder layout), a numpy
          array, a list or a tensor with at least max_batch_size rows. Read for the requests
          that produced a token: the last step's generation requests and the prompts it
          finished (which decode from this step). None when there are none.
        - `accepted`: ``{slot: n}``, the draft tokens of the last step that slot's request
          accepted (it grows by n + 1 tokens; default 0).
        - `drafts`: ``{slot: tokens}``, the draft tokens each generation request verifies in
          this step (none for the others).
        - `chunks`: ``{slot: size}``, the prompt tokens each context-phase request computes
          in this step; None runs every context-phase request's whole remaining prompt, and a
          request left out of a mapping waits.
        - `blocks`: ``{slot: ids}``, KV block ids appended to the slot's block lists (a list
          of ids for every list of the request, or one list per list it holds).
        - `generation`: False runs no generation request in this step (a recurrent model runs
          context and generation requests in separate steps); they produce no token.
        - `bucket`: (tokens, rows) of the CUDA graph the step runs in: every tensor is laid out
          at those sizes, and so are the step's views (``prepare_step`` takes it too).

        Tokens as a tensor on the buffers' CUDA device (``device_tokens``) are not read on the
        host: the device writes them into the generation rows after the step's copy, so the
        host need not wait for the model that sampled them. A token outside the vocabulary is
        then not written (its row gets the pad value) and the next ``step`` raises BatchError
        naming its slot, until that request is finished.

        Rows: context requests in arrival order, then the generation requests (``finish``
        moves the last generation row into the hole; finished prompts join at the end); the
        engine reads each row's slot in the step's seq-slot tensor. Every value is checked
        before a byte is written (BatchError, nothing changed). A step where only the tokens
        changed continues the last step's buffers in place (as ``advance`` does).
        """
        if generation is not True and generation is not False:
            raise BatchError(f"step(): generation must be True or False, got {generation!r}")
        if self._device is not None:
            return self._device.step(
                tokens,
                accepted=accepted,
                drafts=drafts,
                chunks=chunks,
                blocks=blocks,
                generation=generation,
                bucket=bucket,
            )
        # the in-flight state continues in place only a step of its own (prepare_step and
        # advance are refused while it holds requests)
        steady = self._decode is not None and not self.no_advance and self._by_step
        steady = steady and bucket is None
        on_device = (
            self._tokens is not None
            and isinstance(tokens, torch.Tensor)
            and tokens.device == self._tokens.device.device
        )
        self._tokens_back()
        tensor = tokens
        try:
            tokens = (
                tokens_on_device(tokens, self.limits)
                if on_device
                else tokens_on_host(tokens, self.limits, "step()")
            )
            plan = request_step.plan(
                self._flight,
                tokens,
                accepted=accepted,
                drafts=drafts,
                chunks=chunks,
                blocks=blocks,
                generation=generation,
                steady=steady,
                on_device=on_device,
            )
        except BatchError:
            raise
        except Exception as exc:  # a value a check could not even read (an odd type)
            raise BatchError(
                f"step(): a value could not be checked ({type(exc).__name__}: {exc})"
            ) from exc
        gather = None
        if plan.gather is not None:  # the tokens stay on the device: gathered there
            gather = Gather(tensor, plan.gather.src, plan.gather.dst, self.limits.token_limit)
        try:
            if plan.batch is not None:
                step = self._prepare(lambda: plan.batch, bucket, gather)
            else:
                step = self._advance_step(plan.tokens, gather)
        except BaseException:
            plan.undo()
            raise
        request_step.commit(self._flight, plan)
        self._by_step = True
        return step

    def _not_in_flight(self, what: str) -> None:
        if self._device is not None:
            raise BatchError(f"{what}() builds on the host; these buffers build='device'")
        flight = self._flight
        if flight.waiting or flight.n_rows or flight.completing:
            raise BatchError(
                f"{what}() reads every request of the step, but requests are in flight here "
                "(add/step): finish them first, or drive these buffers with step() alone"
            )

    def _tokens_back(self) -> None:
        """The sampled tokens the last step gathered on the device are back on the host: the
        in-flight state takes them (BatchError from the next plan for one that was out of
        range)."""
        values = self._io.tokens_back()
        if values is not None:
            self._flight.tokens_back(values)
