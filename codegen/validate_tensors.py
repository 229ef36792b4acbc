"""Each tensor's own declaration: a unique name, its bindings and their index sets, ring
tensors, mirrors of pinned host tensors, dtype, pad, capacity and step shape (a step shape
that can never fit its capacity), constant fills; rule tensors through ``validate_rules``."""

from __future__ import annotations

import re

from . import expr as E
from . import expr_poly as P
from . import prove, vocab
from .errors import did_you_mean
from .model import Binding, Tensor
from .validate_names import CAPACITY, CAPTURE, CONSTANT, SHAPE, WHEN, Scope
from .validate_rules import rule_tensor


def _pad(scope: Scope, t: Tensor) -> None:
    """A constant pad lies in the tensor's dtype range; repeat_last pads a one-dimensional rule
    tensor (the last element repeated: of a row of several elements it would take only one)."""
    assert t.pad is not None
    if t.pad == vocab.REPEAT_LAST:
        rule = scope.spec.rule(t.fill.target or "") if t.fill.kind == "rule" else None
        shape = t.shape if t.shape is not None else (rule.shape if rule else None)
        if t.fill.kind != "rule":
            what = f"is filled by {t.fill.kind}"
        elif t.memory == "device":
            what = "is device memory (its last element would be read back every step)"
        elif shape is not None and len(shape) != 1:
            what = f"has {len(shape)} dimensions"
        else:
            return
        scope.errors.error(
            t.field_loc("pad"),
            f"tensor '{t.name}': pad repeat_last repeats the last element its rule wrote and "
            f"needs a one-dimensional rule tensor, but '{t.name}' {what}; give a constant pad",
        )
        return
    if t.dtype == "bool" and t.pad not in (0, 1):
        scope.errors.error(t.field_loc("pad"), f"pad of bool tensor '{t.name}' must be 0 or 1")
        return
    for dtype in scope.dtype_choices(t.dtype):
        lo, hi = vocab.DTYPE_RANGES[dtype]
        if not lo <= t.pad <= hi:  # type: ignore[operator]
            via = f" (dtype parameter '{t.dtype}' may be {dtype})" if t.dtype != dtype else ""
            scope.errors.error(
                t.field_loc("pad"),
                f"pad {t.pad} of tensor '{t.name}' is outside the range of {dtype}, "
                f"{lo} to {hi}{via}",
            )
            break


def _pad_kind_holds(kind: str, pad: int | str) -> bool:
    if kind == "repeat_last":
        return pad == vocab.REPEAT_LAST
    if isinstance(pad, str):
        return False
    return pad < 0 if kind == "negative" else pad == 0 if kind == "zero" else pad >= 0


def _pad_fits_rule(scope: Scope, t: Tensor) -> None:
    """A rule tensor's pad (0 when none is given) is one its rule allows: a padded row of a
    CUDA-graph bucket must not turn into a negative length, an index before the first row or
    a slot that aliases a live one."""
    rule = scope.spec.rule(t.fill.target or "") if t.fill.kind == "rule" else None
    if rule is None or not rule.pads:
        return
    pad = t.pad if t.pad is not None else 0
    if any(_pad_kind_holds(kind, pad) for kind in rule.pads):
        return
    need = " or ".join(vocab.PAD_KINDS[k] for k in rule.pads)
    fix = {"repeat_last": "repeat_last", "negative": "-1", "zero": "0", "nonnegative": "0"}
    scope.errors.error(
        t.field_loc("pad") if t.pad is not None else t.field_loc("fill"),
        f"tensor '{t.name}': pad {pad} does not fit its rule '{rule.name}', whose padded rows "
        f"must {need}; set pad: {fix[rule.pads[0]]}",
    )


def tensors(scope: Scope) -> None:
    """Each tensor once (a name declared twice is reported, not checked again)."""
    by_name: dict[str, Tensor] = {}
    for t in scope.spec.tensors:
        scope.check_name(t.name, t.loc, "tensor")
        if t.name in by_name:
            scope.errors.error(
                t.loc,
                f"tensor '{t.name}' is already declared at {by_name[t.name].loc.line_from(t.loc)}",
            )
            continue
        by_name[t.name] = t
    for t in scope.spec.tensors:
        _tensor(scope, t, by_name)


