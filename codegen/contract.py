"""The rule contract: how a family's generated step calls each implementation a declaration
names, and whether the implementation takes that call.

Written once, used twice: ``tests/test_rules_contract.py`` checks bufc's own implementations
(``rules/builtin.yaml``) with it, and ``bufc validate --import`` and ``bufc generate`` check a
spec's own rules and request checks with it, importing their modules (the project's code
runs). bufc's own implementations are not imported when generating: the generator needs no
torch, while ``bufc.rules`` imports numpy and torch; the test covers them, against the same
function.

The contract (``rules/builtin.yaml`` and docs/spec.md describe it): an implementation takes
exactly the positional arguments the step passes it, in order (``out``, the batch, ...), then,
after ``*``, exactly the Config values its declaration reads, by keyword; a check's state is
a class made with no arguments. bufc's own implementations keep that exact form; a project's
need only accept the call (a parameter with a default, ``**kwargs`` or a read that is not
keyword-only is fine): its problems are reported only when the call would not bind.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from bufc import impls

from .errors import Diagnostic
from .model import Impl, RequestCheck, Rule

# role -> (the generated method that calls it, how a message names the declaration)
ROLES: dict[str, tuple[str, str]] = {
    "check": ("_check", "request check '{}'"),
    "state": ("State", "the state of request check '{}'"),
    "admit": ("_admit", "the arrival check of request check '{}'"),
    "fill": ("_fill", "rule '{}'"),
    "advance_check": ("_advance_check", "the advance check of rule '{}'"),
    "advance": ("_advance", "the advance form of rule '{}'"),
    "device_advance": ("_advance_on_device", "the device advance form of rule '{}'"),
    "device_fill": ("_device_fill", "the device build's form of rule '{}'"),
    "derive": ("Config", "the function of derived value '{}'"),
}


def describe(role: str, owner: str) -> str:
    """How messages name the implementation of `role` of the rule or check `owner`."""
    return ROLES[role][1].format(owner)


@dataclasses.dataclass(frozen=True)
class Call:
    """One implementation as the generated step calls it: the positional arguments it passes
    (described, in order) and the Config values it passes by keyword (``reads``, declared
    under `reads_key`)."""

    role: str
    owner: str
    impl: Impl
    positional: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    reads_key: str = "reads"

    @property
    def what(self) -> str:
        return describe(self.role, self.owner)

    @property
    def kind(self) -> str:
        return "class" if self.role == "state" else "function"


def calls(
    rules: Sequence[Rule], checks: Sequence[RequestCheck], known: Sequence[RequestCheck] = ()
) -> list[Call]:
    """Every implementation `rules` and `checks` name, as the step calls it (`known`: every
    request check a rule may name, when `checks` are not all of them)."""
    by_name = {c.name: c for c in (*known, *checks)}
    out: list[Call] = []
    for c in checks:
        state = (f"its state ({c.state.text})",) if c.state is not None else ()
        out.append(Call("check", c.name, c.impl, ("the batch", *state), c.reads))
        if c.state is not None:
            out.append(Call("state", c.name, c.state))
        if c.admit is not None:
            out.append(
                Call("admit", c.name, c.admit.impl, ("the request",), c.admit.reads, "admit.reads")
            )
    for r in rules:
        check = by_name.get(r.check or "")
        result = (f"the result of request check '{check.name}'",) if check and check.result else ()
        out.append(Call("fill", r.name, r.impl, ("out", "the batch", *result), r.reads))
        ac = r.advance_check
        state = (
            (f"the state of request check '{check.name}'",)
            if check is not None and check.state is not None
            else ()
        )
        if isinstance(r.advance, Impl):
            passed = ("the result of its advance check",) if ac is not None and ac.result else ()
            out.append(
                Call(
                    "advance",
                    r.name,
                    r.advance,
                    ("out", "the last step's values", "the decode step", *passed),
                    r.advance_reads,
                    "advance_reads",
                )
            )
        if ac is not None:
            out.append(
                Call(
                    "advance_check",
                    r.name,
                    ac.impl,
                    ("the decode step", *state),
                    ac.reads,
                    "advance_check.reads",
                )
            )
        if r.device_advance is not None:
            out.append(
                Call(
                    "device_advance",
                    r.name,
                    r.device_advance,
                    ("the device mirror", "the decode step"),
                )
            )
        if r.device_fill is not None:
            out.append(
                Call(
                    "device_fill",
                    r.name,
                    r.device_fill,
                    ("the device mirror at the bucket", "the step's device rows", "its pad"),
                    r.reads,
                    "reads",
                )
            )
    return out


def _shown(sig: inspect.Signature) -> str:
    """The parameters' names as a def writes them (no annotations or defaults)."""
    parts: list[str] = []
    params = list(sig.parameters.values())
    star = False
    for i, p in enumerate(params):
        if p.kind == p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind == p.KEYWORD_ONLY and not star:
            parts += ["*", p.name]
            star = True
        else:
            parts.append(f"**{p.name}" if p.kind == p.VAR_KEYWORD else p.name)
        following = params[i + 1].kind if i + 1 < len(params) else None
        if p.kind == p.POSITIONAL_ONLY and following != p.POSITIONAL_ONLY:
            parts.append("/")
    return f"({', '.join(parts)})"


