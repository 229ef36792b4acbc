"""How each kind of formula prints in a generated module: the IR (``expr``) to Python source,
its names bound as the place it appears in reads them (the Config as ``c``, the step sizes as
``s``, the step's scalars, a tensor's written maximum)."""

from __future__ import annotations

from . import expr as E


def _cdiv(f: str) -> str:
    return f"rt.{f}" if f == "cdiv" else f


def construct_source(e: E.Expr) -> str:
    """A construct-time formula: Config names (an index set's `index` as it is)."""
    return E.to_source(e, name=lambda n: n if n == "index" else f"c.{n}", call=_cdiv)


def step_source(e: E.Expr, sizes: set[str]) -> str:
    """A step-time formula (a step shape): Config names and step sizes."""
    return E.to_source(e, name=lambda n: f"s.{n}" if n in sizes else f"c.{n}", call=_cdiv)


def scalar_source(e: E.Expr, sizes: set[str]) -> str:
    """A step scalar's value: Config names, step sizes, and max_of(T) as what the step wrote."""
    return E.to_source(
        e,
        name=lambda n: f"s.{n}" if n in sizes else f"c.{n}",
        call=_cdiv,
        tensor_max=lambda t: f"rt.written_max(t.{t})",
    )


def capture_source(e: E.Expr, sizes: set[str], scalars: set[str]) -> str:
    """A capture value: Config names, step sizes, the step's scalars and prepare_for_cuda_graph's
    max_sequence_length."""

    def name(n: str) -> str:
        if n == "max_sequence_length":
            return n
        if n in scalars:
            return f"scalars[{n!r}]"
        return f"s.{n}" if n in sizes else f"c.{n}"

    return E.to_source(e, name=name, call=_cdiv)
