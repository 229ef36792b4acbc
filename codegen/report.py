"""``bufc report FAMILY --set name=value``: what a family allocates for given parameters.

Evaluated with the formula interpreter, so it needs no torch: the tensors that exist, their
capacity shapes and bytes, their engine bindings, and the total.
"""

from __future__ import annotations

import math

from . import expr as E
from . import vocab
from .errors import did_you_mean
from .model import Spec
from .plan import lower_family


class ReportError(Exception):
    pass


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def report(spec: Spec, family_name: str, settings: dict[str, str]) -> str:
    families = {f.name: f for f in spec.families}
    if family_name not in families:
        raise ReportError(
            f"unknown family '{family_name}'{did_you_mean(family_name, families)}; "
            f"families: {', '.join(families)}"
        )
    plan = lower_family(spec, families[family_name])
    env: dict[str, int | bool | str] = {}
    dtypes: dict[str, str] = {}
    known = {p.name: p for p in plan.parameters}
    for key, raw in settings.items():
        if key not in known:
            raise ReportError(
                f"family '{family_name}' has no parameter '{key}'{did_you_mean(key, known)}"
            )
        kind = known[key].kind
        if kind == "dtype":
            if raw not in vocab.DTYPES:
                raise ReportError(f"{key}: '{raw}' is not a dtype{did_you_mean(raw, vocab.DTYPES)}")
            dtypes[key] = raw
        elif kind == "bool":
            if raw.lower() not in ("true", "false"):
                raise ReportError(f"{key}: '{raw}' is not true or false")
            env[key] = raw.lower() == "true"
        elif kind == "names":
            names = tuple(n for n in raw.split(",") if n)
            for n in names:
                if n not in known[key].values:
                    raise ReportError(f"{key}: '{n}' is not one of {', '.join(known[key].values)}")
            env[key] = names  # type: ignore[assignment]
        else:
            try:
                env[key] = int(raw)
            except ValueError:
                raise ReportError(f"{key}: '{raw}' is not an integer") from None
    for p in plan.parameters:
        if p.kind == "dtype":
            dtypes.setdefault(p.name, str(p.default))
            continue
        if p.name not in env:
            if p.default is None:
                missing = [
                    q.name
                    for q in plan.parameters
                    if q.kind != "dtype" and q.default is None and q.name not in env
                ]
                raise ReportError("missing --set for: " + ", ".join(missing))
            env[p.name] = p.default  # type: ignore[assignment]
        if p.kind == "int" and p.minimum is not None and int(env[p.name]) < p.minimum:  # type: ignore[arg-type]
            raise ReportError(f"{p.name} must be at least {p.minimum}")
    for d in plan.derived:
        env[d.name] = E.evaluate(d.value.expr, env)
    for c in plan.checks:
        if not E.evaluate(c.require.expr, env):
            raise ReportError(f"{c.message} ({c.require.text})")

    staged = {t.fill_target for t in plan.tensors if t.fill_kind == "mirror"}
    groups: dict[str, list[tuple[str, ...]]] = {"device": [], "pinned": [], "host": []}
    totals = dict.fromkeys(groups, 0)
    for t in plan.tensors:
        if t.when is not None and not E.evaluate(t.when, env):
            continue
        shape = [int(E.evaluate(e, env)) for e in t.capacity]
        dtype = dtypes[t.dtype] if t.dtype_is_param else t.dtype
        nbytes = vocab.DTYPE_BYTES[dtype] * math.prod(shape)
        copies = 2 if t.name in staged else 1  # staging is double-buffered
        totals[t.memory] += nbytes * copies
        binds = [
            f"{'in' if b.direction == 'input' else 'out'}:{b.engine_name}"
            for b in t.bindings
            if b.when is None or E.evaluate(b.when, env)
        ]
        groups[t.memory].append(
            (
                t.name,
                dtype,
                "[" + ", ".join(map(str, shape)) + "]",
                _human(nbytes) + (" x2" if copies == 2 else ""),
                t.fill_kind if t.fill_kind != "rule" else f"rule {t.fill_target}",
                " ".join(binds) or "-",
            )
        )
    head = ("tensor", "dtype", "capacity", "bytes", "fill", "binds")
    rows = [r for g in groups.values() for r in g]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"family {family_name}: " + ", ".join(f"{k}={v}" for k, v in plan.flags)]
    for memory, group in groups.items():
        if not group:
            continue
        lines.append("")
        lines.append(f"{memory} memory: {len(group)} tensors, {_human(totals[memory])}")
        lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
        for r in group:
            lines.append("  " + "  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
    lines.append("")
    total = sum(totals.values())
    split = ", ".join(f"{k} {_human(v)}" for k, v in totals.items() if v)
    lines.append(f"{len(rows)} tensors, {_human(total)} allocated for runtime buffers ({split})")
    return "\n".join(lines) + "\n"
