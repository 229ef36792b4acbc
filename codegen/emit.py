"""Rendering: a FamilyPlan becomes Python source through one jinja2 template.

All text that reaches the output is computed here from validated data: identifiers (checked
against the schema's ASCII pattern), integers, ``repr`` of strings, table-driven dtype and
memory tokens, and formulas printed from the IR. The template only lays them out. Every render
is parsed with ``ast`` before it is returned.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import shlex
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

import jinja2

from . import emit_lines as L
from . import expr as E
from . import vocab
from .contract import ROLES, describe
from .emit_formulas import capture_source, construct_source, scalar_source, step_source
from .emit_inputs import step_fields
from .model import Check, Derived, Impl, Parameter
from .plan import FamilyPlan, PlannedFill, PlannedIndexSet, PlannedTensor, StepProgram

if TYPE_CHECKING:
    from .pipeline import Compiled

FORMAT_VERSION = 9  # the runtime API the generated modules are written against
MARKER = "@" + "generated"  # split so that grep finds only outputs
# the headers name no path, so the output does not depend on how --spec and --out were spelled;
# `bufc check` prints the exact command
REGENERATE = "# Regenerate with: bufc generate --spec SPEC --out FOLDER (bufc check prints the exact command)"


@functools.lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    text = resources.files("bufc.codegen").joinpath("templates/family.py.j2").read_text("utf-8")
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["pyrepr"] = repr
    return env.from_string(text)


def _scalars_and_captures(program: StepProgram, sizes: set[str]) -> dict[str, Any]:
    """The lines of the generated `_scalars` (one per step scalar) and `_capture` (one per
    tensor with a capture value), each under its construct-time condition."""
    names = {x.name for x in program.scalars}
    return {
        "scalars": [
            {
                "doc": L.wrapped(f"{x.name}: {L.comment(x.doc)}"),
                "lines": L.under(
                    x.guard,
                    _assign(f"scalars[{x.name!r}]", scalar_source(x.value, sizes), x.guard),
                ),
            }
            for x in program.scalars
        ],
        "captures": [
            {
                "doc": L.wrapped(f"{x.tensor}: {L.comment(x.doc)}"),
                "lines": L.guarded(
                    x.guard,
                    "rt.write_all",
                    [f"t.{x.tensor}", capture_source(x.value, sizes, names)],
                ),
            }
            for x in program.captures
        ],
    }


def _assign(target: str, value: str, guard: E.Expr | None) -> list[str]:
    """`target = value`, the value in parentheses on a line of its own past 100 columns."""
    indent = 8 if guard is None else 12
    if indent + len(target) + 3 + len(value) <= 100:
        return [f"{target} = {value}"]
    return [f"{target} = (", f"    {value}", ")"]


def _set_var(name: str) -> str:
    return f"SET_{name.upper()}"


def _index_set(x: PlannedIndexSet) -> dict[str, str]:
    if x.names is not None:
        args = f"names=lambda c: c.{x.names}"
    else:
        assert x.first is not None and x.count is not None
        args = f"first=lambda c: {construct_source(x.first)}, count=lambda c: {construct_source(x.count)}"
        if x.where is not None:
            args += f", where=lambda c, index: {construct_source(x.where)}"
    return {"var": _set_var(x.name), "name": x.name, "doc": L.comment(x.doc), "args": args}


def _tuple(items: list[str]) -> str:
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _file_label(file: str) -> str:
    """The spec's file name as it may appear in a comment or a message of generated code:
    printable ASCII only, anything else (newlines, control and non-ASCII characters) escaped as
    ``ascii()`` does, so a hostile file name can never end a comment line."""
    label = ascii(file)[1:-1]
    return "".join(ch if " " <= ch <= "~" else "?" for ch in label)


def check_message(c: Check, file: str) -> str:
    """What a Config says when its check `c` fails (`file`: the spec's file name); `bufc
    report` says the same. Named by its condition, not its line: moving the spec's lines
    changes nothing."""
    return f"{L.comment(c.message)} ({_file_label(file)}: {L.comment(c.require.text)})"


def _tensor_context(pt: PlannedTensor, sizes: set[str], rules: dict[str, str]) -> dict[str, Any]:
    dtype = f"lambda c: c.{pt.dtype}" if pt.dtype_is_param else f"torch.{vocab.DTYPES[pt.dtype]}"
    if pt.fill_kind == "rule":
        fill = f"rt.Rule({rules[pt.name]})"
    elif pt.fill_kind == "mirror":
        fill = f"rt.Mirror({pt.fill_target!r})"
    elif pt.fill_kind == "constant":
        assert pt.constant is not None
        fill = f"rt.Constant(lambda c: {construct_source(pt.constant)})"
    elif pt.fill_kind == "static" and pt.constant is not None:
        fill = f"rt.Static(lambda c: {construct_source(pt.constant)})"
    else:
        fill = {"engine": "rt.ENGINE", "external": "rt.EXTERNAL", "static": "rt.STATIC"}[
            pt.fill_kind
        ]
    shape = _tuple([step_source(e, sizes) for e in pt.shape])
    binds = []
    for b in pt.bindings:
        args = [repr(b.engine_name)]
        if b.when is not None:
            args.append(f"when=lambda c: {construct_source(b.when)}")
        if b.each:
            args.append(f"each={_tuple([_set_var(n) for n in b.each])}")
        binds.append((b.direction, f"rt.Bind({', '.join(args)})"))
    return {
        "name": pt.name,
        "doc": L.comment(pt.doc),
        "dtype": dtype,
        "memory": f"rt.{vocab.MEMORY_KINDS[pt.memory]}",
        "capacity": f"lambda c: {_tuple([construct_source(e) for e in pt.capacity])}",
        "shape": f"lambda c, s: {shape}",
        "fill": fill,
        "pad": "rt.REPEAT_LAST" if pt.pad == vocab.REPEAT_LAST else pt.pad,
        "when": f"lambda c: {construct_source(pt.when)}" if pt.when is not None else None,
        "inputs": [b for d, b in binds if d == "input"],
        "outputs": [b for d, b in binds if d == "output"],
        "checked": pt.checked,
        "ring": pt.ring,
    }


def _parameter(p: Parameter, dtype_values: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    doc = L.comment(p.doc)
    if p.kind == "dtype":
        default = f"torch.{vocab.DTYPES[str(p.default)]}" if p.default is not None else None
        allowed = tuple(d for d in dtype_values.get(p.name, ()) if d in vocab.DTYPES)
        return {
            "name": p.name,
            "type": "torch.dtype",
            "default": default,
            "doc": doc,
            "check": f"rt.check_dtype(self, {p.name!r}, {allowed!r}, errors)",
        }
    if p.kind == "bool":
        default = repr(bool(p.default)) if p.default is not None else None
        return {
            "name": p.name,
            "type": "bool",
            "default": default,
            "doc": doc,
            "check": f"rt.check_bool(self, {p.name!r}, errors)",
        }
    if p.kind == "names":
        default = repr(tuple(str(v) for v in p.default)) if isinstance(p.default, tuple) else None
        return {
            "name": p.name,
            "type": "tuple[str, ...]",
            "default": default,
            "doc": doc,
            "check": f"rt.check_names(self, {p.name!r}, {tuple(str(v) for v in p.values)!r}, errors)",
        }
    minimum = int(p.minimum) if p.minimum is not None else 0
    if p.kind == "ints":
        default = repr(tuple(int(v) for v in p.default)) if isinstance(p.default, tuple) else None
        return {
            "name": p.name,
            "type": "tuple[int, ...]",
            "default": default,
            "doc": doc,
            "check": f"rt.check_ints(self, {p.name!r}, minimum={minimum}, errors=errors)",
        }
    default = str(int(p.default)) if p.default is not None else None  # type: ignore[arg-type]
    return {
        "name": p.name,
        "type": "int",
        "default": default,
        "doc": doc,
        "check": f"rt.check_int(self, {p.name!r}, minimum={minimum}, errors=errors)",
    }


def _derived(d: Derived, alias: _Aliases) -> dict[str, str]:
    """A derived value of the Config: its field type and the expression that computes it (a
    formula, or its function's call with the values it reads, the result's type checked)."""
    if d.value is not None:
        value = E.to_source(
            d.value.expr,
            name=lambda n: f"self.{n}",
            call=lambda f: f"rt.{f}" if f == "cdiv" else f,
        )
        return {"name": d.name, "doc": L.comment(d.doc), "type": "int", "value": value}
    assert d.derive is not None
    call = L.call(alias(d.derive), [f"{n}=self.{n}" for n in d.reads])
    return {
        "name": d.name,
        "doc": L.comment(d.doc),
        "type": "int" if d.kind == "int" else "tuple[int, ...]",
        "value": f"rt.derived(self, {d.name!r}, {call}, {d.kind!r})",
    }


class _Aliases:
    """The name each implementation module is imported as: its last component where that is
    free, else its whole path joined with underscores, with `_` appended until free.

    Not free: every name the generated module binds or reads (``vocab.GENERATED_NAMES``: its
    imports, classes, methods, their parameters and locals, the builtins it calls), the spec's
    own names it binds (`fields`: the check and tensor names that are fields of State, Checked
    and Advancing; the SET_* index sets), and the aliases given before. bufc's own rule modules
    (``bufc.rules.core``, ...) come first and take the names reserved for them."""

    def __init__(self, impls: list[Impl], fields: set[str]) -> None:
        self.alias: dict[str, str] = {}
        taken = set(vocab.GENERATED_NAMES) | fields

        def free(name: str) -> bool:
            return name not in taken and not name.startswith("SET_")

        modules = list(dict.fromkeys(i.module for i in impls))
        for module in sorted(modules, key=lambda m: not _own_rule_module(m)):  # stable
            name = module.rsplit(".", 1)[-1]
            if not (_own_rule_module(module) or free(name)):
                name = module.replace(".", "_")
                if name.startswith("SET_"):
                    name = "_" + name
                while not free(name):
                    name += "_"
            self.alias[module] = name
            taken.add(name)

    def __call__(self, impl: Impl) -> str:
        return f"{self.alias[impl.module]}.{impl.name}"

    def imports(self) -> list[str]:
        """The import lines of bufc's own rule modules."""
        lines = []
        for module, name in sorted(self.alias.items()):
            if not _own_rule_module(module):
                continue
            package, _, last = module.rpartition(".")
            if last == name and package:
                lines.append(f"from {package} import {last}")
            elif last == name:
                lines.append(f"import {module}")
            else:
                lines.append(f"import {module} as {name}")
        return lines


def _own_rule_module(module: str) -> bool:
    package, _, last = module.rpartition(".")
    return package == "bufc.rules" and last in vocab.RULE_MODULES


def _roles(program: StepProgram, derived: Sequence[Derived]) -> list[tuple[str, str, Impl]]:
    """(role, the rule, check or derived value, implementation) of every implementation the
    family's module names (roles as ``contract.ROLES``)."""
    out: list[tuple[str, str, Impl]] = [("derive", d.name, d.derive) for d in derived if d.derive]
    for chk in program.checks:
        out.append(("check", chk.name, chk.impl))
        if chk.state is not None:
            out.append(("state", chk.name, chk.state))
        if chk.admit is not None:
            out.append(("admit", chk.name, chk.admit.impl))
    for f in program.fills:
        out.append(("fill", f.rule, f.impl))
        if isinstance(f.advance, Impl):
            out.append(("advance", f.rule, f.advance))
        if f.advance_check is not None:
            out.append(("advance_check", f.rule, f.advance_check))
        if f.device_advance is not None:
            out.append(("device_advance", f.rule, f.device_advance))
        if f.device_fill is not None:
            out.append(("device_fill", f.rule, f.device_fill))
    return out


def _impls(plan: FamilyPlan) -> list[Impl]:
    assert plan.program is not None
    return [impl for _, _, impl in _roles(plan.program, plan.derived)]


def _project(plan: FamilyPlan, alias: _Aliases, file: str) -> tuple[list[str], list[str]]:
    """The spec's own implementation modules (not bufc's): the lines importing each through
    ``rt.rule_module``, each name it must have with the spec's line that names it (the first
    one); and the entries of ``project_impls``, each implementation the step calls, so that an
    exception it raises names it."""
    assert plan.program is not None
    roles = [
        (r, o, i)
        for r, o, i in _roles(plan.program, plan.derived)
        if not _own_rule_module(i.module)
    ]
    names: dict[str, dict[str, str]] = {}
    for role, owner, impl in sorted(roles, key=lambda x: x[2].loc):
        kind = "class" if role == "state" else "function"
        where = f"{file}:{impl.loc.line}:{impl.loc.col}: {describe(role, owner)}"
        names.setdefault(impl.module, {}).setdefault(
            impl.name, L.call("", [repr(impl.name), repr(kind), repr(where)])
        )
    imports = []
    for module in sorted(names):
        entries = [*names[module].values()]
        one = f"{alias.alias[module]} = rt.rule_module({module!r}, {', '.join(entries)})"
        if len(one) <= 100:
            imports.append(one)
        else:
            imports += [
                f"{alias.alias[module]} = rt.rule_module(",
                f"    {module!r},",
                *(f"    {e}," for e in entries),
                ")",
            ]
    entries = []
    for role, owner, impl in dict.fromkeys((r, o, i) for r, o, i in roles if r != "state"):
        args = [repr(ROLES[role][0]), repr(describe(role, owner)), repr(impl.text), alias(impl)]
        lines = L.lines("rt.ProjectImpl", args, 8)
        entries += [*lines[:-1], lines[-1] + ","]
    return imports, entries


def _program(plan: FamilyPlan, alias: _Aliases, sizes: set[str]) -> dict[str, Any]:
    program = plan.program
    assert program is not None
    limits = [f"{k}=c.{v}" for k, v in program.limits] + [
        f"encoder_only={program.encoder_only!r}",
    ]
    bounds = [
        f"{z.name}={construct_source(z.bound.expr)}," for z in plan.sizes if z.bound is not None
    ]
    guards = [
        line
        for pt in plan.tensors
        if pt.checked and pt.fill_kind != "mirror"
        for line in L.guarded(
            pt.when,
            "self.check_shape",
            [repr(pt.name), _tuple([step_source(e, sizes) for e in pt.shape])],
        )
    ]
    checks = []
    results = []
    for chk in program.checks:
        args = ["b", *([f"state.{chk.name}"] if chk.state else []), *L.kwargs(chk.reads)]
        if chk.result:
            results.append(
                {
                    "name": chk.name,
                    "lines": [
                        *(f"# {x}" for x in L.wrapped(L.comment(chk.doc))),
                        *L.value(chk.name, alias(chk.impl), args, chk.guard),
                    ],
                    "guarded": chk.guard is not None,
                }
            )
        else:
            checks.append(
                {
                    "doc": L.wrapped(L.comment(chk.doc)),
                    "lines": L.guarded(chk.guard, alias(chk.impl), args),
                }
            )
    admits = [
        {
            "doc": L.wrapped(L.comment(chk.doc)),
            "lines": L.guarded(chk.guard, alias(chk.admit.impl), ["r", *L.kwargs(chk.admit.reads)]),
        }
        for chk in program.checks
        if chk.admit is not None
    ]
    fills, host_fills = [], []
    bound = {pt.name: pt.bindings for pt in plan.tensors if pt.memory != "device"}
    for f in program.fills:
        args = [
            alias(f.impl),
            f"t.{f.tensor}.out",
            "b",
            *([f"k.{f.check}"] if f.check else []),
            *L.kwargs(f.reads),
        ]
        fills.append({"doc": L.fill_doc(f), "lines": L.write(f, args)})
        if bound.get(f.tensor):  # a host input: the device build writes it on the host too
            host_fills.append({"doc": L.fill_doc(f), "lines": _host_input(f, args, bound)})
    advance = not program.no_advance
    advance_checks: list[str] = []
    advance_results: list[dict[str, Any]] = []
    advances = []
    for f in program.fills if advance else ():
        if f.advance_check is not None:
            L.step_check(
                f,
                alias(f.advance_check),
                "d",
                f.advance_check_state,
                f.advance_check_reads,
                f.advance_check_result,
                advance_checks,
                advance_results,
            )
        advances.append({"doc": L.fill_doc(f), "lines": _advance_lines(f, alias)})
    device = _device_advances(plan, alias) if advance else None
    device_fills = _device_fills(plan, alias)
    return {
        "device_fills": device_fills,
        "device_tensors": tuple(f["tensor"] for f in device_fills or ()),
        "device_scalars": _device_scalars(program, sizes) if device_fills is not None else None,
        "device_advances": device,
        # the device form reads the Config only under a construct-time condition
        "device_reads_config": any(x.startswith("if ") for f in device or () for x in f["lines"]),
        "limits": limits,
        "encoder_sizes": program.encoder_sizes,
        "bounds": bounds,
        "guards": guards,
        "request_checks": checks,
        "admits": admits,
        "results": results,
        "checked_lines": L.construction("Checked", "b", results),
        "fills": fills,
        "host_fills": host_fills,
        "advance": advance,
        "advance_checks": advance_checks,
        "advance_results": advance_results,
        "advancing_lines": L.construction("Advancing", "d", advance_results),
        "advances": advances,
        "sampled_tokens": program.sampled_tokens,
        **_scalars_and_captures(program, sizes),
        "no_advance": program.no_advance,
        "request_readers": program.request_readers,
        "state": [
            {"name": chk.name, "type": alias(chk.state)}
            for chk in program.checks
            if chk.state is not None
        ],
    }


def _device_advances(plan: FamilyPlan, alias: _Aliases) -> list[dict[str, Any]] | None:
    """The device side of the decode step, one entry per device mirror of a rule tensor (None
    without a sampled-tokens mirror: the tokens are read on the host, and the step copies)."""
    program = plan.program
    assert program is not None
    mirrors = {pt.fill_target: pt for pt in plan.tensors if pt.fill_kind == "mirror"}
    if program.sampled_tokens not in mirrors:
        return None
    out = []
    for f in program.fills:
        m = mirrors.get(f.tensor)
        if m is None:
            continue
        doc = L.wrapped(f"{m.name}: {L.comment(m.doc)}")
        if f.tensor == program.sampled_tokens:
            doc += L.wrapped("(gathered from the sampled tokens on the device, by step())")
            lines: list[str] = []
        elif f.advance == "same":
            doc += L.wrapped("(the last step's values stay on the device)")
            lines = []
        elif f.device_advance is not None:
            lines = L.under(m.when, [L.call(alias(f.device_advance), [f"v.{m.name}", "d"])])
        else:
            lines = L.under(m.when, [L.call("v.copy", [repr(f.tensor)])])
        out.append({"doc": doc, "lines": lines})
    return out


def _device_fills(plan: FamilyPlan, alias: _Aliases) -> list[dict[str, Any]] | None:
    """The device build's program, one entry per bound device mirror of a rule tensor (its
    rule's device form on the step's device rows), or None where the family has none: a
    bound mirror whose rule has no device form, or a step scalar without a device value."""
    program = plan.program
    assert program is not None
    if any(x.device is None for x in program.scalars):
        return None
    fills = {f.tensor: f for f in program.fills}
    out = []
    for m in plan.tensors:
        f = fills.get(m.fill_target or "")
        if m.fill_kind != "mirror" or not m.bindings or f is None:
            continue
        if f.device_fill is None or m.pad is None:  # (a bucket's pad rows need a pad)
            return None
        args = [alias(f.device_fill), f"o.{m.name}", "d", repr(m.pad), *L.kwargs(f.reads)]
        out.append(
            {
                "tensor": m.name,
                "doc": L.wrapped(f"{m.name}: {L.comment(m.doc)}"),
                "lines": L.guarded(m.when, args[0], args[1:]),
            }
        )
    return out or None


def _host_input(f: PlannedFill, args: list[str], bound: dict[str, Any]) -> list[str]:
    """A host input's fill in the device build: under its binding's condition too (a binding
    the Config leaves out is not written)."""
    when = [b.when for b in bound[f.tensor]]
    if any(w is None for w in when):
        return L.write(f, args)
    cond = when[0] if len(set(when)) == 1 else E.BoolOp("or", tuple(dict.fromkeys(when)))
    guard = cond if f.guard is None else E.BoolOp("and", (f.guard, cond))
    return L.write(dataclasses.replace(f, guard=guard), args)


def _device_scalars(program: StepProgram, sizes: set[str]) -> list[dict[str, Any]]:
    """The lines of the generated `_device_scalars`: each step scalar's device value."""
    out = []
    for x in program.scalars:
        assert x.device is not None
        value = scalar_source(x.device, sizes)
        out.append(
            {
                "doc": L.wrapped(f"{x.name}: {L.comment(x.doc)}"),
                "lines": L.under(x.guard, _assign(f"scalars[{x.name!r}]", value, x.guard)),
            }
        )
    return out


def _advance_lines(f: PlannedFill, alias: _Aliases) -> list[str]:
    if f.advance == "same":
        return L.guarded(f.guard, f"t.{f.tensor}.keep", [f"p.{f.tensor}", "d.holds_run"])
    assert isinstance(f.advance, Impl)
    args = [
        alias(f.advance),
        f"t.{f.tensor}.out",
        f"p.{f.tensor}.out",
        "d",
        *([f"a.{f.tensor}"] if f.advance_check is not None and f.advance_check_result else []),
        *L.kwargs(f.advance_reads),
    ]
    return L.write(f, args)


def render_family(plan: FamilyPlan, file: str) -> str:
    spec_file, file = file, _file_label(file)
    sizes = {z.name for z in plan.sizes}
    flags = ", ".join(f"{k}={v!r}" for k, v in plan.flags)
    params = [_parameter(p, dict(plan.dtype_values)) for p in plan.parameters]
    assert plan.program is not None
    fields = {chk.name for chk in plan.program.checks} | {f.tensor for f in plan.program.fills}
    alias = _Aliases(_impls(plan), fields)
    project_modules, project_impls = _project(plan, alias, file)
    context = {
        "imports": [
            "import typing",
            "from collections.abc import Sequence",
            "",
            "from bufc.requests import batch, stateless, table",
            "from bufc.rules import decode",
            *alias.imports(),
            "from bufc.requests.sizes import StepSizes",
        ],
        "project_modules": project_modules,
        "project_impls": project_impls,
        **_program(plan, alias, sizes),
        "marker": MARKER,
        "file": file,
        "regenerate": REGENERATE,
        "family": plan.family.name,
        "family_doc": L.comment(plan.family.doc),
        "flags": flags,
        "flags_dict": "{" + ", ".join(f"{k!r}: {v!r}" for k, v in plan.flags) + "}",
        "format_version": FORMAT_VERSION,
        "params": params,
        "derived": [_derived(d, alias) for d in plan.derived],
        "checks": [
            {
                "cond": E.to_source(
                    c.require.expr,
                    name=lambda n: f"self.{n}",
                    call=lambda f: f"rt.{f}" if f == "cdiv" else f,
                ),
                "message": check_message(c, spec_file),
                "text": L.comment(c.require.text),
            }
            for c in plan.checks
        ],
        "tensors": [
            _tensor_context(pt, sizes, {f.tensor: alias(f.impl) for f in plan.program.fills})
            for pt in plan.tensors
        ],
        "index_sets": [_index_set(x) for x in plan.index_sets],
    }
    context["step_fields"], context["inputs_by_key"], context["scalars_only"] = step_fields(plan)
    source = _template().render(**context)
    ast.parse(source)  # defence in depth: never hand out something that is not Python
    return source


def render_init(names: list[str], file: str) -> str:
    file = _file_label(file)
    lines = [
        f"# {MARKER} by bufc.codegen from {file}. DO NOT EDIT.",
        REGENERATE,
        '"""Pregenerated buffer modules, one per model family of buffers.yaml."""',
        "",
        f"FAMILIES = {tuple(names)!r}",
        "",
    ]
    source = "\n".join(lines)
    ast.parse(source)
    return source


def render_all(compiled: Compiled, file: str = "buffers.yaml") -> dict[str, str]:
    """File name -> contents for everything under generated/ (from the plans the compile
    made: each family is lowered once)."""
    out = {"__init__.py": render_init([p.family.name for p in compiled.plans], file)}
    for plan in compiled.plans:
        out[f"{plan.family.name}.py"] = render_family(plan, file)
    return out


def regenerate_command(spec: str, out: str, families: Sequence[str] | None = None) -> str:
    """The command that rewrites `out` from `spec` (only `families`, when given), as a user
    types it."""
    picked = "".join(f" --family {shlex.quote(f)}" for f in families or ())
    return f"bufc generate --spec {shlex.quote(spec)} --out {shlex.quote(out)}{picked}"
