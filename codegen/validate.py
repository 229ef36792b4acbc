"""The semantic pass: rules JSON Schema cannot express, each with a located message.

Two entry points, in the order the pipeline runs them: ``check_spec`` on the spec itself
(before lowering), ``check_plans`` on what only the lowered families show. The checks
themselves live in one module per concern, all sharing one ``Scope``:

* ``validate_names``: one namespace, binding times, and each formula's names, type, divisors;
* ``validate_rules``: the rules and request checks, and each rule tensor against its rule;
* ``validate_decls``: parameters, flags, derived values (and their cycles), checks, index
  sets, families;
* ``validate_tensors``: each tensor's declaration (bindings, rings, mirrors, dtype, pad,
  capacity);
* ``validate_plans``: engine-name owners, values over the declared ranges, conditions that
  never hold.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import SpecError
from .model import Spec
from .plan import FamilyPlan
from .validate_decls import declarations
from .validate_names import Scope
from .validate_plans import conditions, engine_names, ranges
from .validate_rules import contracts
from .validate_tensors import tensors


def check_spec(spec: Spec) -> None:
    """Raise SpecError with every semantic problem of `spec` itself (before lowering)."""
    scope = Scope(spec)
    scope.symbols()
    contracts(scope)
    # names and contracts first: the formulas and tensors checked next look both up
    scope.errors.raise_if_any()
    declarations(scope)
    tensors(scope)
    scope.errors.raise_if_any()


def check_plans(spec: Spec, plans: Sequence[FamilyPlan]) -> None:
    """Raise SpecError with every problem only the lowered families show (engine-name owners,
    value ranges, conditions that never hold)."""
    scope = Scope(spec)
    engine_names(scope, list(plans))
    ranges(scope, list(plans))
    conditions(scope, list(plans))
    scope.errors.raise_if_any()


__all__ = ["SpecError", "check_plans", "check_spec"]
