"""The ``bufc`` command (also ``python -m bufc.codegen``).

Exit status: 0 success, 1 invalid spec or stale generated/, 2 usage. Diagnostics go to stderr
as ``FILE:LINE:COL: message``; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from bufc import __version__

from . import emit, extend, files
from .contract_doc import PAGE_FAMILIES, family_tables, render_page
from .errors import SpecError
from .pipeline import Compiled, UnknownFamilies, compile_builtin, compile_file
from .report import PLOT_FORMATS, Report, ReportError, plot, report


def _spec(path: str, imports: bool = False, families: list[str] | None = None) -> Compiled:
    """`path` compiled (diagnostics name it as given; `imports`: the spec's own
    implementations imported), lowering `families` when given (a UsageError naming the
    families there are for one it lacks)."""
    try:
        return compile_file(path, display_name=path, imports=imports, families=families)
    except UnknownFamilies as exc:
        builtin = compile_builtin().family_names
        raise UsageError(
            extend.unknown_family(exc.names[0], path, exc.known, builtin)
            + "; --family picks among the spec's families (and those it extends)"
        ) from None


def _find(family: str, path: str | None, command: str) -> Compiled:
    """The spec a command reads `family` from, as report and contract find it: the project's
    (`path`, else ./buffers.yaml) when it has the family, else bufc's built-in spec (a note on
    stderr says so); a UsageError listing both when neither has it."""
    path = path or ("buffers.yaml" if Path("buffers.yaml").is_file() else None)
    own: tuple[str, ...] = ()
    if path is not None:
        compiled = _spec(path)
        if family in compiled.family_names:
            return compiled
        own = compiled.family_names
    builtin = compile_builtin()
    if family not in builtin.family_names:
        raise UsageError(
            extend.unknown_family(family, path or "no spec", own, builtin.family_names)
        )
    why = f"{path} has no family '{family}'" if path else "no --spec and no ./buffers.yaml"
    print(f"bufc {command}: {why}: reading bufc's built-in spec", file=sys.stderr)
    return builtin


def _generate(args: argparse.Namespace) -> int:
    # a project rule that cannot be called fails here
    spec = _spec(args.spec, imports=True, families=args.family)
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
    spec = _spec(args.spec, families=args.family)
    command = emit.regenerate_command(args.spec, args.out, args.family)
    if not Path(args.out).exists():  # not a diff of every file: maybe --out names the wrong one
        print(
            f"bufc check: {args.out} does not exist; give --out the folder that holds the "
            f"generated modules, or create it with '{command}'",
            file=sys.stderr,
        )
        return 1
    diffs = files.diff(Path(args.out), emit.render_all(spec, Path(args.spec).name))
    if diffs:
        sys.stdout.write("".join(diffs))
        print(f"{args.out}/ is out of date with {args.spec}; run '{command}'", file=sys.stderr)
        return 1
    print(f"{args.spec} is valid and {args.out}/ is up to date")
    return 0


def _contract(args: argparse.Namespace) -> int:
    if args.families:
        print(
            "\n\n".join(
                f"## {f}\n\n{family_tables(_find(f, args.spec, 'contract'), f)}"
                for f in args.families
            )
        )
        return 0
    args.spec = args.spec or "buffers.yaml"
    spec = _spec(args.spec)
    known = spec.family_names
    missing = [f for f in PAGE_FAMILIES if f not in known]
    if missing:
        raise UsageError(
            f"the contract page documents {', '.join(PAGE_FAMILIES)}; {args.spec} lacks "
            f"{', '.join(missing)}: name the families to print"
        )
    page = render_page(spec)
    if args.check is not None:
        if not _holds(Path(args.check), page.encode("utf-8")):
            print(
                f"{args.check} is out of date with {args.spec}; run 'bufc contract --spec "
                f"{args.spec} --out {args.check}'",
                file=sys.stderr,
            )
            return 1
        print(f"{args.check} is up to date")
        return 0
    if args.out is not None:
        Path(args.out).write_text(page, "utf-8")
        print(f"{args.out}: written")
        return 0
    sys.stdout.write(page)
    return 0


def _validate(args: argparse.Namespace) -> int:
    """Every file is checked, each with all its errors."""
    failed = 0
    for path in args.files:
        try:
            _spec(path, imports=args.imports)
        except SpecError as exc:
            _print_diagnostics(exc)
            failed += 1
        except OSError as exc:
            print(_os_error(exc), file=sys.stderr)
            failed += 1
        else:
            print(f"{path}: ok")
    return 1 if failed else 0


class UsageError(Exception):
    """A command line that cannot mean anything (exit status 2, as argparse's own errors)."""


def _settings(items: list[str] | None) -> dict[str, str]:
    settings = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set expects name=value, got '{item}'")
        settings[key.strip()] = value.strip()
    return settings


def _sweep(items: list[str] | None) -> tuple[str, list[str]] | None:
    if not items:
        return None
    if len(items) > 1:
        raise UsageError("--sweep takes one parameter; give it once")
    name, sep, values = items[0].partition("=")
    parts = [v.strip() for v in values.split(",")]
    if not sep or not name.strip() or not any(parts):
        raise UsageError(f"--sweep expects name=v1,v2,..., got '{items[0]}'")
    if not all(parts):
        raise UsageError(f"--sweep has an empty value: '{items[0]}'")
    return name.strip(), parts


def _report(args: argparse.Namespace) -> int:
    settings = _settings(args.set)
    sweep = _sweep(args.sweep)
    if args.plot and sweep is None:
        raise UsageError("--plot draws a sweep; give --sweep name=v1,v2,...")
    if args.plot and Path(args.plot).suffix.lower().lstrip(".") not in PLOT_FORMATS:
        raise UsageError(
            f"--plot {args.plot}: name a file ending in one of "
            f"{', '.join('.' + f for f in PLOT_FORMATS)}"
        )
    spec = _find(args.family, args.spec, "report")

    def build(s: dict[str, str]) -> Report:
        return report(spec, args.family, s, imports=args.imports)

    if sweep is not None:
        name, values = sweep
        points = [(v, build({**settings, name: v})) for v in values]
    else:
        points = [("", build(settings))]
    if args.plot:
        plot(points, name, args.plot)
        print(  # a note, not the result: stdout stays the table or the JSON
            f"{args.plot}: memory of family {args.family} over {name} ({len(points)} points)",
            file=sys.stderr,
        )
    if args.json:
        data = (
            points[0][1].json()
            if sweep is None
            else {"sweep": name, "points": [{"value": v, **r.json()} for v, r in points]}
        )
        print(json.dumps(data, indent=2))
    elif not args.plot:
        for value, r in points:
            if sweep is not None:
                print(f"== {name}={value}")
            sys.stdout.write(r.text())
    return 0


def _print_diagnostics(exc: SpecError) -> None:
    for d in exc.diagnostics:
        print(d, file=sys.stderr)
    print(f"{len(exc.diagnostics)} error(s)", file=sys.stderr)


def _os_error(exc: OSError) -> str:
    name = exc.filename
    where = f"{ascii(str(name))[1:-1]}: " if name not in (None, "") else ""
    if name == "":
        where = "'': "
    return f"bufc: {where}{exc.strerror or exc}"


def _schema(args: argparse.Namespace) -> int:
    path = resources.files("bufc.schema").joinpath("buffers.schema.json")
    if args.path:
        print(path)
    else:
        sys.stdout.write(path.read_text("utf-8"))
    return 0


def _demo(argv: list[str]) -> int:
    from bufc.examples.demo import main as demo_main  # torch and transformers, only here

    return demo_main(argv)


def _folder(text: str) -> str:
    """An --out folder: a blank one (an unset `--out "$OUT"`) would mean the current
    directory, whose generated files the spec does not produce would be deleted."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a folder, got {text!r}")
    return text


class _Formatter(argparse.HelpFormatter):
    """argparse's, but an epilog of examples keeps its lines (one command each)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:\n"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


EXAMPLES = {
    "generate": [
        "bufc generate                                  # buffers.yaml -> generated/",
        "bufc generate --spec buffers.yaml --out mypkg/buffers",
        "bufc generate --out mypkg/buffers --family llama_flash   # one family alone",
    ],
    "check": [
        "bufc check --spec buffers.yaml --out mypkg/buffers   # exit 1 when stale (CI)",
    ],
    "validate": [
        "bufc validate buffers.yaml",
        "bufc validate --import specs/*.buffers.yaml   # also import the project's rules",
    ],
    "report": [
        "bufc report llama --set max_batch_size=64 --set max_num_tokens=8192 \\",
        "    --set vocab_size=32000 --set num_layers=32 --set max_attention_window=4096",
        "bufc report llama ... --sweep max_batch_size=8,64,256 --plot memory.svg",
        "bufc report my_family ... --import   # runs the spec's own derive: functions",
    ],
    "contract": [
        "bufc contract llama_flash                      # its bound tensors, as tables",
        "bufc contract --out docs/contract.md           # bufc's own contract page",
    ],
    "schema": [
        "bufc schema --path                             # for '# yaml-language-server: $schema=...'",
    ],
}


def _examples(command: str) -> str:
    return "examples:\n" + "".join(f"  {line}\n" for line in EXAMPLES[command])


def _add_report(sub: Any) -> None:
    """The report subcommand's parser."""
    r = sub.add_parser(
        "report",
        epilog=_examples("report"),
        formatter_class=_Formatter,
        help="tensors, shapes and bytes of a family for given parameters",
        description="Every tensor a family allocates for the given parameters, with dtype, "
        "memory kind, capacity, bytes, fill and engine bindings, and the totals per memory "
        "kind. Reads the project's spec (--spec, or ./buffers.yaml) when it has the family, "
        "else bufc's built-in spec (saying so on stderr); needs no torch. A spec's own "
        "derive: functions run only with --import.",
    )
    r.add_argument("family")
    r.add_argument(
        "--set", action="append", metavar="NAME=VALUE", help="a construct-time parameter"
    )
    r.add_argument(
        "--spec",
        default=None,
        help="the spec file (default: ./buffers.yaml if present; a family it lacks is read "
        "from bufc's built-in spec)",
    )
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.add_argument(
        "--import",
        dest="imports",
        action="store_true",
        help="also run the spec's own derive: functions (their modules are imported: their "
        "code runs); without it a value that needs one is an error naming it",
    )
    r.add_argument(
        "--sweep",
        action="append",
        metavar="NAME=V1,V2,...",
        help="report once per value of one parameter",
    )
    r.add_argument(
        "--plot",
        metavar="FILE",
        help="draw memory per tensor and memory kind over --sweep into FILE (.svg, .png or "
        ".pdf; needs matplotlib, bufc's [plot] extra)",
    )
    r.set_defaults(run=_report)


def _add_contract(sub: Any) -> None:
    """The contract subcommand's parser."""
    k = sub.add_parser(
        "contract",
        epilog=_examples("contract"),
        formatter_class=_Formatter,
        help="the engine contract: each family's bound tensors, pads and step scalars",
        description="Print the tensors each named family binds (engine name, direction, dtype, "
        "memory, step shape, pad policy, meaning) and its step scalars, as markdown tables. "
        "Without families, bufc's own contract page (docs/contract.md): --out writes it, "
        "--check exits 1 when the file differs.",
    )
    k.add_argument("families", nargs="*", metavar="FAMILY")
    k.add_argument(
        "--spec",
        default=None,
        help="the spec file (default: ./buffers.yaml; a family it lacks is read from bufc's "
        "built-in spec)",
    )
    where = k.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="FILE", help="write the contract page to FILE")
    where.add_argument("--check", metavar="FILE", help="exit 1 if FILE is not the page")
    k.set_defaults(run=_contract)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bufc",
        description="Compile buffers.yaml into runtime buffer modules.",
        epilog="Exit status: 0 success; 1 an invalid spec, a stale output folder or a failed "
        "report; 2 a usage error. Results go to stdout, diagnostics to stderr as "
        "FILE:LINE:COL: message. Output has no colour.",
    )
    p.add_argument("--version", action="version", version=f"bufc {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def with_spec(sp: argparse.ArgumentParser, out: bool = True) -> None:
        sp.add_argument(
            "--spec", default="buffers.yaml", help="the spec file (default: buffers.yaml)"
        )
        sp.add_argument(
            "--family",
            action="append",
            metavar="NAME",
            help="only this family (repeatable): the output folder holds these alone; default: "
            "every family the spec defines (with 'extends: bufc', its own, not bufc's)",
        )
        if out:
            sp.add_argument(
                "--out",
                default="generated",
                type=_folder,
                help="the output folder (default: generated)",
            )

    g = sub.add_parser(
        "generate",
        epilog=_examples("generate"),
        formatter_class=_Formatter,
        help="write generated/ from the spec",
        description="Write one module per family of the spec into the output folder (a spec "
        "with 'extends: bufc': its own families; --family picks), only the files that changed. Files bufc did not write (no '# @generated by bufc.codegen' "
        "first line) are never overwritten or deleted; generated files the spec no longer "
        "produces are deleted, and named. Each implementation the spec's own rules and request "
        "checks name is imported (from the installed packages and the current directory) and "
        "its signature checked first; bufc's own rules are not imported.",
    )
    with_spec(g)
    g.set_defaults(run=_generate)
    c = sub.add_parser(
        "check",
        epilog=_examples("check"),
        formatter_class=_Formatter,
        help="validate the spec and fail if generated/ is stale",
        description="Validate the spec and compare the output folder with what generate would "
        "write: exit 1, with a diff on stdout and the command that regenerates on stderr, "
        "when it differs (one line on stderr when the folder does not exist).",
    )
    with_spec(c)
    c.set_defaults(run=_check)
    v = sub.add_parser(
        "validate",
        epilog=_examples("validate"),
        formatter_class=_Formatter,
        help="validate spec files",
        description="Check each spec file and report every error of each as FILE:LINE:COL: "
        "message; exit 1 if any file has one. No code of the project is imported, unless "
        "--import is given.",
    )
    v.add_argument("files", nargs="+", metavar="FILE", help="a buffers.yaml to check")
    v.add_argument(
        "--import",
        dest="imports",
        action="store_true",
        help="also import each implementation the spec's own rules and request checks name "
        "(their code runs) and check its signature against its declaration, as generate does",
    )
    v.set_defaults(run=_validate)
    _add_report(sub)
    _add_contract(sub)
    s = sub.add_parser(
        "schema",
        epilog=_examples("schema"),
        formatter_class=_Formatter,
        help="the JSON Schema of buffers.yaml (for editors)",
        description="Print the installed JSON Schema's path or its text. Point an editor at "
        "it, e.g. with the first line '# yaml-language-server: $schema=PATH' in a spec.",
    )
    how = s.add_mutually_exclusive_group(required=True)
    how.add_argument("--path", action="store_true", help="print the schema file's path")
    how.add_argument("--print", action="store_true", help="print the schema itself")
    s.set_defaults(run=_schema)
    # `bufc demo ...` is dispatched before parsing (its options are the demo's own)
    sub.add_parser(
        "demo",
        help="serve a workload with a real model and compare with transformers.generate "
        "(needs torch and transformers; bufc demo --help lists its options)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    args = parser().parse_args(argv)
    try:
        return int(args.run(args))
    except SpecError as exc:
        _print_diagnostics(exc)
        return 1
    except ReportError as exc:
        print(f"bufc report: {exc}", file=sys.stderr)
        return 1
    except UsageError as exc:
        print(f"bufc {args.command}: {exc}", file=sys.stderr)
        return 2
    except files.OutputError as exc:
        print(f"bufc {args.command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (bufc schema --print | head)
        sys.stderr.close()
        return 1
    except OSError as exc:
        print(_os_error(exc), file=sys.stderr)
        return 1


def _holds(path: Path, data: bytes) -> bool:
    """`path` is a file holding exactly `data` (read no further than that: a file that is not
    the page, binary or endless, is only out of date)."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(len(data) + 1) == data
