"""A spec's own implementations (a project's rules and request checks, named by import path):
their modules imported for a generated module, and an exception one raises at step time
named.

bufc's own rule modules are plain imports of a generated module; a project's go through
``rule_module``, so that a module or function that is missing is an ImportError naming the
line of the spec that names it. A generated ``RuntimeBuffers`` lists them in
``project_impls``: an exception raised inside one is a ``RuleError`` that names the rule and
its implementation, not a request to report a bug of bufc.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable, Iterable
from types import CodeType, ModuleType, TracebackType
from typing import Any

from bufc import impls

from ..errors import RuleError
from ..requests.values import unread_getter
from ..rules.request import read_fields, unread_fields


def rule_module(module: str, *names: tuple[str, str, str]) -> ModuleType:
    """`module` imported, with each name the spec names in it there. `names`: (name, "function"
    or "class", where: ``FILE:LINE:COL: rule 'x'``). An ImportError names the first
    declaration that cannot be resolved (the module's own error chained); any other error of
    the module's own code is raised as it is."""
    try:
        found = importlib.import_module(module)
    except ImportError as exc:  # any other error of its own code: its traceback shows where
        name, _, where = names[0]
        text = impls.failure(module, exc).where(where, module, name)
        raise ImportError(text, name=module) from exc
    for name, kind, where in names:
        try:
            impls.attribute(found, module, name, kind)
        except impls.Unresolved as exc:
            raise ImportError(exc.where(where, module, name), name=module) from None
    return found


@dataclasses.dataclass(frozen=True)
class ProjectImpl:
    """One of the spec's own implementations as a family's step calls it: from the generated
    method `method` (``_check``, ``_fill``, ...), for `what` (``rule 'x'``), `impl` being its
    import path and `fn` the function."""

    method: str
    what: str
    impl: str
    fn: Callable[..., Any]

    @property
    def code(self) -> CodeType | None:
        fn = inspect.unwrap(self.fn)  # a decorated function: the code it wraps
        return getattr(fn, "__code__", None)


def culprit(
    exc: BaseException, generated: dict[CodeType, str], project: Iterable[ProjectImpl]
) -> list[ProjectImpl]:
    """The project implementations that raised `exc`: in its traceback, the frame of a
    generated method (`generated`: code -> method name) called one of `project` (more than
    one only where one function serves several declarations of that method). Empty when the
    exception came from anything else (bufc's own rules, the runtime)."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code not in generated:
        tb = tb.tb_next
    if tb is None or tb.tb_next is None:
        return []
    method = generated[tb.tb_frame.f_code]
    below = []
    t: TracebackType | None = tb.tb_next
    while t is not None:
        below.append(t.tb_frame.f_code)
        t = t.tb_next
    mine = [p for p in project if p.method == method and p.code is not None]
    called = [p for p in mine if p.code is below[0]]  # the function the generated line called
    return called or [p for p in mine if p.code in below]  # through a decorator


def reading(buffers: Any) -> Any:
    """The `buffers`' ``Limits`` with the Request fields its family never reads, which add and
    prepare_step refuse when set: a field is read where the family's step calls one of its
    readers (``bufc.rules.request.read_by``), the names the generator lists in
    ``request_readers``. None are refused where the step calls the spec's own
    implementations (``project_impls``: they may read any field) or a module generated before
    the list existed."""
    cls, limits = buffers.__class__, buffers.limits
    readers = getattr(cls, "request_readers", None)
    if readers is None or cls.project_impls:  # every field may be read: in flight, all kept
        return dataclasses.replace(limits, read=read_fields())
    unread = unread_fields(readers)
    family = getattr(sys.modules.get(cls.__module__), "FAMILY", cls.__name__)
    return dataclasses.replace(
        limits,
        unread=unread,
        unread_getter=unread_getter(unread) if unread else None,
        family=family,
        read=read_fields(readers),
    )


def rule_error(cls: type, exc: Exception, where: str = "") -> RuleError | None:
    """The RuleError naming the spec's own implementation (of generated class `cls`'s
    ``project_impls``) whose call by the generated step raised `exc`; None when another
    function raised it."""
    owner = next(c for c in cls.__mro__ if "project_impls" in vars(c))
    generated = {f.__code__: name for name, f in vars(owner).items() if inspect.isfunction(f)}
    found = culprit(exc, generated, vars(owner)["project_impls"])
    if not found:
        return None
    what = " or ".join(dict.fromkeys(p.what for p in found))
    return RuleError(what, found[0].impl, f"{type(exc).__name__}: {exc}", where)
