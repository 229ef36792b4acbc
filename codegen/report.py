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


# Values the formulas may reach while reporting (bytes of a tensor included); larger ones
# are reported as an error instead of overflowing a float or running away.
_LIMIT = 1 << 128


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for i, unit in enumerate(("KiB", "MiB", "GiB"), 1):
        if n < 1024 ** (i + 1) or unit == "GiB":
            return f"{n / 1024**i:.1f} {unit}"
    return f"{n} B"  # pragma: no cover


def _evaluate(e: E.Expr, env: dict[str, int | bool | str], what: str) -> int | bool | str:
    try:
        return E.evaluate(e, env, limit=_LIMIT)
    except ArithmeticError as exc:  # division by zero, a value beyond _LIMIT
        raise ReportError(f"cannot evaluate {what}: {exc}") from None


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
                value = int(raw) if len(raw) <= 32 else None
            except ValueError:
                value = None
            if value is None and raw.strip().lstrip("+-").isdigit():
                raise ReportError(
                    f"{key}: {raw[:24]}... is too large (at most {vocab.INT_LIMIT - 1})"
                )
            if value is None:
                raise ReportError(f"{key}: '{raw}' is not an integer")
            if abs(value) >= vocab.INT_LIMIT:
                raise ReportError(f"{key}: {value} is too large (at most {vocab.INT_LIMIT - 1})")
            env[key] = value
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
        env[d.name] = _evaluate(d.value.expr, env, f"derived value '{d.name}'")
    for c in plan.checks:
        if not _evaluate(c.require.expr, env, "a check"):
            raise ReportError(f"{c.message} ({c.require.text})")

    staged = {t.fill_target for t in plan.tensors if t.fill_kind == "mirror"}
    groups: dict[str, list[tuple[str, ...]]] = {"device": [], "pinned": [], "host": []}
    totals = dict.fromkeys(groups, 0)
    for t in plan.tensors:
        if t.when is not None and not _evaluate(t.when, env, f"the condition of '{t.name}'"):
            continue
        shape = [int(_evaluate(e, env, f"the capacity of '{t.name}'")) for e in t.capacity]
        if any(n < 0 for n in shape):
            raise ReportError(f"the capacity of '{t.name}' is negative: {shape}")
        dtype = dtypes[t.dtype] if t.dtype_is_param else t.dtype
        nbytes = vocab.DTYPE_BYTES[dtype] * math.prod(shape)
        if nbytes > _LIMIT:
            raise ReportError(f"'{t.name}' would need {nbytes} bytes")
        copies = 2 if t.name in staged else 1  # staging is double-buffered
        totals[t.memory] += nbytes * copies
        binds = [
            f"{'in' if b.direction == 'input' else 'out'}:{b.engine_name}"
            for b in t.bindings
            if b.when is None or _evaluate(b.when, env, f"a binding of '{t.name}'")
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
