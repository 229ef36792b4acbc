"""An implementation named by import path, ``MODULE:NAME``, resolved in plain Python (no torch).

A spec's own rules and request checks name their implementations this way. Two places import
them, with the same messages: ``bufc validate --import`` and ``bufc generate`` (the compiler,
``bufc.codegen.contract``: a located diagnostic), and a generated module when it is imported
(``bufc.runtime.rule_module``: an ImportError naming the line of the spec). Each message reads
``WHERE names MODULE:NAME, but REASON; WHAT TO DO``.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Any


class Unresolved(Exception):
    """`module:name` could not be resolved; the message says why and what to do."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason}; {fix}")
        self.reason, self.fix = reason, fix

    def where(self, where: str, module: str, name: str) -> str:
        """The whole message, for the declaration at `where` (``FILE:LINE:COL: rule 'x'``)."""
        return f"{where} names {module}:{name}, but {self.reason}; {self.fix}"


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _submodules(package: str) -> list[str]:
    """The modules of `package` that can be imported (none when it cannot be imported)."""
    try:
        path = getattr(importlib.import_module(package), "__path__", None)
    except Exception:  # noqa: BLE001 - only a suggestion
        return []
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules(path)] if path else []


def failure(module: str, exc: BaseException) -> Unresolved:
    """Why importing `module` raised `exc`, and what to do."""
    if isinstance(exc, ModuleNotFoundError):
        missing = exc.name or ""
        if missing == module or module.startswith(missing + ".") or not missing:
            parent = missing.rpartition(".")[0]
            hint = _did_you_mean(missing, _submodules(parent)) if parent else ""
            return Unresolved(
                f"there is no module {missing or module}{hint}",
                f"fix the impl path or install {_top(module)}",
            )
        return Unresolved(  # the module is there; something it imports is not
            f"importing {module} raised ModuleNotFoundError: {exc}",
            f"install {_top(missing)}, which {module} imports",
        )
    return Unresolved(f"importing {module} raised {type(exc).__name__}: {exc}", f"fix {module}")


def import_module(module: str) -> Any:
    """`module` imported; Unresolved (from the error) when it does not exist or its import
    fails, whatever the module's own code raised."""
    try:
        return importlib.import_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported, located, by the compiler
        raise failure(module, exc) from exc


def attribute(owner: Any, module: str, name: str, kind: str = "function") -> Any:
    """`owner.name`, a function (or, `kind` "class", a class); Unresolved otherwise."""
    missing = object()
    try:
        value = getattr(owner, name, missing)
    except Exception as exc:  # noqa: BLE001 - a module __getattr__ that raises
        raise Unresolved(
            f"looking up {name} in {module} raised {type(exc).__name__}: {exc}", f"fix {module}"
        ) from exc
    if value is missing:
        names = [n for n in vars(owner) if not n.startswith("_")]
        raise Unresolved(
            f"{module} has no {kind} {name}{_did_you_mean(name, names)}",
            f"fix the impl path or define {name} in {module}",
        )
    if (kind == "class" and not isinstance(value, type)) or not callable(value):
        raise Unresolved(
            f"{module}.{name} is {_a(type(value).__name__)}, not {_a(kind)}",
            f"fix the impl path or make {name} {_a(kind)}",
        )
    return value


def _a(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def resolve(module: str, name: str, kind: str = "function") -> Any:
    """The object `module:name` names (Unresolved, with the reason and the fix, otherwise)."""
    return attribute(import_module(module), module, name, kind)
