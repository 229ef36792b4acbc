"""Structural validation against ``schema/buffers.schema.json``, with located messages.

jsonschema knows only JSON paths; we map each error back to ``FILE:LINE:COL`` through the
loader's position table, and rewrite the few messages whose default text is unhelpful.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from .errors import Diagnostic, did_you_mean
from .load import Document

if TYPE_CHECKING:  # jsonschema is imported where it is used: `bufc demo` runs without it
    from jsonschema.exceptions import ValidationError

_FILL_HELP = (
    "fill must be 'engine', 'external' or 'static', or one of {rule: NAME}, {mirror: TENSOR}, "
    "{constant: FORMULA}"
)


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    text = resources.files("bufc.schema").joinpath("buffers.schema.json").read_text("utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def _describe(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
        type(None): "nothing",
    }.get(type(value), "a value")


# rule keys an earlier format had, and what to do about each
REMOVED_RULE_KEYS = {
    key: f"'{key}' is no longer a rule key: every in-flight step runs the rule's fill (no "
    "continue forms since generated format 6); drop this key and its function"
    for key in ("continue", "continue_check")
}


def _diagnostics(doc: Document, err: ValidationError) -> list[Diagnostic]:
    path = tuple(err.absolute_path)
    loc = doc.loc(path)
    kind = err.validator
    where = (
        "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        or "the document"
    )
    if kind == "additionalProperties" and isinstance(err.instance, dict):
        allowed = set(err.schema.get("properties", {}))
        out = []
        for key in sorted(set(err.instance) - allowed):
            if len(path) == 2 and path[0] == "rules" and key in REMOVED_RULE_KEYS:
                out.append(Diagnostic(doc.key_loc((*path, key)), REMOVED_RULE_KEYS[key]))
                continue
            hint = did_you_mean(key, allowed)
            keys = ", ".join(sorted(allowed))
            out.append(
                Diagnostic(
                    doc.key_loc((*path, key)),
                    f"unknown key '{key}' in {where}{hint}; allowed keys: {keys}",
                )
            )
        if out:
            return out
    if kind == "required":
        missing = err.message.split("'")[1] if "'" in err.message else err.message
        return [Diagnostic(loc, f"{where} is missing the required key '{missing}'")]
    if kind == "enum":
        options = [str(o) for o in err.validator_value]
        hint = did_you_mean(str(err.instance), options)
        return [Diagnostic(loc, f"{err.instance!r} is not one of {', '.join(options)}{hint}")]
    if kind == "type":
        want = (
            err.validator_value if isinstance(err.validator_value, list) else [err.validator_value]
        )
        names = {
            "string": "a string",
            "integer": "an integer",
            "object": "a mapping",
            "array": "a list",
            "boolean": "true or false",
        }
        expected = " or ".join(names.get(str(w), str(w)) for w in want)
        return [Diagnostic(loc, f"{where} must be {expected}, not {_describe(err.instance)}")]
    if kind == "pattern" and "propertyNames" in err.absolute_schema_path:
        kind = "propertyNames"  # the instance is the offending key itself
    if kind == "pattern":
        if err.validator_value.startswith("^[a-z]"):
            msg = f"{err.instance!r} is not a valid name: use a lower-case ASCII letter, then letters, digits or '_'"
        elif err.validator_value.startswith("^[A-Za-z_]"):
            msg = f"{err.instance!r} is not a valid engine tensor name"
        else:
            msg = f"{where} must be one line of printable ASCII"
        return [Diagnostic(loc, msg)]
    if kind == "propertyNames":
        # the instance is the offending key; point at it
        return [
            Diagnostic(
                doc.key_loc((*path, err.instance)),
                f"{err.instance!r} is not a valid name: use a lower-case ASCII letter, "
                "then letters, digits or '_'",
            )
        ]
    if kind == "oneOf" and path and path[-1] == "fill":
        return [Diagnostic(loc, _FILL_HELP)]
    if kind == "oneOf" and path and path[-1] == "pad":
        if type(err.instance) is int:  # an integer past int32 (a YAML bool is not one)
            return [
                Diagnostic(
                    loc,
                    f"{where} {err.instance} is outside the int32 range: a constant pad needs "
                    "an integer in -2147483648..2147483647 (or repeat_last, the last written "
                    "element repeated)",
                )
            ]
        return [
            Diagnostic(
                loc,
                f"{where} must be an integer in the int32 range (a constant) or repeat_last "
                f"(the last written element repeated), not {_describe(err.instance)}",
            )
        ]
    if kind == "oneOf" and len(path) >= 2 and path[-2] == "index_sets":
        return [
            Diagnostic(
                loc,
                "an index set takes either 'names' (a names parameter) or 'first' and 'count' "
                "(plus an optional 'where')",
            )
        ]
    if kind == "oneOf" and len(path) >= 2 and path[-2] == "derived":
        return [
            Diagnostic(
                loc,
                "a derived value takes exactly one of 'value' (a formula) or 'derive' "
                "(MODULE:NAME, with optional 'reads' and 'type')",
            )
        ]
    if kind == "oneOf":
        return [
            Diagnostic(
                loc,
                "a binding names exactly one of 'input' or 'output' "
                "(plus optional 'when' and 'each')",
            )
        ]
    if kind == "const":
        return [Diagnostic(loc, f"{where} must be {err.validator_value!r}")]
    if kind == "maxLength":
        return [Diagnostic(loc, f"{where} is longer than {err.validator_value} characters")]
    message = err.message if len(err.message) <= 200 else err.message[:197] + "..."
    return [Diagnostic(loc, f"{where}: {message}")]


def check_document(doc: Document, *, rules_only: bool = False) -> list[Diagnostic]:
    """Every schema violation in `doc`, located. `rules_only`: a file of rules and request
    checks alone (bufc's rules/builtin.yaml), which needs no families or tensors."""
    import jsonschema

    full = schema()
    validator = jsonschema.Draft202012Validator(
        {**{k: v for k, v in full.items() if k not in ("if", "then")}, "required": ["version"]}
        if rules_only
        else full
    )
    out: list[Diagnostic] = []
    for err in validator.iter_errors(doc.data):
        out.extend(_diagnostics(doc, err))
    return sorted(set(out))
