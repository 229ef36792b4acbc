"""``bufc report`` without a spec at hand: the same Report, read from a generated module.

An installed wheel ships the generated modules (``bufc.generated.<family>``), not the spec they
came from. A module holds everything the report needs: its ``Config`` (the parameters, their
defaults and checks) and ``TENSORS`` (dtype, memory, capacity, fill and bindings of every
tensor). Importing it needs torch, the ``runtime`` extra every user of the modules has.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

from . import vocab
from .errors import did_you_mean
from .report import Report, ReportError, TensorRow, kv_pools, parse_int

_BYTES = {f"torch.{name}": size for name, size in vocab.DTYPE_BYTES.items()}


def _module(package: str, family: str) -> Any:
    try:
        families = importlib.import_module(package).FAMILIES
    except ModuleNotFoundError as exc:
        raise ReportError(f"no spec given and no generated package {package!r}: {exc}") from None
    if family not in families:
        raise ReportError(
            f"unknown family '{family}'{did_you_mean(family, families)}; "
            f"families: {', '.join(families)}"
        )
    try:
        return importlib.import_module(f"{package}.{family}")
    except ModuleNotFoundError as exc:
        if exc.name == "torch" or (exc.name or "").startswith("torch."):
            raise ReportError(
                "reading a generated module needs torch (bufc's [runtime] extra): pip install torch numpy, "
                "or give the spec with --spec"
            ) from None
        raise


def _value(field: dataclasses.Field, raw: str) -> Any:
    kind = str(field.type)
    if kind == "bool":
        if raw.lower() not in ("true", "false"):
            raise ReportError(f"{field.name}: '{raw}' is not true or false")
        return raw.lower() == "true"
    if kind == "torch.dtype":
        if raw not in vocab.DTYPES:
            raise ReportError(
                f"{field.name}: '{raw}' is not a dtype{did_you_mean(raw, vocab.DTYPES)}"
            )
        return raw  # the Config converts names to torch dtypes
    if kind == "tuple[int, ...]":
        return tuple(parse_int(field.name, n) for n in raw.split(",") if n)
    if kind.startswith("tuple"):
        return tuple(n for n in raw.split(",") if n)
    return parse_int(field.name, raw)


def report_module(family: str, settings: dict[str, str], package: str = "bufc.generated") -> Report:
    """What `family` allocates for `settings`, from its generated module."""
    mod = _module(package, family)
    rt = importlib.import_module("bufc.runtime")
    fields = {f.name: f for f in dataclasses.fields(mod.Config) if f.init}
    for key in settings:
        if key not in fields:
            raise ReportError(
                f"family '{family}' has no parameter '{key}'{did_you_mean(key, fields)}"
            )
    missing = [
        name
        for name, f in fields.items()
        if name not in settings
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ReportError("missing --set for: " + ", ".join(missing))
    try:
        config = mod.Config(**{k: _value(fields[k], v) for k, v in settings.items()})
    except rt.ConfigError as exc:
        raise ReportError(str(exc)) from None
    decls = [d for d in mod.TENSORS if d.when is None or d.when(config)]
    staged = {d.fill.source for d in decls if isinstance(d.fill, rt.Mirror)}
    rows = []
    for d in decls:
        dtype = d.dtype if not callable(d.dtype) else d.dtype(config)
        shape = tuple(int(n) for n in d.capacity(config))
        name = str(dtype).removeprefix("torch.")
        nbytes = _BYTES[str(dtype)] * math.prod(shape)
        rule = isinstance(d.fill, rt.Rule)
        if rule:
            fill = f"rule {d.fill.name}"
        elif isinstance(d.fill, rt.Mirror):
            fill = "mirror"
        elif isinstance(d.fill, rt.Constant):
            fill = "constant"
        elif isinstance(d.fill, rt.Static):
            fill = "static"
        else:
            fill = repr(d.fill).removeprefix("rt.").lower()
        binds = tuple(
            f"{label}:{b.engine_name}"
            for label, group in (("in", d.inputs), ("out", d.outputs))
            for b in group
            if b.when is None or b.when(config)
        )
        rows.append(
            TensorRow(
                name=d.name,
                dtype=name,
                memory=d.memory,
                shape=shape,
                nbytes=nbytes,
                copies=2 if d.name in staged or (d.memory != rt.DEVICE and rule) else 1,
                fill=fill,
                binds=binds,
            )
        )
    get = lambda name: getattr(config, name, None)  # noqa: E731
    return Report(family, tuple(mod.FLAGS.items()), tuple(rows), kv_pools(get))
