"""The typed step record of a family (its generated ``StepInputs``): one attribute per engine
input the step binds and one per step scalar, each with its doc, so that an engine gets
completion and ``mypy`` checks what it reads. The record still reads by engine name."""

from __future__ import annotations

import keyword
import re
import textwrap
from typing import Any

from . import emit_lines as L
from .plan import FamilyPlan, PlannedTensor

# the names the record's own API takes (bufc.runtime.step.StepInputs: the Mapping methods, the
# step mode, the family): an input named so is read by engine name only, a scalar so named in
# step.scalars (tests/test_step_inputs.py compares the two)
RESERVED = frozenset(("get", "items", "keys", "values", "mode", "FAMILY"))


# where a host tensor's doc says it is staged on the host: not what its device copy is
_ON_HOST = re.compile(r",? (?:staged )?on the host(?=[.;:)]|$)")


def source(plan: FamilyPlan, t: PlannedTensor) -> PlannedTensor:
    """The host tensor a device mirror copies (its rule and pad), or the tensor itself."""
    if t.fill_kind == "mirror" and t.fill_target is not None:
        return next((x for x in plan.tensors if x.name == t.fill_target), t)
    return t


def meaning(plan: FamilyPlan, t: PlannedTensor, quote: str = "`") -> str:
    """What the tensor holds: its doc, or for a device mirror its host tensor's (the contract
    page's and the typed record's words)."""
    host = source(plan, t)
    if host is t:
        return t.doc
    return f"Device copy of {quote}{host.name}{quote}: {_ON_HOST.sub('', host.doc)}"


def _docstring(text: str) -> list[str]:
    """A property's docstring lines (at 8 spaces, at most 100 columns), safe to embed."""
    lines = textwrap.wrap(L.comment(text), width=86, break_long_words=False)
    if len(lines) == 1:
        return [f'"""{lines[0]}"""']
    return [f'"""{lines[0]}', *lines[1:], '"""']


# names the class body reads itself (the decorator, the attributes' annotations): an input or
# scalar named so is read by name only, so that it shadows none of them
CLASS_BODY = frozenset(("property", "int", "tuple", "torch"))


def step_fields(plan: FamilyPlan) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The record's attributes (name, type, docstring lines, and what it reads); the engine
    names left to reading by name (not identifiers, or taken by the record's own API or its
    class body); and the step scalars left to ``step.scalars`` (those, or an input's name)."""
    fields: list[dict[str, Any]] = []
    by_key: list[str] = []
    scalars_only: list[str] = []
    seen: set[str] = set()

    def attribute(attr: str) -> bool:
        named = attr.isidentifier() and not keyword.iskeyword(attr) and not attr.startswith("_")
        return named and attr not in RESERVED and attr not in CLASS_BODY

    def add(attr: str, kind: str, getter: str, key: str, doc: str) -> None:
        if getter == "_scalar" and (attr in seen or not attribute(attr)):
            scalars_only.append(attr)  # (an input of that name takes the attribute)
            return
        if attr in seen:  # bound by several tensors under exclusive conditions: the first doc
            return
        seen.add(attr)
        if not attribute(attr):
            by_key.append(L.comment(key))
            return
        fields.append(
            {"name": attr, "type": kind, "getter": getter, "key": key, "doc": _docstring(doc)}
        )

    for pt in plan.tensors:
        for b in pt.bindings:
            if b.direction != "input":
                continue
            doc = meaning(plan, pt, quote="")
            if b.each:  # one view per member: a tuple, named by the tensor
                doc += (
                    f" One view per member of {', '.join(b.each)}, in order (engine names "
                    f"{b.engine_name})."
                )
                add(pt.name, "tuple[torch.Tensor, ...]", "_inputs", pt.name, doc)
            else:
                add(b.engine_name, "torch.Tensor", "_input", b.engine_name, doc)
    assert plan.program is not None
    for x in plan.program.scalars:
        add(x.name, "int", "_scalar", x.name, f"Step scalar: {x.doc}")
    return fields, by_key, scalars_only
