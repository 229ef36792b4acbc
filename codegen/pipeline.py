"""load -> schema -> model -> validate, as one call."""

from __future__ import annotations

from . import load, schema
from .errors import SpecError
from .model import Spec, build_spec
from .validate import check_spec


def compile_text(text: str, file: str = "buffers.yaml") -> Spec:
    """Parse and check a spec; raise SpecError listing every problem."""
    doc = load.load_text(text, file)
    problems = schema.check_document(doc)
    if problems:
        raise SpecError(problems)
    spec = build_spec(doc)
    check_spec(spec)
    return spec


def compile_file(path: str, display_name: str | None = None) -> Spec:
    file = display_name or path
    return compile_text(load.read(path, file), file)
