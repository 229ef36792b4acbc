"""load -> schema -> model -> validate -> plan, as one call: the spec and every family's plan,
each family lowered once and shared by validation, emit and report."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from importlib import resources

from . import contract, load, schema
from .errors import SpecError
from .model import Spec, build_spec
from .plan import FamilyPlan, lower_family
from .validate import check_plans, check_spec

BUILTIN_RULES = "rules/builtin.yaml"  # as diagnostics name it


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A checked spec (bufc's built-in rules and request checks first, then the spec's own)
    and the plan of each of its families, in the spec's order."""

    spec: Spec
    plans: tuple[FamilyPlan, ...]

    def plan(self, family: str) -> FamilyPlan:
        return next(p for p in self.plans if p.family.name == family)


@lru_cache(maxsize=1)
def builtin_contracts() -> Spec:
    """bufc's own rules and request checks (rules/builtin.yaml, shipped with the package)."""
    text = resources.files("bufc.rules").joinpath("builtin.yaml").read_text("utf-8")
    doc = load.load_text(text, BUILTIN_RULES)
    problems = schema.check_document(doc, rules_only=True)
    if problems:
        raise SpecError(problems)
    return build_spec(doc)  # a spec with rules and request checks alone


def own_calls(spec: Spec) -> list[contract.Call]:
    """The implementations the spec's own rules and request checks name (not bufc's, which
    come first), as the generated step calls them."""
    builtin = builtin_contracts()
    return contract.calls(
        spec.rules[len(builtin.rules) :],
        spec.request_checks[len(builtin.request_checks) :],
        known=spec.request_checks,
    )


def compile_text(text: str, file: str = "buffers.yaml", *, imports: bool = False) -> Compiled:
    """Parse, check and lower a spec; raise SpecError listing every problem. With `imports`,
    also import each implementation the spec's own rules and request checks name (its code
    runs) and check its signature against the declaration (``contract``)."""
    doc = load.load_text(text, file)
    problems = schema.check_document(doc)
    if problems:
        raise SpecError(problems)
    spec = build_spec(doc, builtin_contracts())
    check_spec(spec)
    plans = tuple(lower_family(spec, family) for family in spec.families)
    check_plans(spec, plans)
    if imports:
        problems = contract.import_problems(own_calls(spec))
        if problems:
            raise SpecError(problems)
    return Compiled(spec, plans)


def compile_file(path: str, display_name: str | None = None, *, imports: bool = False) -> Compiled:
    file = display_name or path
    return compile_text(load.read(path, file), file, imports=imports)
