"""The typed spec model: frozen dataclasses built from a schema-valid document.

Building parses every formula into IR (``expr``); cross-entry rules (unknown names, binding
times, cycles, engine-name ownership, capacity proofs) are checked afterwards in ``validate``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from . import expr as E
from .errors import Collector, Location
from .expr_parse import ExprError, parse
from .load import Document, Path

FillKind = Literal["rule", "mirror", "constant", "engine", "external", "static"]
Direction = Literal["input", "output"]


@dataclasses.dataclass(frozen=True)
class Formula:
    """A parsed formula with its source text and position (for messages only)."""

    text: str
    expr: E.Expr
    loc: Location

    def at(self, col: int) -> Location:
        return self.loc.shifted(col)

    @property
    def shown(self) -> str:
        """The text for a message: a long formula is cut (its location names it)."""
        return self.text if len(self.text) <= 80 else self.text[:77] + "..."


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str
    doc: str
    values: tuple[str, ...] | None  # None: a boolean flag
    loc: Location
    default: str | bool | None = None


@dataclasses.dataclass(frozen=True)
class Parameter:
    name: str
    doc: str
    kind: Literal["int", "dtype", "bool", "names", "ints"]
    default: int | str | bool | tuple[str, ...] | tuple[int, ...] | None
    minimum: int | None
    loc: Location
    values: tuple[str, ...] = ()  # the names a names parameter may hold


@dataclasses.dataclass(frozen=True)
class Derived:
    """A construct-time value: a formula over parameters and earlier derived values, or a
    function (`derive`) called with the Config values in `reads`, returning an int or a
    list of ints (`kind`)."""

    name: str
    doc: str
    value: Formula | None
    loc: Location
    derive: Impl | None = None
    reads: tuple[str, ...] = ()
    kind: Literal["int", "ints"] = "int"

    def names_read(self) -> list[str]:
        """The names the value reads: its formula's, or the function's `reads`."""
        if self.value is None:
            return list(self.reads)
        return [n.id for n in E.names(self.value.expr)]


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A step scalar: a host integer computed every step (``max_of(T)`` reads the largest
    element the step wrote into host rule tensor T)."""

    name: str
    doc: str
    value: Formula
    when: Formula | None
    loc: Location
    device: Formula | None = None  # its value in the device build (no max_of), if not `value`


@dataclasses.dataclass(frozen=True)
class Check:
    require: Formula
    message: str
    loc: Location
    when: Formula | None = None  # a flag condition: the families the check applies to


@dataclasses.dataclass(frozen=True)
class IndexSet:
    """Members a binding is repeated over: (position, label) pairs, from the names of a names
    parameter, or numbered labels first .. first + count - 1 kept where `where` holds."""

    name: str
    doc: str
    names: str | None
    first: Formula | None
    count: Formula | None
    where: Formula | None
    loc: Location


@dataclasses.dataclass(frozen=True)
class StepSize:
    name: str
    doc: str
    bound: Formula | None
    loc: Location


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    doc: str
    flags: tuple[tuple[str, str | bool], ...]
    loc: Location
    flag_locs: tuple[tuple[str, Location], ...] = ()
    additional_outputs: tuple[AdditionalOutput, ...] = ()
    # the family of the extended spec this one starts from (its flags and outputs), and where
    # the spec says so; None for a family of its own
    extends: str | None = None
    extends_loc: Location | None = None


@dataclasses.dataclass(frozen=True)
class AdditionalOutput:
    """An extra engine output of a family (the reference's AdditionalModelOutput): one row per
    token, [num_tokens, *dims], written by the engine on the last pipeline rank."""

    name: str
    doc: str
    dtype: str
    dims: tuple[Formula, ...]
    loc: Location
    when: Formula | None = None


@dataclasses.dataclass(frozen=True)
class Fill:
    kind: FillKind
    target: str | None  # rule name / mirror source
    value: Formula | None  # constant
    loc: Location


@dataclasses.dataclass(frozen=True)
class Binding:
    direction: Direction
    engine_name: str  # may hold {SET} placeholders, one per set in `each`
    when: Formula | None
    loc: Location
    each: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    doc: str
    dtype: str | None
    memory: str
    capacity: tuple[Formula, ...] | None
    shape: tuple[Formula, ...] | None
    when: Formula | None
    fill: Fill
    pad: int | str | None  # a constant, or vocab.REPEAT_LAST
    bind: tuple[Binding, ...]
    loc: Location
    field_locs: tuple[tuple[str, Location], ...] = ()
    ring: int | None = None
    capture: Formula | None = None  # written by prepare_for_cuda_graph

    def field_loc(self, key: str) -> Location:
        return dict(self.field_locs).get(key, self.loc)


