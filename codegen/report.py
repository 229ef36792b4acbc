"""``bufc report FAMILY --set name=value``: what a family allocates for given parameters.

Evaluated with the formula interpreter, so it needs no torch: the tensors that exist, their
capacity shapes and bytes, their engine bindings, and the total. The values given are checked
as the family's Config checks them (``bufc.config_checks``, the spec's checks), and refused
with its messages.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
from collections.abc import Callable
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from bufc import config_checks, impls

from . import emit, vocab
from . import expr as E
from .errors import did_you_mean

if TYPE_CHECKING:
    from .model import Derived
    from .pipeline import Compiled
    from .plan import FamilyPlan

# bufc's own derivations (the KV pools), run without --import; any other module a `derive:`
# names is the project's code, imported only when asked
TRUSTED_DERIVATIONS = "bufc.rules."


class ReportError(Exception):
    pass


MEMORY_KINDS = ("device", "pinned", "host")
PLOT_FORMATS = ("svg", "png", "pdf")


@dataclasses.dataclass(frozen=True)
class TensorRow:
    name: str
    dtype: str
    memory: str  # device | pinned | host
    shape: tuple[int, ...]  # capacity
    nbytes: int  # one copy
    copies: int  # 2 for double-buffered host tensors
    fill: str
    binds: tuple[str, ...]  # "in:NAME" / "out:NAME", with {set} placeholders unexpanded


@dataclasses.dataclass(frozen=True)
class Report:
    family: str
    flags: tuple[tuple[str, object], ...]
    tensors: tuple[TensorRow, ...]
    # the KV pools (paged families): (attention window, layers of this rank in the pool) each
    pools: tuple[tuple[int, int], ...] = ()

    def totals(self) -> dict[str, int]:
        """Bytes allocated per memory kind (every copy counted)."""
        out = dict.fromkeys(MEMORY_KINDS, 0)
        for t in self.tensors:
            out[t.memory] += t.nbytes * t.copies
        return out

    def text(self) -> str:
        """The table: one group per memory kind, then the total."""
        head = ("tensor", "dtype", "capacity", "bytes", "fill", "binds")
        groups: dict[str, list[tuple[str, ...]]] = {m: [] for m in MEMORY_KINDS}
        for t in self.tensors:
            groups[t.memory].append(
                (
                    t.name,
                    t.dtype,
                    "[" + ", ".join(map(str, t.shape)) + "]",
                    _human(t.nbytes) + (f" x{t.copies}" if t.copies > 1 else ""),
                    t.fill,
                    " ".join(t.binds) or "-",
                )
            )
        rows = [r for g in groups.values() for r in g]
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
        totals = self.totals()
        lines = [f"family {self.family}: " + ", ".join(f"{k}={v}" for k, v in self.flags)]
        if self.pools:
            lines.append(
                f"KV pools: {len(self.pools)} ("
                + "; ".join(
                    f"pool {p}: window {w}, {n} layer{'s' if n != 1 else ''}"
                    for p, (w, n) in enumerate(self.pools)
                )
                + ")"
            )
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
        lines.append(
            f"{len(rows)} tensors, {_human(total)} allocated for runtime buffers ({split})"
        )
        return "\n".join(lines) + "\n"

    def json(self) -> dict[str, object]:
        """Every tensor with its dtype, memory kind, shape, bytes and bindings, and the totals
        (the same numbers as the table, bytes exact)."""
        totals = self.totals()
        return {
            "family": self.family,
            "flags": dict(self.flags),
            "kv_pools": [{"window": w, "layers": n} for w, n in self.pools],
            "tensors": [
                {
                    "name": t.name,
                    "dtype": t.dtype,
                    "memory": t.memory,
                    "shape": list(t.shape),
                    "bytes": t.nbytes,
                    "copies": t.copies,
                    "fill": t.fill,
                    "inputs": [b[3:] for b in t.binds if b.startswith("in:")],
                    "outputs": [b[4:] for b in t.binds if b.startswith("out:")],
                }
                for t in self.tensors
            ],
            "totals": {**{k: v for k, v in totals.items()}, "all": sum(totals.values())},
        }


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


def parse_int(name: str, raw: str) -> int:
    """A --set integer, bounded like a Config's (a 400-digit number is an error, not a hang)."""
    try:
        value = int(raw) if len(raw) <= 32 else None
    except ValueError:
        value = None
    if value is None and raw.strip().lstrip("+-").isdigit():
        raise ReportError(f"{name}: {raw[:24]}... is too large (at most {vocab.INT_LIMIT - 1})")
    if value is None:
        raise ReportError(f"{name}: '{raw}' is not an integer")
    if abs(value) >= vocab.INT_LIMIT:
        raise ReportError(f"{name}: {value} is too large (at most {vocab.INT_LIMIT - 1})")
    return value


