"""Closed tables the spec may name: dtypes and memory kinds.

These mirror what ``bufc.runtime`` implements; a test checks the two stay in step. They live
here (and not in the runtime) because generating must not need torch. The step sizes are
``bufc.requests.sizes``; the fill rules are declared in ``rules/builtin.yaml``.
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

# The pad policy that repeats a tensor's last written element past the step (cumulative
# tensors: query_start_loc, 1-based last_token_ids), instead of a constant.
REPEAT_LAST = "repeat_last"
# What a rule may require of its tensors' padded rows (the rule's `pads`), and why each matters.
PAD_KINDS: dict[str, str] = {
    "repeat_last": "repeat the last value (a cumulative or 1-based index: a constant would make "
    "a padded row's count negative or point before the first row)",
    "negative": "hold a negative value (a skip: any other would alias a live slot)",
    "zero": "hold 0 (a padded sequence has nothing to read)",
    "nonnegative": "hold a valid index, 0 or more",
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

# bufc's own rule modules, imported as their last component (bufc.rules.core as `core`); the
# emitter gives them these names, and any other module that would take one gets another.
RULE_MODULES: frozenset[str] = frozenset(
    {
        "adapters",
        "core",
        "encoder_decoder",
        "features",
        "kv_offsets",
        "kv_rows",
        "paged_attention",
        "paged_device",
        "pools",
    }
)

# The fields and properties of the step record (bufc.runtime.step.Step): a step scalar is read
# as step.NAME, which these answer first (tests/test_generated_names.py compares the two).
STEP_FIELDS: frozenset[str] = frozenset(
    {"inputs", "outputs", "sizes", "scalars", "ring_slots", "mode"}
)

# The names a generated module (family.py.j2, and render_init's generated/__init__.py) binds or
# reads as plain names. The only names it binds that are not here are the spec's own: fields
# of Config, State, Checked and Advancing (parameters, derived values, checks, tensors) and the
# SET_* variables of index sets. A test checks every generated module against these sets.
#
# Module level: its imports, assignments and classes, and the builtins it reads. A spec name
# binds only in a class body (a dataclass field), where it shadows these for the rest of that
# body (a parameter 'dataclasses' with a default breaks the module's import): no declared name
# may take one (validate.py).
MODULE_NAMES: frozenset[str] = frozenset(
    {
        "annotations",
        "dataclasses",
        "rt",
        "typing",
        "Sequence",
        "batch",
        "decode",
        "stateless",
        "table",
        *RULE_MODULES,
        "StepSizes",
        "torch",
        "FAMILY",
        "FLAGS",
        "FAMILIES",  # generated/__init__.py
        "Config",
        "TENSORS",
        "State",
        "Checked",
        "Advancing",
        "RuntimeBuffers",
        "StepInputs",
        "property",  # read in StepInputs' body (its attributes)
        # builtins (formulas call min, max and len)
        "object",
        "int",
        "bool",
        "str",
        "tuple",
        "list",
        "dict",
        "len",
        "min",
        "max",
    }
)

# RuntimeBuffers' class attributes and the methods of the classes.
MEMBER_NAMES: frozenset[str] = frozenset(
    {
        "config_type",
        "sizes_type",
        "state_type",
        "tensor_decls",
        "sampled_tokens",
        "advances_on_device",
        "device_build",
        "device_tensors",
        "captures",
        "no_advance",
        "request_readers",
        "project_impls",
        "step_inputs",
        "__slots__",
        "__post_init__",
        "_limits",
        "_size_bounds",
        "_batch",
        "_in_flight",
        "_admit",
        "_check",
        "_fill",
        "_advance_check",
        "_advance",
        "_advance_on_device",
        "_device_fill",
        "_device_host_fill",
        "_device_scalars",
        "_scalars",
        "_capture",
    }
)

# The parameters and locals of the methods and lambdas (spec names are only ever attributes
# and keywords there: `c.max_batch_size`, `k.kv_blocks`, `t.host_input_ids`).
LOCAL_NAMES: frozenset[str] = frozenset(
    {
        "self",
        "errors",
        "context",
        "generation",
        "last",
        "tokens",
        "holds_run",
        "state",
        "scalars",
        "max_sequence_length",
        "index",
        "a",
        "b",
        "c",
        "d",
        "k",
        "p",
        "r",
        "s",
        "t",
        "v",
        "o",
    }
)

# Every one of them: an implementation module's import alias takes none (emit.py), or it would
# be shadowed where the name is bound (`from mypkg import state` by the local `state` of
# _check, `from mypkg import Config` by the class).
GENERATED_NAMES: frozenset[str] = MODULE_NAMES | MEMBER_NAMES | LOCAL_NAMES