def signature_problems(call: Call, fn: Any) -> list[str]:
    """What differs between `call` and the signature of `fn` (none where it cannot be read,
    as for a function written in C)."""
    try:
        sig = inspect.signature(fn)
    except Exception:  # noqa: BLE001 - unreadable (a C function, a __signature__ that raises)
        return []
    head = f"{call.what} names {call.impl.text}{_shown(sig)}"
    if call.role == "state":
        try:
            sig.bind()
        except TypeError:
            return [
                f"{head}, which cannot be made without arguments, as the family's State makes "
                "it; give its parameters defaults"
            ]
        return []
    problems = _strict_problems(call, sig, head)
    if problems and not call.impl.module.startswith("bufc."):
        # a project's function need only accept the call (defaults, **kwargs, reads that are
        # not keyword-only); bufc's own keep the exact contract
        try:
            sig.bind(*call.positional, **dict.fromkeys(call.reads))
        except TypeError:
            return problems
        return []
    return problems


def _strict_problems(call: Call, sig: inspect.Signature, head: str) -> list[str]:
    """The exact contract: the positional parameters the step passes, then exactly the
    declaration's reads, keyword-only."""
    params = list(sig.parameters.values())
    lead = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    problems = []
    n, want = len(lead), len(call.positional)
    if n != want:
        problems.append(
            f"{head}, which takes {n} positional parameter{'' if n == 1 else 's'}, but the step "
            "passes "
            f"{want} ({', '.join(call.positional)}); give it {want} before '*', or change the "
            "declaration"
        )
    for name in call.reads:
        if name not in keywords:
            problems.append(
                f"{head}, which takes no keyword parameter {name}, but its declaration's "
                f"{call.reads_key} pass it ({name}=c.{name}); add it after '*', or drop it "
                f"from {call.reads_key}"
            )
    for name in keywords:
        if name not in call.reads:
            problems.append(
                f"{head}, whose keyword parameter {name} its declaration's {call.reads_key} "
                f"do not pass; add {name} to {call.reads_key}, or remove the parameter"
            )
    return problems


def problems(
    found: Sequence[Call], resolve: Callable[[str, str, str], Any] = impls.resolve
) -> list[Diagnostic]:
    """Each call's implementation resolved (`resolve`: module, name, kind -> the object, or
    impls.Unresolved) and its signature checked: every problem, located at the declaration's
    import path."""
    out = []
    for call in found:
        impl = call.impl
        try:
            fn = resolve(impl.module, impl.name, call.kind)
        except impls.Unresolved as exc:
            out.append(Diagnostic(impl.loc, f"{call.what} names {impl.text}, but {exc}"))
            continue
        out += [Diagnostic(impl.loc, p) for p in signature_problems(call, fn)]
    return out


def import_problems(found: Sequence[Call]) -> list[Diagnostic]:
    """`problems`, importing each module as the project's code does: from the installed
    packages and the current directory (as ``python -m`` would; the ``bufc`` script's own
    folder is first on its path instead)."""
    if not found:
        return []
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # modules written since the last import are seen
    try:
        return problems(found)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