def plot(points: list[tuple[str, Report]], parameter: str, path: str, top: int = 6) -> None:
    """Memory per tensor and memory kind over a sweep of `parameter` (one stacked bar per
    value, one panel per memory kind that holds anything; the `top` largest tensors of each
    kind by name, the rest as 'other'), written to `path` (.svg, .png, .pdf)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        raise ReportError(
            "--plot needs matplotlib (bufc's [plot] extra): pip install matplotlib"
        ) from None
    kinds = [m for m in MEMORY_KINDS if any(r.totals()[m] for _, r in points)]
    # each panel's legend stands to its right, outside the axes (inside, it covered bars)
    fig, axes = plt.subplots(1, len(kinds), figsize=(7.5 * len(kinds), 4), squeeze=False)
    labels = [value for value, _ in points]
    for ax, kind in zip(axes[0], kinds):
        sizes: dict[str, list[float]] = {}
        for i, (_, r) in enumerate(points):
            for t in r.tensors:
                if t.memory == kind:
                    sizes.setdefault(t.name, [0.0] * len(points))[i] = t.nbytes * t.copies / 2**20
        largest = sorted(sizes, key=lambda n: sizes[n][-1], reverse=True)
        stacks = {n: sizes[n] for n in largest[:top]}
        if len(largest) > top:
            stacks["other"] = [sum(sizes[n][i] for n in largest[top:]) for i in range(len(points))]
        bottom = [0.0] * len(points)
        for name, values in stacks.items():
            ax.bar(labels, values, bottom=bottom, label=name)
            bottom = [a + b for a, b in zip(bottom, values)]
        ax.set_title(f"{kind} memory")
        ax.set_xlabel(parameter)
        ax.set_ylabel("MiB")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    fig.suptitle(f"family {points[0][1].family}: runtime buffers over {parameter}")
    fig.tight_layout()  # room for the legends between the panels
    try:
        fig.savefig(path, bbox_inches="tight")
    except (OSError, ValueError) as exc:
        raise ReportError(f"cannot write {path}: {exc}") from None
    finally:
        plt.close(fig)


def _evaluate(e: E.Expr, env: dict[str, int | bool | str], what: str) -> int | bool | str:
    try:
        return E.evaluate(e, env, limit=_LIMIT)
    except ArithmeticError as exc:  # division by zero, a value beyond _LIMIT
        raise ReportError(f"cannot evaluate {what}: {exc}") from None


def _derived(d: Derived, env: dict[str, int | bool | str], imports: bool) -> object:
    """The value of `d`'s `derive:` function, called as the generated Config calls it. A
    project's function runs only with `imports` (else a ReportError saying to pass
    --import); one that cannot be imported or raises is a ReportError at its line."""
    impl = d.derive
    assert impl is not None
    where = f"{impl.loc}: derived value '{d.name}'"
    if not impl.module.startswith(TRUSTED_DERIVATIONS) and not imports:
        raise ReportError(
            f"{where} comes from {impl.text}, the project's code, which report runs only "
            "when asked: pass --import to evaluate it"
        )
    cwd = os.getcwd()  # imported as the project's code is (bufc.codegen.contract)
    added = imports and cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        fn = impls.resolve(impl.module, impl.name)
    except impls.Unresolved as exc:
        raise ReportError(exc.where(where, impl.module, impl.name)) from None
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    try:
        value = fn(**{n: env[n] for n in d.reads})
    except Exception as exc:  # noqa: BLE001 - the project's code: reported at its line
        raise ReportError(f"{where}: {impl.text} raised {type(exc).__name__}: {exc}") from None
    if d.kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (tuple, list)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
    if not ok:
        what = "an integer" if d.kind == "int" else "a list of integers"
        raise ReportError(f"{where}: {impl.text} returned {value!r}, not {what}")
    return tuple(value) if d.kind == "ints" else value


def _settings(
    plan: FamilyPlan, settings: dict[str, str]
) -> tuple[dict[str, object], dict[str, str]]:
    """The values of `settings` (the text of each --set), each read as its parameter's kind:
    (values, dtypes)."""
    family_name = plan.family.name
    values: dict[str, object] = {}
    dtypes: dict[str, str] = {}
    known = {p.name: p for p in plan.parameters}
    for key, raw in settings.items():
        if key not in known:
            raise ReportError(
                f"family '{family_name}' has no parameter '{key}'{did_you_mean(key, known)}"
            )
        kind = known[key].kind
        if kind == "dtype":
            allowed = known[key].values or tuple(vocab.DTYPES)
            if raw not in allowed:
                raise ReportError(
                    f"{key}: '{raw}' is not one of {', '.join(allowed)}{did_you_mean(raw, allowed)}"
                )
            dtypes[key] = raw
        elif kind == "bool":
            if raw.lower() not in ("true", "false"):
                raise ReportError(f"{key}: '{raw}' is not true or false")
            values[key] = raw.lower() == "true"
        elif kind in ("names", "ints"):
            items = raw.split(",") if raw else []  # an empty value: an empty list
            if any(not n.strip() for n in items):
                raise ReportError(
                    f"{key}: '{raw}' has an empty item; give the values comma-separated, "
                    f"as {key}=a,b (or {key}= for none)"
                )
            if kind == "names":
                values[key] = tuple(n.strip() for n in items)
            else:
                values[key] = tuple(parse_int(key, n.strip()) for n in items)
        else:
            values[key] = parse_int(key, raw)
    return values, dtypes


def report(
    compiled: Compiled, family_name: str, settings: dict[str, str], *, imports: bool = False
) -> Report:
    """What `family_name` allocates for `settings` (parameter name -> text, as given to
    ``--set``), evaluated from the compiled spec's plan of the family. A `derive:` function
    of the project's own runs only with `imports` (bufc's own always)."""
    families = {p.family.name: p for p in compiled.plans}
    if family_name not in families:
        raise ReportError(
            f"unknown family '{family_name}'{did_you_mean(family_name, families)}; "
            f"families: {', '.join(families)}"
        )
    plan = families[family_name]
    where = f"{family_name}.Config"
    values, dtypes = _settings(plan, settings)
    missing = [
        p.name
        for p in plan.parameters
        if p.kind != "dtype" and p.default is None and p.name not in values
    ]
    if missing:
        raise ReportError("missing --set for: " + ", ".join(missing))
    for p in plan.parameters:
        if p.kind == "dtype":
            dtypes.setdefault(p.name, str(p.default))
        else:
            values.setdefault(p.name, p.default)
    # the checks the family's Config runs on its parameters, in its order, every problem at once
    config = types.SimpleNamespace(**values)
    errors: list[str] = []
    for p in plan.parameters:
        if p.kind == "int":
            minimum = int(p.minimum) if p.minimum is not None else 0
            config_checks.check_int(config, p.name, minimum=minimum, errors=errors)
        elif p.kind == "bool":
            config_checks.check_bool(config, p.name, errors)
        elif p.kind == "names":
            config_checks.check_names(config, p.name, tuple(str(v) for v in p.values), errors)
        elif p.kind == "ints":
            minimum = int(p.minimum) if p.minimum is not None else 0
            config_checks.check_ints(config, p.name, minimum=minimum, errors=errors)
    if errors:
        raise ReportError(config_checks.failure(where, errors))
    env: dict[str, int | bool | str] = dict(vars(config))
    for d in plan.derived:
        if d.value is not None:
            env[d.name] = _evaluate(d.value.expr, env, f"derived value '{d.name}'")
        else:  # its function, as the generated Config calls it
            env[d.name] = _derived(d, env, imports)  # type: ignore[assignment]
    # then its checks over them, with its messages
    for c in plan.checks:
        message = emit.check_message(c, PurePath(c.loc.file).name)
        try:
            ok = bool(E.evaluate(c.require.expr, env, limit=_LIMIT))
        except ArithmeticError as exc:  # as the Config: the check fails, saying why
            ok, message = False, f"{message} ({exc})"
        if not ok:
            errors.append(message)
    if errors:
        raise ReportError(config_checks.failure(where, errors))

    staged = {t.fill_target for t in plan.tensors if t.fill_kind == "mirror"}
    tensors = []
    for t in plan.tensors:
        if t.when is not None and not _evaluate(t.when, env, f"the condition of '{t.name}'"):
            continue
        shape = tuple(int(_evaluate(e, env, f"the capacity of '{t.name}'")) for e in t.capacity)
        if any(n < 0 for n in shape):
            raise ReportError(f"the capacity of '{t.name}' is negative: {list(shape)}")
        dtype = dtypes[t.dtype] if t.dtype_is_param else t.dtype
        nbytes = vocab.DTYPE_BYTES[dtype] * math.prod(shape)
        if nbytes > _LIMIT:
            raise ReportError(f"'{t.name}' would need {nbytes} bytes")
        tensors.append(
            TensorRow(
                name=t.name,
                dtype=dtype,
                memory=t.memory,
                shape=shape,
                nbytes=nbytes,
                # staging is double-buffered, and so is every host tensor a rule fills
                copies=2
                if t.name in staged or (t.memory != "device" and t.fill_kind == "rule")
                else 1,
                fill=t.fill_kind if t.fill_kind != "rule" else f"rule {t.fill_target}",
                binds=tuple(
                    f"{'in' if b.direction == 'input' else 'out'}:{b.engine_name}"
                    for b in t.bindings
                    if b.when is None or _evaluate(b.when, env, f"a binding of '{t.name}'")
                ),
            )
        )
    return Report(
        family_name, tuple((k, v) for k, v in plan.flags), tuple(tensors), kv_pools(env.get)
    )


def kv_pools(get: Callable[[str], Any]) -> tuple[tuple[int, int], ...]:
    """(window, layers) of each KV pool, from a Config's derived values (none without them)."""
    layers, windows, sizes = (
        get(n) for n in ("kv_pool_layers", "kv_pool_windows", "attention_window_sizes")
    )
    if layers is None or windows is None or sizes is None:
        return ()
    return tuple((int(sizes[k]), int(n)) for n, k in zip(layers, windows))