@dataclasses.dataclass(frozen=True)
class Impl:
    """An implementation named by import path, MODULE:NAME (checked by the schema's pattern;
    printed into generated code only as an import of identifiers)."""

    module: str
    name: str
    loc: Location

    @property
    def text(self) -> str:
        return f"{self.module}:{self.name}"


@dataclasses.dataclass(frozen=True)
class RequestCheck:
    """A request check fill rules rely on: impl(batch, [state], **reads), before any write."""

    name: str
    doc: str
    impl: Impl
    reads: tuple[str, ...]
    sizes: tuple[str, ...]
    state: Impl | None
    result: bool
    loc: Location
    admit: Arrival | None = None  # its check of a request arriving in flight


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A request check's form for a request arriving in flight: impl(entry, **reads)."""

    impl: Impl
    reads: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class AdvanceCheck:
    impl: Impl
    reads: tuple[str, ...]
    result: bool = False


@dataclasses.dataclass(frozen=True)
class Rule:
    """One fill rule's whole contract, declared once (rules/builtin.yaml or a spec's `rules`)."""

    name: str
    doc: str
    impl: Impl
    dtypes: tuple[str, ...]
    shape: tuple[Formula, ...]
    reads: tuple[str, ...]
    sizes: tuple[str, ...]
    check: str | None
    device: bool
    advance: Impl | Literal["same"] | None
    advance_reads: tuple[str, ...]
    advance_check: AdvanceCheck | None
    sampled_tokens: bool
    device_advance: Impl | None
    loc: Location
    field_locs: tuple[tuple[str, Location], ...] = ()
    pads: tuple[str, ...] = ()  # what its tensors' padded rows may hold (vocab.PAD_KINDS)
    device_fill: Impl | None = None  # the device build's form (on the step's device rows)

    def field_loc(self, key: str) -> Location:
        return dict(self.field_locs).get(key, self.loc)

    @property
    def all_reads(self) -> tuple[str, ...]:
        """Every Config value the rule's fill and advance forms read."""
        extra = self.advance_check.reads if self.advance_check else ()
        return tuple(dict.fromkeys((*self.reads, *self.advance_reads, *extra)))


@dataclasses.dataclass(frozen=True)
class Requests:
    """How the batch builder reads requests, and the request checks families run beside those
    their rules name: flag conditions (None: never)."""

    encoder_only: Formula | None = None
    checks: tuple[tuple[str, Formula], ...] = ()


@dataclasses.dataclass(frozen=True)
class Spec:
    file: str
    version: int
    flags: tuple[Flag, ...]
    parameters: tuple[Parameter, ...]
    derived: tuple[Derived, ...]
    checks: tuple[Check, ...]
    sizes: tuple[StepSize, ...]
    families: tuple[Family, ...]
    tensors: tuple[Tensor, ...]
    index_sets: tuple[IndexSet, ...] = ()
    rules: tuple[Rule, ...] = ()
    request_checks: tuple[RequestCheck, ...] = ()
    requests: Requests = Requests()
    scalars: tuple[Scalar, ...] = ()
    # the spec this one extends (`extends: bufc`: bufc's built-in spec), and where it says so
    extends: str | None = None
    extends_loc: Location | None = None
    # the families this spec's file defines, the ones generated (None: every family)
    own: tuple[str, ...] | None = None

    @property
    def generated(self) -> tuple[Family, ...]:
        """The families generated from this spec: those its own file defines."""
        return tuple(f for f in self.families if self.own is None or f.name in self.own)

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def rule(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)

    def request_check(self, name: str) -> RequestCheck | None:
        return next((c for c in self.request_checks if c.name == name), None)


