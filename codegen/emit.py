"""Rendering: a FamilyPlan becomes Python source through one jinja2 template.

All text that reaches the output is computed here from validated data: identifiers (checked
against the schema's ASCII pattern), integers, ``repr`` of strings, table-driven dtype and
memory tokens, and formulas printed from the IR. The template only lays them out. Every render
is parsed with ``ast`` before it is returned.
"""

from __future__ import annotations

import ast
import shlex
from importlib import resources
from typing import Any

import jinja2

from . import expr as E
from . import vocab
from .model import Parameter, Spec
from .plan import FamilyPlan, PlannedIndexSet, PlannedTensor, lower_family

FORMAT_VERSION = 1  # the runtime API the generated modules are written against
MARKER = "@" + "generated"  # split so that grep finds only outputs
# the headers name no path, so the output does not depend on how --spec and --out were spelled;
# `bufc check` prints the exact command
REGENERATE = "# Regenerate with: bufc generate --spec SPEC --out FOLDER (bufc check prints the exact command)"


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


def _construct(e: E.Expr) -> str:
    return E.to_source(
        e,
        name=lambda n: n if n == "index" else f"c.{n}",
        call=lambda f: f"rt.{f}" if f == "cdiv" else f,
    )


def _set_var(name: str) -> str:
    return f"SET_{name.upper()}"


def _index_set(x: PlannedIndexSet) -> dict[str, str]:
    if x.names is not None:
        args = f"names=lambda c: c.{x.names}"
    else:
        assert x.first is not None and x.count is not None
        args = f"first=lambda c: {_construct(x.first)}, count=lambda c: {_construct(x.count)}"
        if x.where is not None:
            args += f", where=lambda c, index: {_construct(x.where)}"
    return {"var": _set_var(x.name), "name": x.name, "doc": _comment(x.doc), "args": args}


def _step(e: E.Expr, sizes: set[str]) -> str:
    return E.to_source(
        e,
        name=lambda n: f"s.{n}" if n in sizes else f"c.{n}",
        call=lambda f: f"rt.{f}" if f == "cdiv" else f,
    )


def _tuple(items: list[str]) -> str:
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _comment(text: str) -> str:
    """Text safe inside a ``#`` comment or a triple-quoted docstring.

    Docs are one line of printable ASCII (the schema); control characters are dropped anyway,
    and backslashes and quotes are escaped so a doc can never close its docstring.
    """
    text = "".join(ch for ch in text if " " <= ch <= "~")
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _file_label(file: str) -> str:
    """The spec's file name as it may appear in a comment or a message of generated code:
    printable ASCII only, anything else (newlines, control and non-ASCII characters) escaped as
    ``ascii()`` does, so a hostile file name can never end a comment line."""
    label = ascii(file)[1:-1]
    return "".join(ch if " " <= ch <= "~" else "?" for ch in label)


def _tensor_context(pt: PlannedTensor, sizes: set[str]) -> dict[str, Any]:
    dtype = f"lambda c: c.{pt.dtype}" if pt.dtype_is_param else f"torch.{vocab.DTYPES[pt.dtype]}"
    if pt.fill_kind == "rule":
        fill = f"fills.{pt.fill_target}"
    elif pt.fill_kind == "mirror":
        fill = f"rt.Mirror({pt.fill_target!r})"
    elif pt.fill_kind == "constant":
        assert pt.constant is not None
        fill = f"rt.Constant(lambda c: {_construct(pt.constant)})"
    else:
        fill = {"engine": "rt.ENGINE", "external": "rt.EXTERNAL", "static": "rt.STATIC"}[
            pt.fill_kind
        ]
    shape = _tuple([_step(e, sizes) for e in pt.shape])
    binds = []
    for b in pt.bindings:
        args = [repr(b.engine_name)]
        if b.when is not None:
            args.append(f"when=lambda c: {_construct(b.when)}")
        if b.each:
            args.append(f"each={_tuple([_set_var(n) for n in b.each])}")
        binds.append((b.direction, f"rt.Bind({', '.join(args)})"))
    return {
        "name": pt.name,
        "doc": _comment(pt.doc),
        "dtype": dtype,
        "memory": f"rt.{vocab.MEMORY_KINDS[pt.memory]}",
        "capacity": f"lambda c: {_tuple([_construct(e) for e in pt.capacity])}",
        "shape": f"lambda c, s: {shape}",
        "fill": fill,
        "pad": pt.pad,
        "when": f"lambda c: {_construct(pt.when)}" if pt.when is not None else None,
        "inputs": [b for d, b in binds if d == "input"],
        "outputs": [b for d, b in binds if d == "output"],
        "checked": pt.checked,
        "ring": pt.ring,
    }


