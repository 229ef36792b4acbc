"""load -> schema -> model -> validate -> plan, as one call: the spec and every family's plan,
each family lowered once and shared by validation, emit and report."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path

from . import contract, extend, load, schema
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
    plans: tuple[FamilyPlan, ...]  # the generated families' (the file's own, when it extends)

    def plan(self, family: str) -> FamilyPlan:
        return next(p for p in self.plans if p.family.name == family)

    @property
    def family_names(self) -> tuple[str, ...]:
        return tuple(p.family.name for p in self.plans)


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


def builtin_text() -> str:
    """bufc's built-in spec: ``bufc/spec/buffers.yaml`` in an installed package (the
    repository's buffers.yaml, package data), or that file itself in a source tree (an
    editable install maps ``bufc`` to the repository's ``bufc/`` folder)."""
    installed = resources.files("bufc").joinpath("spec", "buffers.yaml")
    if installed.is_file():
        return installed.read_text("utf-8")
    source = Path(str(resources.files("bufc"))).parent / "buffers.yaml"
    return source.read_text("utf-8")


@lru_cache(maxsize=1)
def builtin_spec() -> Spec:
    """The model of bufc's built-in spec, what `extends: bufc` starts from (checked by its
    own tests; its diagnostics name extend.BUILTIN_FILE)."""
    doc = load.load_text(builtin_text(), extend.BUILTIN_FILE)
    problems = schema.check_document(doc)
    if problems:
        raise SpecError(problems)
    return build_spec(doc, builtin_contracts())


class UnknownFamilies(Exception):
    """Families asked for that the spec does not have (`known`: those it has)."""

    def __init__(self, names: list[str], known: tuple[str, ...]) -> None:
        super().__init__(", ".join(names))
        self.names, self.known = names, known


def compile_text(
    text: str,
    file: str = "buffers.yaml",
    *,
    imports: bool = False,
    families: Sequence[str] | None = None,
) -> Compiled:
    """Parse, check and lower a spec; raise SpecError listing every problem. A spec that says
    `extends: bufc` is merged onto bufc's built-in spec first (``extend``), and only its own
    families are lowered. With `imports`, also import each implementation the spec's own
    rules and request checks name (its code runs) and check its signature against the
    declaration (``contract``). `families` picks the families lowered (any of the spec's,
    an extended spec's included; UnknownFamilies for others), in the spec's order."""
    doc = load.load_text(text, file)
    problems = schema.check_document(doc)
    if problems:
        raise SpecError(problems)
    if "extends" in doc.data:
        spec = extend.merge(builtin_spec(), build_spec(doc))
    else:
        spec = extend.resolve(build_spec(doc, builtin_contracts()))
    check_spec(spec)
    if families is not None:
        missing = [n for n in families if n not in {f.name for f in spec.families}]
        if missing:
            raise UnknownFamilies(missing, tuple(f.name for f in spec.generated))
    # every generated family is lowered and checked whatever is picked (a pick writes fewer
    # files; it does not make the spec valid), and a picked family of the extended spec too
    plans = {f.name: lower_family(spec, f) for f in spec.generated}
    for f in spec.families:
        if families is not None and f.name in families and f.name not in plans:
            plans[f.name] = lower_family(spec, f)
    check_plans(spec, tuple(plans.values()))
    chosen = [f.name for f in spec.families if families is None or f.name in families]
    if imports:
        problems = contract.import_problems(own_calls(spec))
        if problems:
            raise SpecError(problems)
    return Compiled(spec, tuple(plans[n] for n in chosen if n in plans))


def compile_file(
    path: str,
    display_name: str | None = None,
    *,
    imports: bool = False,
    families: Sequence[str] | None = None,
) -> Compiled:
    file = display_name or path
    return compile_text(load.read(path, file), file, imports=imports, families=families)


@lru_cache(maxsize=1)
def compile_builtin() -> Compiled:
    """bufc's built-in spec, compiled: what a command reads when no project spec has the
    family it is asked for."""
    return compile_text(builtin_text(), extend.BUILTIN_FILE)
