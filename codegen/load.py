"""Strict YAML loading with a position for every value.

PyYAML's safe loader is lenient in ways that hurt a spec file: duplicate keys silently keep the
last value, aliases allow billion-laughs documents, and YAML 1.1 turns a key like ``on`` into a
boolean. This loader composes the node tree once, rejects all three, and returns plain data plus
a side table mapping each JSON path to its 1-based ``Location``, so that later phases (JSON
Schema, semantic checks) can point at the exact line and column.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import yaml

from .errors import Collector, Diagnostic, Location, SpecError

MAX_BYTES = 1 << 20  # a spec file is hand-written; anything larger is a mistake or an attack
MAX_NESTING = 32  # levels of YAML collections (the real spec uses 6); deeper is a mistake

Path = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class Document:
    """Loaded spec data with positions: ``locs[path]`` is the value's start, ``key_locs[path]``
    the start of the mapping key that introduced it."""

    file: str
    data: Any
    locs: dict[Path, Location]
    key_locs: dict[Path, Location]

    def loc(self, path: Path) -> Location:
        """The position of `path`, or of its nearest ancestor that has one."""
        while path not in self.locs and path:
            path = path[:-1]
        return self.locs.get(path, Location(self.file, 1, 1))

    def key_loc(self, path: Path) -> Location:
        return self.key_locs.get(path) or self.loc(path)


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors and aliases while composing, and nesting deeper than
    MAX_NESTING (PyYAML composes recursively: ~330 levels would end in a RecursionError)."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:  # noqa: ANN401 - PyYAML API
        if self._depth >= MAX_NESTING:
            raise yaml.MarkedYAMLError(
                problem=f"the YAML nests deeper than {MAX_NESTING} levels",
                problem_mark=self.peek_event().start_mark,
            )
        self._depth += 1
        try:
            return self._compose_node(parent, index)
        finally:
            self._depth -= 1

    def _compose_node(self, parent: Any, index: Any) -> Any:  # noqa: ANN401 - PyYAML API
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.MarkedYAMLError(
                problem="aliases (*name) are not allowed in a buffer spec; write the value out",
                problem_mark=event.start_mark,
            )
        event = self.peek_event()
        if getattr(event, "anchor", None) is not None:
            raise yaml.MarkedYAMLError(
                problem="anchors (&name) are not allowed in a buffer spec; write the value out",
                problem_mark=event.start_mark,
            )
        return super().compose_node(parent, index)


# An integer as a buffer spec writes one: decimal digits. YAML 1.1 also reads octal (010 is 8),
# base 60 (1:04 is 64), hex, binary and digits with underscores as integers.
_DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_MOST_DIGITS = 4000  # Python refuses to read an int of more than 4300 digits

# PyYAML's scanner and parser messages, in the house style: what is wrong and what to do.
_PLAIN = (
    (
        "expected a single document",
        "",
        "only one YAML document is allowed (remove the '---' separator)",
    ),
    (
        "mapping values are not allowed here",
        "",
        "a ':' here cannot start a key: check this line's indentation, or quote a value that "
        "contains ': '",
    ),
    (
        "expected <block end>",
        "",
        "this line does not fit the mapping or list above it: check its indentation (the keys "
        "of one mapping and the items of one list start at the same column), or remove text "
        "after a quoted value",
    ),
    ("found character '\\t'", "", "a tab cannot indent YAML; indent with spaces"),
    ("found unexpected end of stream", "quoted scalar", "this quoted string is never closed"),
    ("but got '<stream end>'", "flow sequence", "this list ('[') is never closed with ']'"),
    ("but got '<stream end>'", "flow mapping", "this mapping ('{') is never closed with '}'"),
    ("found '<stream end>'", "flow node", "a list ('[') or mapping ('{') is never closed"),
    (
        "expected ',' or '}'",
        "",
        "unexpected text inside '{...}': quote a value that contains ': ', and separate the "
        "entries with ','",
    ),
    (
        "expected ',' or ']'",
        "",
        "unexpected text inside '[...]': quote a value that contains ': ' or ', '",
    ),
    ("could not find expected ':'", "", "a key on this line has no ':' after it"),
    (
        "that cannot start any token",
        "",
        "this character cannot start a plain value; quote the value",
    ),
)


def _plain(problem: str, context: str) -> str:
    for needle, where, sentence in _PLAIN:
        if needle in problem + " " + context and where in context:
            return sentence
    return " ".join(f"{problem} ({context})".split()) if context else problem


def _mark(file: str, mark: Any) -> Location:
    return Location(file, mark.line + 1, mark.column + 1)


def _offset(file: str, text: str, offset: int) -> Location:
    """The 1-based line and column of character `offset` of `text`."""
    before = text[:offset]
    line = before.count("\n") + 1
    return Location(file, line, offset - (before.rfind("\n") + 1) + 1)


def decode(data: bytes, file: str) -> str:
    """`data` as UTF-8 text; SpecError at the first byte that is not UTF-8 (a binary or
    latin-1 file) or when the file is larger than MAX_BYTES."""
    if len(data) > MAX_BYTES:
        raise SpecError([Diagnostic(Location(file, 1, 1), _too_large())])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        good = data[: exc.start].decode("utf-8")
        loc = _offset(file, good, len(good))
        bad = data[exc.start : exc.start + 1].hex()
        raise SpecError(
            [Diagnostic(loc, f"the file is not UTF-8 text (byte 0x{bad}); save it as UTF-8")]
        ) from None


def _too_large() -> str:
    return f"file is larger than {MAX_BYTES} bytes"


def read(path: str, file: str) -> str:
    """Read at most MAX_BYTES + 1 bytes of `path` (a device such as /dev/zero never ends) and
    decode them; SpecError (shown as `file`) when the file is too large or not UTF-8."""
    with open(path, "rb") as fh:
        data = fh.read(MAX_BYTES + 1)
    return decode(data, file)


def load_text(text: str, file: str) -> Document:
    """Parse `text` (the contents of `file`); raise SpecError with every problem found."""
    errors = Collector()
    if len(text) > MAX_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        errors.error(Location(file, 1, 1), _too_large())
        errors.raise_if_any()
    root = _compose(text, file)
    if root is None:
        errors.error(Location(file, 1, 1), "the file is empty; a spec needs at least 'version'")
        errors.raise_if_any()
    builder = _Builder(file, errors)
    data = builder.walk(root, ())
    builder.constructor.dispose()
    errors.raise_if_any()
    return Document(file=file, data=data, locs=builder.locs, key_locs=builder.key_locs)


def _compose(text: str, file: str) -> yaml.Node | None:
    """The node tree of `text` (None for an empty document); SpecError, located where the
    user can fix it, for text that is not YAML or uses what a spec refuses."""
    loader: _NoAliasLoader | None = None
    try:
        loader = _NoAliasLoader(text)  # checks every character first
        return loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        # an unclosed string, list or mapping is found at the end of the file: point at its start
        unclosed = any(
            w in (exc.context or "") for w in ("quoted scalar", "flow sequence", "flow mapping")
        )
        mark = (exc.context_mark if unclosed else None) or exc.problem_mark or exc.context_mark
        loc = _mark(file, mark) if mark else Location(file, 1, 1)
        problem = _plain(exc.problem or "invalid YAML", exc.context or "")
        raise SpecError([Diagnostic(loc, problem)]) from exc
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (NUL, ...)
        char = exc.character if isinstance(exc.character, str) else chr(exc.character)
        raise SpecError(
            [
                Diagnostic(
                    _offset(file, text, exc.position),
                    f"character {char!r} (U+{ord(char):04X}) is not allowed in a YAML file",
                )
            ]
        ) from exc
    except yaml.YAMLError as exc:  # pragma: no cover - PyYAML raises marked errors for text
        raise SpecError([Diagnostic(Location(file, 1, 1), " ".join(str(exc).split()))]) from exc
    finally:
        if loader is not None:
            loader.dispose()


@dataclasses.dataclass(frozen=True)
class _Builder:
    """Plain data from a composed node tree, recording where each value and key starts;
    problems go to `errors` (all of them are reported, after the whole tree is walked)."""

    file: str
    errors: Collector
    locs: dict[Path, Location] = dataclasses.field(default_factory=dict)
    key_locs: dict[Path, Location] = dataclasses.field(default_factory=dict)
    # only used to resolve and construct scalar values
    constructor: yaml.SafeLoader = dataclasses.field(default_factory=lambda: yaml.SafeLoader(""))

    def explicit_tag(self, node: yaml.Node) -> bool:
        """True for a node whose tag was written (!!int "1", !!set {...}) rather than read
        from its text: a spec's values mean what they say."""
        if isinstance(node, yaml.MappingNode):
            return node.tag != "tag:yaml.org,2002:map"
        if isinstance(node, yaml.SequenceNode):
            return node.tag != "tag:yaml.org,2002:seq"
        plain = node.style is None
        return node.tag != self.constructor.resolve(yaml.ScalarNode, node.value, (plain, not plain))

    def walk(self, node: yaml.Node, path: Path) -> Any:
        file, errors = self.file, self.errors
        loc = _mark(file, node.start_mark)
        if isinstance(node, yaml.ScalarNode) and node.style in ("'", '"'):
            loc = loc.shifted(1)  # point at the text, so formula columns line up
        self.locs[path] = loc
        if self.explicit_tag(node) and node.tag != "tag:yaml.org,2002:merge":
            errors.error(
                _mark(file, node.start_mark),
                f"tag '{node.tag.removeprefix('tag:yaml.org,2002:')}' is not allowed in a buffer "
                "spec; write the value without it",
            )
            return None
        if isinstance(node, yaml.MappingNode):
            return self.mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            return [self.walk(item, (*path, i)) for i, item in enumerate(node.value)]
        if node.tag == "tag:yaml.org,2002:timestamp":
            errors.error(
                _mark(file, node.start_mark),
                f"'{node.value}' reads as a date and time; quote it for the text",
            )
            return None
        if node.tag == "tag:yaml.org,2002:bool" and node.value.lower() not in ("true", "false"):
            errors.error(
                _mark(file, node.start_mark),
                f"'{node.value}' is a YAML 1.1 boolean; write true or false (or quote it for "
                "the text)",
            )
            return None
        if node.tag == "tag:yaml.org,2002:int" and not _DECIMAL.fullmatch(node.value):
            errors.error(
                _mark(file, node.start_mark),
                f"'{node.value}' reads as a YAML 1.1 integer (octal, base 60, hex, binary or "
                "with '_'); write it in decimal digits (or quote it for the text)",
            )
            return None
        if node.tag == "tag:yaml.org,2002:int" and len(node.value) > _MOST_DIGITS:
            errors.error(
                _mark(file, node.start_mark),
                f"this integer has {len(node.value.lstrip('+-'))} digits; a buffer spec's "
                f"numbers have at most {_MOST_DIGITS}",
            )
            return None
        try:
            return self.constructor.construct_object(node, deep=True)
        except yaml.YAMLError:
            errors.error(
                _mark(file, node.start_mark), f"tag '{node.tag}' is not allowed in a buffer spec"
            )
            return None

    def mapping(self, node: yaml.MappingNode, path: Path) -> dict[str, Any]:
        """A mapping with string keys only, each once (merge keys refused)."""
        file, errors = self.file, self.errors
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                errors.error(_mark(file, key_node.start_mark), "merge keys (<<) are not allowed")
                continue
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                shown = key_node.value if isinstance(key_node, yaml.ScalarNode) else "..."
                why = (
                    " (YAML 1.1 reads on/off/yes/no as booleans)"
                    if key_node.tag == "tag:yaml.org,2002:bool"
                    else ""
                )
                errors.error(
                    _mark(file, key_node.start_mark),
                    f"key {shown!r} is not a string; quote it{why}",
                )
                continue
            key = key_node.value
            if key in out:
                first = self.key_locs[(*path, key)]
                errors.error(
                    _mark(file, key_node.start_mark),
                    f"duplicate key '{key}' (first defined at line {first.line})",
                )
                continue
            self.key_locs[(*path, key)] = _mark(file, key_node.start_mark)
            out[key] = self.walk(value_node, (*path, key))
        return out


def load_file(path: str, display_name: str | None = None) -> Document:
    file = display_name or path
    return load_text(read(path, file), file)
