"""The ``bufc`` command (also ``python -m bufc.codegen``).

Exit status: 0 success, 1 invalid spec or stale generated/, 2 usage. Diagnostics go to stderr
as ``FILE:LINE:COL: message``; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import emit, files
from .errors import SpecError
from .pipeline import compile_file
from .report import ReportError, report


def _spec(path: str):  # noqa: ANN202 - returns Spec
    return compile_file(
        path, display_name=Path(path).name if not Path(path).is_absolute() else path
    )


def _generate(args: argparse.Namespace) -> int:
    spec = _spec(args.spec)
    written, deleted = files.write(Path(args.out), emit.render_all(spec, Path(args.spec).name))
    print(
        f"{args.out}: {len(written)} file(s) updated"
        + (f" ({', '.join(written)})" if written else "")
    )
    if deleted:
        print(
            f"{args.out}: deleted {len(deleted)} generated file(s) the spec no longer produces "
            f"({', '.join(deleted)})"
        )
    return 0


def _check(args: argparse.Namespace) -> int:
    spec = _spec(args.spec)
    diffs = files.diff(Path(args.out), emit.render_all(spec, Path(args.spec).name))
    if diffs:
        sys.stdout.write("".join(diffs))
        print(f"{args.out}/ is out of date with {args.spec}; run 'make generate'", file=sys.stderr)
        return 1
    print(f"{args.spec} is valid and {args.out}/ is up to date")
    return 0


def _validate(args: argparse.Namespace) -> int:
    for path in args.files:
        _spec(path)
        print(f"{path}: ok")
    return 0


def _report(args: argparse.Namespace) -> int:
    settings = {}
    for item in args.set or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise ReportError(f"--set expects name=value, got '{item}'")
        settings[key.strip()] = value.strip()
    sys.stdout.write(report(_spec(args.spec), args.family, settings))
    return 0


def _demo(argv: list[str]) -> int:
    from bufc.examples.demo import main as demo_main  # torch and transformers, only here

    return demo_main(argv)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bufc", description="Compile buffers.yaml into runtime buffer modules."
    )
    sub = p.add_subparsers(dest="command", required=True)

    def with_spec(sp: argparse.ArgumentParser, out: bool = True) -> None:
        sp.add_argument(
            "--spec", default="buffers.yaml", help="the spec file (default: buffers.yaml)"
        )
        if out:
            sp.add_argument(
                "--out", default="generated", help="the output folder (default: generated)"
            )

    g = sub.add_parser("generate", help="write generated/ from the spec")
    with_spec(g)
    g.set_defaults(run=_generate)
    c = sub.add_parser("check", help="validate the spec and fail if generated/ is stale")
    with_spec(c)
    c.set_defaults(run=_check)
    v = sub.add_parser("validate", help="validate spec files")
    v.add_argument("files", nargs="+")
    v.set_defaults(run=_validate)
    r = sub.add_parser("report", help="tensors, shapes and bytes of a family for given parameters")
    r.add_argument("family")
    r.add_argument(
        "--set", action="append", metavar="NAME=VALUE", help="a construct-time parameter"
    )
    with_spec(r, out=False)
    r.set_defaults(run=_report)
    # `bufc demo ...` is dispatched before parsing (its options are the demo's own)
    sub.add_parser("demo", help="serve a workload with a real model (needs torch, transformers)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    args = parser().parse_args(argv)
    try:
        return int(args.run(args))
    except SpecError as exc:
        for d in exc.diagnostics:
            print(d, file=sys.stderr)
        print(f"{len(exc.diagnostics)} error(s)", file=sys.stderr)
        return 1
    except ReportError as exc:
        print(f"bufc report: {exc}", file=sys.stderr)
        return 1
    except files.NotGeneratedError as exc:
        print(f"bufc generate: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"bufc: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 1
