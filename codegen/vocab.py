"""Closed tables the spec may name: dtypes and memory kinds.

These mirror what ``bufc.runtime`` implements; a test checks the two stay in step. They live
here (and not in the runtime) because generating must not need torch. The step sizes are
``bufc.rules.sizes``; the fill rules are declared in ``rules/builtin.yaml``.
"""

from __future__ import annotations

# spec dtype -> torch attribute (printed from this table, never from the user's text)
DTYPES: dict[str, str] = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int32": "int32",
    "int64": "int64",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float64": "float64",
}

DTYPE_BYTES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}

# Integer parameters must stay below this (the generated Config checks it): sane sizes, and
# formulas over them stay far from overflowing what the generator evaluates.
INT_LIMIT = 1 << 62

# The values each dtype holds: a pad or constant fill outside them would fail or wrap around
# (integers) or become infinite (floats: their largest finite value).
DTYPE_RANGES: dict[str, tuple[int, int]] = {
    "bool": (0, 1),
    "uint8": (0, 255),
    "int8": (-128, 127),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "float16": (-65504, 65504),
    "bfloat16": (-(2**128 - 2**120), 2**128 - 2**120),
    "float32": (-(2**128 - 2**104), 2**128 - 2**104),
    "float64": (-(2**1024 - 2**971), 2**1024 - 2**971),
}

# spec memory kind -> runtime constant name
MEMORY_KINDS: dict[str, str] = {"device": "DEVICE", "host": "HOST", "pinned": "PINNED"}
