"""bufc.runtime: the small torch library every generated module calls.

Generated modules are data (``TensorDecl`` records and a ``Config``); allocation, the per-step
fill, the host-to-device copy and the engine IO views are implemented once, here.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess
    raise ModuleNotFoundError(
        "bufc.runtime and the generated buffer modules need torch: pip install 'bufc[runtime]'",
        name="torch",
    ) from exc

from .batch import ENCODER_SIZES, STEP_SIZES, Batch, StepSizes
from .buffers import KV_CACHE_LENGTH_ROUND, RuntimeBuffers, Step
from .config import ConfigBase, cdiv, check_bool, check_dtype, check_int, check_names, require
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
    SizeBound,
    TensorDecl,
)
from .errors import BatchError, ConfigError
from .request import Request

FORMAT_VERSION = 1
"""The generated-module format this runtime implements; bumped on incompatible changes."""


def check_format_version(version: int) -> None:
    """Called at import by every generated module."""
    if version != FORMAT_VERSION:
        raise ImportError(
            f"this generated module was written for bufc runtime format {version}, but the "
            f"installed bufc.runtime implements format {FORMAT_VERSION}; run 'make generate'"
        )


__all__ = [
    "DEVICE",
    "ENCODER_SIZES",
    "ENGINE",
    "EXTERNAL",
    "FORMAT_VERSION",
    "HOST",
    "KV_CACHE_LENGTH_ROUND",
    "PINNED",
    "STATIC",
    "STEP_SIZES",
    "Batch",
    "BatchError",
    "Bind",
    "ConfigBase",
    "ConfigError",
    "Constant",
    "IndexSet",
    "Mirror",
    "Request",
    "RuntimeBuffers",
    "SizeBound",
    "Step",
    "StepSizes",
    "TensorDecl",
    "cdiv",
    "check_bool",
    "check_dtype",
    "check_format_version",
    "check_int",
    "check_names",
    "require",
]
