"""Owning generated/: write what changed, or report what is stale, missing or orphaned.

The output folder may hold other Python files (a hand-written ``setup.py``, helpers): only
files whose first line carries the generator's marker (``emit.MARKER``) belong to bufc, so only
those are ever deleted or reported as orphans.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from pathlib import Path

from .emit import MARKER


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", "replace")


def _existing(out_dir: Path) -> dict[str, str]:
    found = {}
    if out_dir.is_dir():
        for p in sorted(out_dir.iterdir()):
            if p.suffix == ".py" and p.is_file():
                found[p.name] = _read(p)
    return found


def is_generated(text: str) -> bool:
    """True when `text` is a file bufc wrote: the marker is on its first line."""
    return MARKER in text.split("\n", 1)[0]


def orphans(out_dir: Path, files: dict[str, str]) -> list[str]:
    """Generated files in `out_dir` that the spec no longer produces."""
    return sorted(
        name
        for name, text in _existing(out_dir).items()
        if name not in files and is_generated(text)
    )


def write(out_dir: Path, files: dict[str, str]) -> tuple[list[str], list[str]]:
    """Atomically write changed files and delete generated orphans; return the names written
    and the names deleted. Files without the marker are never touched."""
    out_dir.mkdir(parents=True, exist_ok=True)
    current = _existing(out_dir)
    written = []
    for name, text in sorted(files.items()):
        if current.get(name) == text:
            continue
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.replace(tmp, out_dir / name)
        written.append(name)
    deleted = orphans(out_dir, files)
    for name in deleted:
        (out_dir / name).unlink()
    return written, deleted


def diff(out_dir: Path, files: dict[str, str]) -> list[str]:
    """Unified diffs for every file that differs or is missing, and a line for every generated
    file that the spec no longer produces."""
    current = _existing(out_dir)
    out = []
    for name in sorted(files):
        old, new = current.get(name), files[name]
        if old == new:
            continue
        label = f"{out_dir.name}/{name}"
        out.append(
            "".join(
                difflib.unified_diff(
                    (old or "").splitlines(keepends=True),
                    new.splitlines(keepends=True),
                    fromfile=f"{label} (on disk)" if old is not None else "/dev/null",
                    tofile=f"{label} (generated)",
                )
            )
        )
    for name in orphans(out_dir, files):
        out.append(f"{out_dir.name}/{name}: orphan file, generated but not produced by the spec\n")
    return out
