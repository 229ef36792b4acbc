"""Owning generated/: write what changed, or report what is stale, missing or orphaned."""

from __future__ import annotations

import difflib
import os
import tempfile
from pathlib import Path


def _existing(out_dir: Path) -> dict[str, str]:
    found = {}
    if out_dir.is_dir():
        for p in sorted(out_dir.iterdir()):
            if p.is_file() and p.suffix == ".py":
                found[p.name] = p.read_text("utf-8")
    return found


def write(out_dir: Path, files: dict[str, str]) -> list[str]:
    """Atomically write changed files and delete orphans; return the names touched."""
    out_dir.mkdir(parents=True, exist_ok=True)
    current = _existing(out_dir)
    touched = []
    for name, text in sorted(files.items()):
        if current.get(name) == text:
            continue
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.replace(tmp, out_dir / name)
        touched.append(name)
    for name in sorted(set(current) - set(files)):
        (out_dir / name).unlink()
        touched.append(name)
    return touched


def diff(out_dir: Path, files: dict[str, str]) -> list[str]:
    """Unified diffs for every file that differs, is missing, or should not be there."""
    current = _existing(out_dir)
    out = []
    for name in sorted(set(files) | set(current)):
        old, new = current.get(name), files.get(name)
        if old == new:
            continue
        label = f"{out_dir.name}/{name}"
        if new is None:
            out.append(f"{label}: orphan file, not produced by the spec\n")
            continue
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
    return out