class _Builder:
    def __init__(self, doc: Document) -> None:
        self.doc = doc
        self.errors = Collector()

    def formula(self, value: Any, path: Path) -> Formula:
        loc = self.doc.loc(path)
        text = str(value) if type(value) is int else value
        try:
            parsed = parse(text)
        except ExprError as exc:
            self.errors.error(loc.shifted(exc.col), exc.message)
            parsed = E.Int(0)
        return Formula(text, parsed, loc)

    def opt_formula(self, raw: dict[str, Any], key: str, path: Path) -> Formula | None:
        return self.formula(raw[key], (*path, key)) if key in raw else None

    def build(self) -> Spec:
        d = self.doc.data
        kl = self.doc.key_loc
        flags = self.flags()
        params = tuple(
            Parameter(
                n,
                r["doc"],
                r.get("type", "int"),
                tuple(r["default"]) if isinstance(r.get("default"), list) else r.get("default"),
                r.get("min"),
                kl(("parameters", n)),
                tuple(r.get("values", ())),
            )
            for n, r in d.get("parameters", {}).items()
        )
        derived = tuple(
            Derived(
                n,
                r["doc"],
                self.formula(r["value"], ("derived", n, "value")) if "value" in r else None,
                kl(("derived", n)),
                self.impl(r["derive"], ("derived", n, "derive")) if "derive" in r else None,
                tuple(r.get("reads", ())),
                r.get("type", "int"),
            )
            for n, r in d.get("derived", {}).items()
        )
        checks = tuple(
            Check(
                self.formula(r["require"], ("checks", i, "require")),
                r["message"],
                self.doc.loc(("checks", i)),
                self.opt_formula(r, "when", ("checks", i)),
            )
            for i, r in enumerate(d.get("checks", []))
        )
        sizes = tuple(
            StepSize(n, r["doc"], self.opt_formula(r, "max", ("sizes", n)), kl(("sizes", n)))
            for n, r in d.get("sizes", {}).items()
        )
        families = self.families()
        index_sets = tuple(
            IndexSet(
                n,
                r["doc"],
                r.get("names"),
                self.opt_formula(r, "first", ("index_sets", n)),
                self.opt_formula(r, "count", ("index_sets", n)),
                self.opt_formula(r, "where", ("index_sets", n)),
                kl(("index_sets", n)),
            )
            for n, r in d.get("index_sets", {}).items()
        )
        tensors = tuple(self.tensor(r, ("tensors", i)) for i, r in enumerate(d.get("tensors", [])))
        scalars = tuple(
            Scalar(
                n,
                r["doc"],
                self.formula(r["value"], ("scalars", n, "value")),
                self.opt_formula(r, "when", ("scalars", n)),
                kl(("scalars", n)),
                self.opt_formula(r, "device", ("scalars", n)),
            )
            for n, r in d.get("scalars", {}).items()
        )
        rules, request_checks = self.contracts()
        req = d.get("requests", {})
        requests = Requests(
            self.opt_formula(req, "encoder_only", ("requests",)),
            tuple(
                (n, self.formula(v, ("requests", "checks", n)))
                for n, v in req.get("checks", {}).items()
            ),
        )
        self.errors.raise_if_any()
        return Spec(
            self.doc.file,
            d["version"],
            flags,
            params,
            derived,
            checks,
            sizes,
            families,
            tensors,
            index_sets,
            rules,
            request_checks,
            requests,
            scalars,
            d.get("extends"),
            kl(("extends",)) if "extends" in d else None,
        )

    def flags(self) -> tuple[Flag, ...]:
        """The spec's flags; one with both or neither of `values` and `type` is an error."""
        d, kl = self.doc.data, self.doc.key_loc
        flags = tuple(
            Flag(
                n,
                r["doc"],
                tuple(r["values"]) if "values" in r else None,
                kl(("flags", n)),
                r.get("default"),
            )
            for n, r in d.get("flags", {}).items()
        )
        for n, r in d.get("flags", {}).items():
            if ("values" in r) == ("type" in r):
                self.errors.error(
                    kl(("flags", n)),
                    f"flag '{n}' needs exactly one of 'values' (an enum flag) or 'type: bool'",
                )
        return flags

    def families(self) -> tuple[Family, ...]:
        """The spec's families, with their flags' locations and additional outputs."""
        d, kl = self.doc.data, self.doc.key_loc
        return tuple(
            Family(
                n,
                r["doc"],
                tuple(r.get("flags", {}).items()),
                kl(("families", n)),
                tuple((f, kl(("families", n, "flags", f))) for f in r.get("flags", {})),
                tuple(
                    AdditionalOutput(
                        o,
                        v["doc"],
                        v["dtype"],
                        tuple(
                            self.formula(x, ("families", n, "additional_outputs", o, "dims", j))
                            for j, x in enumerate(v.get("dims", []))
                        ),
                        kl(("families", n, "additional_outputs", o)),
                        self.opt_formula(v, "when", ("families", n, "additional_outputs", o)),
                    )
                    for o, v in r.get("additional_outputs", {}).items()
                ),
                r.get("extends"),
                self.doc.loc(("families", n, "extends")) if "extends" in r else None,
            )
            for n, r in d.get("families", {}).items()
        )

    def impl(self, text: str, path: Path) -> Impl:
        module, name = text.split(":")  # the schema's pattern holds exactly one ':'
        return Impl(module, name, self.doc.loc(path))

    def contracts(self) -> tuple[tuple[Rule, ...], tuple[RequestCheck, ...]]:
        """The rules and request checks this document declares."""
        d, kl = self.doc.data, self.doc.key_loc
        checks = tuple(
            RequestCheck(
                n,
                r["doc"],
                self.impl(r["impl"], ("request_checks", n, "impl")),
                tuple(r.get("reads", ())),
                tuple(r.get("sizes", ())),
                self.impl(r["state"], ("request_checks", n, "state")) if "state" in r else None,
                bool(r.get("result", False)),
                kl(("request_checks", n)),
                Arrival(
                    self.impl(r["admit"]["impl"], ("request_checks", n, "admit", "impl")),
                    tuple(r["admit"].get("reads", ())),
                )
                if "admit" in r
                else None,
            )
            for n, r in d.get("request_checks", {}).items()
        )
        rules = []
        for n, r in d.get("rules", {}).items():
            path = ("rules", n)
            adv = r.get("advance")
            ac = r.get("advance_check")
            rules.append(
                Rule(
                    n,
                    r["doc"],
                    self.impl(r["impl"], (*path, "impl")),
                    tuple(r["dtypes"]),
                    tuple(self.formula(x, (*path, "shape", j)) for j, x in enumerate(r["shape"])),
                    tuple(r.get("reads", ())),
                    tuple(r.get("sizes", ())),
                    r.get("check"),
                    bool(r.get("device", False)),
                    "same"
                    if adv == "same"
                    else None
                    if adv is None
                    else self.impl(adv, (*path, "advance")),
                    tuple(r.get("advance_reads", ())),
                    AdvanceCheck(
                        self.impl(ac["impl"], (*path, "advance_check", "impl")),
                        tuple(ac.get("reads", ())),
                        bool(ac.get("result", False)),
                    )
                    if ac
                    else None,
                    bool(r.get("sampled_tokens", False)),
                    self.impl(r["device_advance"], (*path, "device_advance"))
                    if "device_advance" in r
                    else None,
                    kl(path),
                    tuple((k, kl((*path, k))) for k in r),
                    tuple(r.get("pads", ())),
                    self.impl(r["device_fill"], (*path, "device_fill"))
                    if "device_fill" in r
                    else None,
                )
            )
        return tuple(rules), checks

    def dims(self, raw: dict[str, Any], key: str, path: Path) -> tuple[Formula, ...] | None:
        if key not in raw:
            return None
        return tuple(self.formula(v, (*path, key, j)) for j, v in enumerate(raw[key]))

    def tensor(self, raw: dict[str, Any], path: Path) -> Tensor:
        fill_raw = raw["fill"]
        fill_loc = self.doc.loc((*path, "fill"))
        if fill_raw in ("engine", "external", "static"):
            fill = Fill(fill_raw, None, None, fill_loc)
        elif "rule" in fill_raw:
            fill = Fill("rule", fill_raw["rule"], None, self.doc.loc((*path, "fill", "rule")))
        elif "mirror" in fill_raw:
            fill = Fill("mirror", fill_raw["mirror"], None, self.doc.loc((*path, "fill", "mirror")))
        elif "static" in fill_raw:  # static, holding a construct-time value until set
            value = self.formula(fill_raw["static"], (*path, "fill", "static"))
            fill = Fill("static", None, value, value.loc)
        else:
            value = self.formula(fill_raw["constant"], (*path, "fill", "constant"))
            fill = Fill("constant", None, value, value.loc)
        binds = []
        for j, b in enumerate(raw.get("bind", [])):
            direction: Direction = "input" if "input" in b else "output"
            binds.append(
                Binding(
                    direction,
                    b[direction],
                    self.opt_formula(b, "when", (*path, "bind", j)),
                    self.doc.loc((*path, "bind", j, direction)),
                    tuple(b.get("each", ())),
                )
            )
        return Tensor(
            name=raw["name"],
            doc=raw["doc"],
            dtype=raw.get("dtype"),
            memory=raw["memory"],
            capacity=self.dims(raw, "capacity", path),
            shape=self.dims(raw, "shape", path),
            when=self.opt_formula(raw, "when", path),
            fill=fill,
            pad=raw.get("pad"),
            bind=tuple(binds),
            loc=self.doc.loc((*path, "name")),
            field_locs=tuple((k, self.doc.key_loc((*path, k))) for k in raw),
            ring=raw.get("ring"),
            capture=self.opt_formula(raw, "capture", path),
        )


def build_spec(doc: Document, builtin: Spec | None = None) -> Spec:
    """Turn a schema-valid document into the typed model (parse errors are located). The
    rules and request checks of `builtin` (bufc's own, rules/builtin.yaml) come first."""
    spec = _Builder(doc).build()
    if builtin is None:
        return spec
    return dataclasses.replace(
        spec,
        rules=builtin.rules + spec.rules,
        request_checks=builtin.request_checks + spec.request_checks,
    )
