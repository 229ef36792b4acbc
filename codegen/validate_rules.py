"""The rules and request checks a spec declares, and each rule tensor against its rule: unique
names (a project's own may not reuse a built-in one), importable paths, request checks that
exist, step sizes the runtime computes; a tensor's memory, dtype, shape and Config reads as
its fill rule declares them."""

from __future__ import annotations

import keyword
from collections.abc import Sequence

from ..requests.sizes import STEP_SIZES
from . import expr_poly as P
from . import vocab
from .errors import Location, did_you_mean
from .model import Impl, Tensor
from .validate_names import Scope


def contracts(scope: Scope) -> None:
    """The rules and request checks: unique names (a project's own may not reuse a
    built-in one), importable paths, checks that exist, step sizes the runtime computes."""
    s = scope.spec
    seen: dict[str, Location] = {}
    for c in s.request_checks:
        scope.check_name(c.name, c.loc, "request check")  # a field of the generated Checked
        _contract_name(scope, c.name, c.loc, "request check", seen)
        check_impl(scope, c.impl)
        if c.state is not None:
            check_impl(scope, c.state)
        if c.admit is not None:
            check_impl(scope, c.admit.impl)
        _step_sizes(scope, c.sizes, c.loc, f"request check '{c.name}'")
    seen = {}
    checks = {c.name for c in s.request_checks}
    for r in s.rules:
        _contract_name(scope, r.name, r.loc, "rule", seen)
        for impl in (
            r.impl,
            r.advance,
            r.advance_check.impl if r.advance_check else None,
            r.device_advance,
            r.device_fill,
        ):
            if isinstance(impl, Impl):
                check_impl(scope, impl)
        if r.check is not None and r.check not in checks:
            scope.errors.error(
                r.field_loc("check"),
                f"rule '{r.name}' names the request check '{r.check}', which is not "
                f"declared{did_you_mean(r.check, checks)}; declare it under request_checks",
            )
        _step_sizes(scope, r.sizes, r.field_loc("sizes"), f"rule '{r.name}'")
        if r.advance is None and (r.advance_reads or r.advance_check or r.device_advance):
            key = (
                "advance_reads"
                if r.advance_reads
                else "advance_check"
                if r.advance_check
                else "device_advance"
            )
            scope.errors.error(
                r.field_loc(key),
                f"rule '{r.name}' has no advance form; add 'advance' or drop this key",
            )


def _contract_name(
    scope: Scope, name: str, loc: Location, what: str, seen: dict[str, Location]
) -> None:
    """A spec's own names are keys of one mapping (the loader refuses a repeated key), so
    a name seen before is a built-in one."""
    if name in seen:
        first = seen[name]
        scope.errors.error(
            loc,
            f"{what} '{name}' is already declared (a built-in {what} at "
            f"{first.file}:{first.line}); choose another name",
        )
        return
    seen[name] = loc


def check_impl(scope: Scope, impl: Impl) -> None:
    """An import path whose parts are identifiers Python can import (the schema checked
    their characters; keywords are refused here)."""
    parts = [*impl.module.split("."), impl.name]
    bad = [p for p in parts if keyword.iskeyword(p) or keyword.issoftkeyword(p)]
    if bad:
        scope.errors.error(
            impl.loc,
            f"'{impl.text}' cannot be imported: '{bad[0]}' is a Python keyword; rename the "
            "module or function",
        )


def _step_sizes(scope: Scope, names: Sequence[str], loc: Location, what: str) -> None:
    for z in names:
        if z not in STEP_SIZES:
            scope.errors.error(
                loc,
                f"{what} reads the step size '{z}', which the runtime does not compute"
                f"{did_you_mean(z, STEP_SIZES)}",
            )


def rule_tensor(scope: Scope, t: Tensor) -> None:
    """A tensor filled by a rule against the rule's declaration: memory, Config reads,
    dtype and shape."""
    name = t.fill.target or ""
    rule = scope.spec.rule(name)
    if rule is None:
        names = [r.name for r in scope.spec.rules]
        scope.errors.error(
            t.fill.loc,
            f"unknown fill rule '{name}'{did_you_mean(name, names)}; docs/spec.md lists "
            "the built-in rules, and a project declares its own under rules",
        )
        return
    if t.memory == "device" and not rule.device:
        scope.errors.error(
            t.field_loc("memory"),
            f"fill rule '{name}' runs on the host: make '{t.name}' pinned and add a "
            "device tensor with fill: {mirror: " + t.name + "}",
        )
    if t.memory != "device" and rule.device:
        scope.errors.error(
            t.field_loc("memory"),
            f"fill rule '{name}' copies request tensors on the device; '{t.name}' must be "
            "device memory",
        )
    check = scope.spec.request_check(rule.check) if rule.check else None
    admit = check.admit.reads if check and check.admit else ()
    for need in (*rule.all_reads, *(check.reads if check else ()), *admit):
        if scope.kinds.get(need) not in ("parameter", "derived", "names", "list", "dtype"):
            scope.errors.error(
                t.fill.loc,
                f"fill rule '{name}' reads '{need}' from the Config; declare it as a "
                "parameter or derived value",
            )
    if t.dtype in vocab.DTYPES and t.dtype not in rule.dtypes:
        scope.errors.error(
            t.field_loc("dtype"),
            f"fill rule '{name}' writes {' or '.join(rule.dtypes)}, not {t.dtype}",
        )
    param = scope.params.get(t.dtype or "")
    if param is not None and param.kind == "dtype":
        cannot = [v for v in param.values if v not in rule.dtypes]
        if cannot:
            scope.errors.error(
                t.field_loc("dtype"),
                f"fill rule '{name}' writes {' or '.join(rule.dtypes)}, but dtype parameter "
                f"'{param.name}' of '{t.name}' may be {', '.join(cannot)}; limit its 'values'",
            )
    if t.shape is not None:
        want = tuple(f.expr for f in rule.shape)
        got = tuple(f.expr for f in t.shape)
        if len(want) != len(got) or not all(P.equal(a, b) for a, b in zip(want, got)):
            scope.errors.error(
                t.field_loc("shape"),
                f"fill rule '{name}' writes shape [{', '.join(f.shown for f in rule.shape)}], "
                f"but '{t.name}' declares [{', '.join(f.shown for f in t.shape)}]",
            )
