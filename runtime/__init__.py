"""bufc.runtime: the small torch library every generated module stands on.

A generated module declares its tensors (``TensorDecl`` records), its ``Config`` and its step
program; allocation, the staging arena, the one host-to-device copy, the engine IO views,
rings and statics are implemented once, here. The rules the step programs call are in
``bufc.rules``.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess
    raise ModuleNotFoundError(
        "bufc.runtime and the generated buffer modules need torch (bufc's [runtime] extra): pip install torch numpy",
        name="torch",
    ) from exc

from ..errors import BatchError, ConfigError, RuleError
from ..requests.sizes import ENCODER_SIZES, STEP_SIZES, StepSizes
from ..rules.request import Request
from .buffers import RuntimeBuffers
from .config import (
    ConfigBase,
    cdiv,
    check_bool,
    check_dtype,
    check_int,
    check_ints,
    check_names,
    derived,
    require,
)
from .decl import (
    DEVICE,
    ENGINE,
    EXTERNAL,
    HOST,
    PINNED,
    STATIC,
    Bind,
    Constant,
    IndexSet,
    Mirror,
    Rule,
    Static,
    TensorDecl,
)
from .device_build import DeviceTargets
from .device_rows import DeviceRows
from .guards import SizeBounds, check_size
from .project import ProjectImpl, rule_module
from .staging import REPEAT_LAST, Targets, write_all, written_max
from .step import Step, StepInputs, StepMode

FORMAT_VERSION = 9
"""The generated-module format this runtime implements; bumped on incompatible changes (9: the
device build, ``device_build``, ``_device_fill`` on ``rt.DeviceTargets`` and ``rt.DeviceRows``,
``_device_scalars``; 8: the
typed step record, each family's ``StepInputs`` on ``rt.StepInputs``; 7: the
step sizes' capacities made once, ``_size_bounds``, an ``rt.SizeBounds``; 6: no
continue program, every in-flight step runs the family's ``_check`` and ``_fill`` or
advances; 5: the continue program, ``_continues``, ``_continue_check`` and ``_continue``, on the rules of
``bufc.rules.continued``; 4: the request layer is ``bufc.requests`` (``batch``, ``stateless``,
``table``), the format check comes before every other import, arrival checks (``_admit``),
step scalars (``_scalars``) and capture values (``_capture``); 3: a spec's own implementation
modules imported through ``rule_module``, and ``project_impls``)."""

READS_FORMATS = (FORMAT_VERSION,)
"""The formats it reads: a module of format 7 has no ``StepInputs``, one of format 6 no ``_size_bounds``, and one of format 5 or
earlier imports what moved or is gone (``bufc.rules.sizes`` is ``bufc.requests.sizes``, the KV
offsets are ``bufc.rules.kv_offsets``, ``bufc.rules.continued`` is gone): regenerate it."""


def check_format_version(version: int) -> None:
    """Called at import by every generated module."""
    if version not in READS_FORMATS:
        raise ImportError(
            f"this generated module was written for bufc runtime format {version}, but the "
            f"installed bufc.runtime implements format {FORMAT_VERSION}; regenerate it with the "
            "installed bufc (bufc generate --spec SPEC --out FOLDER; bufc check prints the exact "
            "command)"
        )


__all__ = [
    "DEVICE",
    "ENCODER_SIZES",
    "ENGINE",
    "EXTERNAL",
    "FORMAT_VERSION",
    "HOST",
    "PINNED",
    "STATIC",
    "Static",
    "STEP_SIZES",
    "BatchError",
    "Bind",
    "ConfigBase",
    "ConfigError",
    "Constant",
    "DeviceRows",
    "DeviceTargets",
    "IndexSet",
    "Mirror",
    "ProjectImpl",
    "READS_FORMATS",
    "Request",
    "Rule",
    "RuleError",
    "RuntimeBuffers",
    "Step",
    "StepInputs",
    "StepMode",
    "StepSizes",
    "REPEAT_LAST",
    "write_all",
    "written_max",
    "Targets",
    "TensorDecl",
    "cdiv",
    "check_bool",
    "check_dtype",
    "check_format_version",
    "check_int",
    "SizeBounds",
    "check_size",
    "check_names",
    "check_ints",
    "derived",
    "require",
    "rule_module",
]