def _parameter(p: Parameter, dtype_values: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    doc = _comment(p.doc)
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
    default = str(int(p.default)) if p.default is not None else None  # type: ignore[arg-type]
    minimum = int(p.minimum) if p.minimum is not None else 0
    return {
        "name": p.name,
        "type": "int",
        "default": default,
        "doc": doc,
        "check": f"rt.check_int(self, {p.name!r}, minimum={minimum}, errors=errors)",
    }


def render_family(plan: FamilyPlan, file: str) -> str:
    file = _file_label(file)
    sizes = {z.name for z in plan.sizes}
    flags = ", ".join(f"{k}={v!r}" for k, v in plan.flags)
    params = [_parameter(p, dict(plan.dtype_values)) for p in plan.parameters]
    context = {
        "marker": MARKER,
        "file": file,
        "regenerate": REGENERATE,
        "family": plan.family.name,
        "family_doc": _comment(plan.family.doc),
        "flags": flags,
        "flags_dict": "{" + ", ".join(f"{k!r}: {v!r}" for k, v in plan.flags) + "}",
        "format_version": FORMAT_VERSION,
        "params": params,
        "derived": [
            {
                "name": d.name,
                "doc": _comment(d.doc),
                "value": E.to_source(
                    d.value.expr,
                    name=lambda n: f"self.{n}",
                    call=lambda f: f"rt.{f}" if f == "cdiv" else f,
                ),
            }
            for d in plan.derived
        ],
        "checks": [
            {
                "cond": E.to_source(
                    c.require.expr,
                    name=lambda n: f"self.{n}",
                    call=lambda f: f"rt.{f}" if f == "cdiv" else f,
                ),
                # named by its condition, not its line: moving the spec's lines changes nothing
                "message": f"{_comment(c.message)} ({file}: {_comment(c.require.text)})",
                "text": _comment(c.require.text),
            }
            for c in plan.checks
        ],
        "bounds": [
            {"name": z.name, "bound": _construct(z.bound.expr)}
            for z in plan.sizes
            if z.bound is not None
        ],
        "tensors": [_tensor_context(pt, sizes) for pt in plan.tensors],
        "index_sets": [_index_set(x) for x in plan.index_sets],
        "step_sizes": repr(tuple(z.name for z in plan.sizes)),
    }
    source = _template().render(**context)
    ast.parse(source)  # defence in depth: never hand out something that is not Python
    return source


def render_init(spec: Spec, file: str) -> str:
    file = _file_label(file)
    names = [f.name for f in spec.families]
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


def render_all(spec: Spec, file: str = "buffers.yaml") -> dict[str, str]:
    """File name -> contents for everything under generated/."""
    out = {"__init__.py": render_init(spec, file)}
    for family in spec.families:
        out[f"{family.name}.py"] = render_family(lower_family(spec, family), file)
    return out


def regenerate_command(spec: str, out: str) -> str:
    """The command that rewrites `out` from `spec`, as a user types it."""
    return f"bufc generate --spec {shlex.quote(spec)} --out {shlex.quote(out)}"