def _tensor(scope: Scope, t: Tensor, by_name: dict[str, Tensor]) -> None:
    scope.formula(t.when, WHEN)
    for b in t.bind:
        scope.formula(b.when, WHEN)
        _binding(scope, t, b, by_name)
    if t.fill.kind == "mirror":
        _mirror(scope, t, by_name)
        return
    if t.ring is not None:
        _ring(scope, t)
    for key in ("dtype", "capacity", "shape"):
        if getattr(t, key) is None:
            scope.errors.error(t.loc, f"tensor '{t.name}' needs '{key}'")
    if t.dtype is not None and t.dtype not in vocab.DTYPES and scope.kinds.get(t.dtype) != "dtype":
        options = [*vocab.DTYPES, *(p.name for p in scope.spec.parameters if p.kind == "dtype")]
        scope.errors.error(
            t.field_loc("dtype"),
            f"unknown dtype '{t.dtype}'{did_you_mean(t.dtype, options)}; "
            f"use one of {', '.join(vocab.DTYPES)} or a dtype parameter",
        )
    for f in t.capacity or ():
        scope.formula(f, CAPACITY)
    for f in t.shape or ():
        scope.formula(f, SHAPE)
    if t.capacity is not None and t.shape is not None:
        if len(t.capacity) != len(t.shape):
            scope.errors.error(
                t.field_loc("shape"),
                f"tensor '{t.name}': shape has {len(t.shape)} dimensions "
                f"but capacity has {len(t.capacity)}",
            )
        elif not scope.errors:
            _capacity_fits(scope, t)
    if t.pad is not None:
        _pad(scope, t)
    _pad_fits_rule(scope, t)
    if t.capture is not None:
        if t.fill.kind != "rule" or t.memory == "device":
            scope.errors.error(
                t.field_loc("capture"),
                f"tensor '{t.name}': prepare_for_cuda_graph writes a capture value into a host "
                f"or pinned tensor a rule fills, not {t.memory} memory filled by {t.fill.kind}",
            )
        else:
            scope.formula(t.capture, CAPTURE)
    if t.fill.kind == "rule":
        rule_tensor(scope, t)
    elif t.fill.kind == "constant" or (t.fill.kind == "static" and t.fill.value is not None):
        _constant(scope, t)


def _constant(scope: Scope, t: Tensor) -> None:
    """A constant fill: an integer formula, or the name of a list of ints (a parameter or a
    derived list), written element by element (its length is checked at construction)."""
    value = t.fill.value
    assert value is not None
    name = value.expr.id if isinstance(value.expr, E.Name) else None
    kind = scope.kinds.get(name or "")
    if name is not None and kind in ("names", "list"):
        param = scope.params.get(name)
        if param is not None and param.kind == "names":
            scope.errors.error(
                value.at(0), f"'{name}' is a list of names; a constant fill writes numbers"
            )
        return
    scope.formula(value, CONSTANT)


def _binding(scope: Scope, t: Tensor, b: Binding, by_name: dict[str, Tensor]) -> None:
    sets = {x.name for x in scope.spec.index_sets}
    placeholders = re.findall(r"\{([a-z][a-z0-9_]*)\}", b.engine_name)
    for name in b.each:
        if name not in sets:
            scope.errors.error(
                b.loc,
                f"unknown index set '{name}'{did_you_mean(name, sets)}; declare it under index_sets",
            )
    if sorted(placeholders) != sorted(b.each):
        scope.errors.error(
            b.loc,
            f"engine name '{b.engine_name}' must hold each index set of 'each' exactly once as "
            f"{{SET}}; it holds {', '.join(placeholders) or 'none'}, 'each' lists "
            f"{', '.join(b.each) or 'none'}",
        )
    src = by_name.get(t.fill.target or "") if t.fill.kind == "mirror" else t
    dims = len(src.shape) if src is not None and src.shape is not None else None
    if dims is not None and len(b.each) >= dims:
        scope.errors.error(
            b.loc,
            f"'{t.name}' has {dims} dimensions; 'each' can index at most {dims - 1} leading ones",
        )


def _ring(scope: Scope, t: Tensor) -> None:
    assert t.ring is not None
    if t.capacity is None or t.shape is None:
        return
    first = t.capacity[0].expr
    if not (isinstance(first, E.Int) and first.value == t.ring):
        scope.errors.error(
            t.field_loc("ring"),
            f"ring tensor '{t.name}': its first capacity dimension must be the ring size {t.ring}",
        )
    if len(t.capacity) == len(t.shape) and not all(
        P.equal(a.expr, b.expr) for a, b in zip(t.capacity, t.shape)
    ):
        scope.errors.error(
            t.field_loc("ring"),
            f"ring tensor '{t.name}': its shape must equal its capacity (each step binds one slot)",
        )


def _mirror(scope: Scope, t: Tensor, by_name: dict[str, Tensor]) -> None:
    for key in ("dtype", "capacity", "shape", "pad"):
        if getattr(t, key) is not None:
            scope.errors.error(
                t.field_loc(key),
                f"mirror '{t.name}' inherits '{key}' from its source; remove it",
            )
    src = by_name.get(t.fill.target or "")
    if src is None:
        scope.errors.error(
            t.fill.loc,
            f"mirror source '{t.fill.target}' is not a tensor"
            f"{did_you_mean(t.fill.target or '', by_name)}",
        )
        return
    if src.memory != "pinned":
        scope.errors.error(
            t.fill.loc,
            f"mirror source '{src.name}' must be pinned host memory, not {src.memory} "
            "(it is staged in the pinned arena that is copied to the device each step)",
        )
    if t.memory != "device":
        scope.errors.error(
            t.field_loc("memory"),
            f"mirror '{t.name}' is a host-to-device copy; its memory must be device",
        )


def _capacity_fits(scope: Scope, t: Tensor) -> None:
    """Error when a step shape can never fit its capacity (proofs that it always fits are
    recorded by ``plan``; anything in between is checked at run time)."""
    assert t.capacity is not None and t.shape is not None
    for i, (cap, step) in enumerate(zip(t.capacity, t.shape)):
        if scope.prover.at_least(step.expr, cap.expr, prove.ZERO, prove.VAR, plus=1):
            scope.errors.error(
                step.loc,
                f"tensor '{t.name}': step shape dimension {i} '{step.shown}' is always "
                f"larger than its capacity '{cap.shown}'",
            )
