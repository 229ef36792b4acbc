"""A spec that extends bufc's built-in spec: ``extends: bufc`` at its top.

A downstream project declares only what it adds (flags, parameters, derived values, checks,
rules, request checks, tensors) and its own families, each of which may start from a family
of the built-in spec (``extends: llama_flash`` under the family: that family's flags and
additional outputs, its own flags on top). The built-in spec ships with bufc
(``bufc/spec/buffers.yaml``, package data), so a project needs no copy of it.

The two are merged as models, not as text: every declaration keeps the location of the file
it comes from, so a diagnostic names ``bufc/buffers.yaml:LINE:COL`` or the project's file. The
built-in declarations come first (bufc's names are taken: a project's name that repeats one
is the usual "already declared" error, naming where). Only the project's own families are
generated (``Spec.own``): the built-in ones are there to be extended.

As with ``#include`` of an MLIR ``.td`` file or torchgen's ``native_functions.yaml``, the
language is one: an extending spec is an ordinary spec, validated by the same schema and
passes, with two keys more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .errors import Collector, did_you_mean
from .model import Family, Requests, Spec

EXTENDABLE = ("bufc",)  # what `extends:` may name: bufc's built-in spec
BUILTIN_FILE = "bufc/buffers.yaml"  # how diagnostics name the built-in spec


def resolve(spec: Spec) -> Spec:
    """A spec of its own (no `extends:`) with each family that extends an earlier one of the
    same file resolved."""
    return dataclasses.replace(spec, families=_families(spec.families, (), spec.file))


def merge(base: Spec, own: Spec) -> Spec:
    """`own` (a spec with `extends:`) on top of `base` (the spec it extends, with bufc's rules
    and request checks): base's declarations, then own's; own's families resolved against
    base's (and own's earlier ones). SpecError (located) for a family that extends one neither
    has."""
    families = _families(own.families, base.families, BUILTIN_FILE)
    requests = Requests(
        own.requests.encoder_only or base.requests.encoder_only,
        base.requests.checks + own.requests.checks,
    )
    return dataclasses.replace(
        own,
        flags=base.flags + own.flags,
        parameters=base.parameters + own.parameters,
        derived=base.derived + own.derived,
        checks=base.checks + own.checks,
        sizes=base.sizes + own.sizes,
        families=base.families + families,
        tensors=base.tensors + own.tensors,
        index_sets=base.index_sets + own.index_sets,
        rules=base.rules + own.rules,
        request_checks=base.request_checks + own.request_checks,
        requests=requests,
        scalars=base.scalars + own.scalars,
        own=tuple(f.name for f in own.families),
    )


def _families(own: Sequence[Family], base: Sequence[Family], where: str) -> tuple[Family, ...]:
    """`own` families, each that extends one of `base` or an earlier one of `own` resolved;
    SpecError naming each that extends neither."""
    errors = Collector()
    known = {f.name: f for f in base}
    out = []
    for family in own:
        if family.name in known:
            errors.error(
                family.loc,
                f"family '{family.name}' is already declared at "
                f"{known[family.name].loc.line_from(family.loc)}; give yours another name "
                f"(with 'extends: {family.name}' it starts from that one)",
            )
            continue
        resolved = _resolved(family, known, where, errors)
        known[family.name] = resolved
        out.append(resolved)
    errors.raise_if_any()
    return tuple(out)


def _resolved(family: Family, known: dict[str, Family], where: str, errors: Collector) -> Family:
    """`family` with the flags and additional outputs of the family it extends (its own flags
    override them); as it is when it extends none."""
    if family.extends is None:
        return family
    parent = known.get(family.extends)
    assert family.extends_loc is not None
    if parent is None or parent is family:
        errors.error(
            family.extends_loc,
            f"family '{family.name}' extends '{family.extends}', which is not a family of "
            f"{where} or an earlier one of this file{did_you_mean(family.extends, known)}; "
            "name one of them",
        )
        return family
    own_flags = dict(family.flags)
    return dataclasses.replace(
        family,
        flags=tuple({**dict(parent.flags), **own_flags}.items()),
        flag_locs=tuple((f, loc) for f, loc in parent.flag_locs if f not in own_flags)
        + family.flag_locs,
        additional_outputs=parent.additional_outputs + family.additional_outputs,
    )


def unknown_family(name: str, spec_file: str, own: Sequence[str], builtin: Sequence[str]) -> str:
    """The message for a family found in neither the project's spec nor bufc's, listing both
    (once, where the project's spec is bufc's)."""
    mine = f"{spec_file} defines {', '.join(own)}" if own else f"{spec_file} defines none"
    theirs = (
        "" if tuple(own) == tuple(builtin) else f", and bufc's built-in spec {', '.join(builtin)}"
    )
    return f"unknown family '{name}'{did_you_mean(name, [*own, *builtin])}; {mine}{theirs}"
