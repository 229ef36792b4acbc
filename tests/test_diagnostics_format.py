"""The diagnostics of the format extensions of issue 5 (additional outputs, flag and names
parameters, index sets, bindings, dtype parameters): one edited spec and its exact messages.

Every message starts with FILE:LINE:COL (1-based), so the positions are asserted too.
"""

from __future__ import annotations

import pytest
from diagnostics_spec import BASE, diagnostics

# ---- the format extensions of issue 5: one edited spec and its exact messages each
FORMAT_CASES = [
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a:\n    doc: A.\n    flags: {variant: a}\n    additional_outputs:\n      ids: {doc: Ids., dtype: int32}\n\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        [
            "buffers.yaml:16:7: additional output 'ids' of family 'fam_a' has the name of a tensor; name it after the engine output, differently from every tensor"
        ],
        id="outputnamedliketensor",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a:\n    doc: A.\n    flags: {variant: a}\n    additional_outputs:\n      input_ids: {doc: Ids., dtype: int32}\n\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - output: input_ids\n',
        [
            "buffers.yaml:16:7: engine output 'input_ids' is bound by both 'ids' (line 26) and 'input_ids' in family 'fam_a'; make their 'when' conditions exclusive"
        ],
        id="outputcollides",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a:\n    doc: A.\n    flags: {variant: a}\n    additional_outputs:\n      extra: {doc: Extra., dtype: int31, dims: ["max_batch_size"]}\n\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        [
            "buffers.yaml:16:7: additional output 'extra': unknown dtype 'int31' (did you mean 'int32'?)"
        ],
        id="outputdtype",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\n  paged: {doc: Paged., type: bool, default: \'yes\'}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        ["buffers.yaml:4:3: default of boolean flag 'paged' must be true or false"],
        id="flagdefaultbool",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b], default: c}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        ["buffers.yaml:3:3: default 'c' of flag 'variant' is not one of its values"],
        id="flagdefaultenum",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\n  mods: {doc: Modules., type: names}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        ["buffers.yaml:8:3: names parameter 'mods' needs 'values', the names it may hold"],
        id="namesnovalues",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\n  mods: {doc: Modules., type: names, values: [q, k], default: [q, v]}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        ["buffers.yaml:8:3: default of 'mods' holds 'v', which is not one of its values"],
        id="namesdefault",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\n  mods: {doc: Modules., type: names, values: [q, k], default: q}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        ["buffers.yaml:8:3: default of 'mods' must be a list of names"],
        id="namesdefaultnotlist",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1, values: [a]}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        [
            "buffers.yaml:5:3: only names and dtype parameters have 'values'; 'max_batch_size' is int"
        ],
        id="valuesonint",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\n  gather: {doc: Gather., type: bool, min: 1}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        ["buffers.yaml:8:3: 'gather' is a bool parameter and cannot have 'min'"],
        id="minonbool",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\n  gather: {doc: Gather., type: bool, default: 1}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        ["buffers.yaml:8:3: default of 'gather' must be true or false"],
        id="booldefault",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nchecks:\n  - require: "max_batch_size > 0"\n    message: Positive.\n    when: "max_num_tokens > 1"\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        [
            "buffers.yaml:11:12: 'max_num_tokens' is a construct-time parameter; a check's 'when' may use only generate-time flags"
        ],
        id="checkwhenparam",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nindex_sets:\n  layer: {doc: Layers., names: max_batch_size}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        ["buffers.yaml:12:3: index set 'layer': 'max_batch_size' is not a names parameter"],
        id="setnotnames",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: "input_ids_{layer}"\n        each: [layer]\n',
        [
            "buffers.yaml:26:17: 'ids' has 1 dimensions; 'each' can index at most 0 leading ones",
            "buffers.yaml:26:17: unknown index set 'layer'; declare it under index_sets",
        ],
        id="unknownset",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nindex_sets:\n  layer: {doc: Layers., first: 0, count: 2}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: "input_ids_{layer}_x"\n        each: [layer, layer]\n',
        [
            "buffers.yaml:28:17: 'ids' has 1 dimensions; 'each' can index at most 0 leading ones",
            "buffers.yaml:28:17: engine name 'input_ids_{layer}_x' must hold each index set of 'each' exactly once as {SET}; it holds layer, 'each' lists layer, layer",
        ],
        id="placeholder",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n    ring: 8\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        [
            "buffers.yaml:21:5: ring tensor 'host_ids': its first capacity dimension must be the ring size 8",
            "buffers.yaml:21:5: ring tensor 'host_ids': its shape must equal its capacity (each step binds one slot)",
        ],
        id="ringfirst",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: encoder_output}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        [
            "buffers.yaml:16:5: fill rule 'encoder_output' writes float16 or bfloat16 or float32 or float64, not int32",
            "buffers.yaml:17:5: fill rule 'encoder_output' copies request tensors on the device; 'host_ids' must be device memory",
            "buffers.yaml:19:5: fill rule 'encoder_output' writes shape [num_encoder_tokens, encoder_hidden_size], but 'host_ids' declares [num_tokens]",
            "buffers.yaml:20:18: fill rule 'encoder_output' reads 'encoder_hidden_size' from the Config; declare it as a parameter or derived value",
            "buffers.yaml:20:18: fill rule 'encoder_output' reads 'model_dtype' from the Config; declare it as a parameter or derived value",
        ],
        id="devicerulehost",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\n  mods: {doc: Modules., type: names, values: [q, k]}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["mods"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        ["buffers.yaml:19:17: 'mods' is a list parameter; formulas can only take its len()"],
        id="listoutsidelen",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["len(max_num_tokens)"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        ["buffers.yaml:18:21: len() takes the name of a list parameter or derived list"],
        id="lenofint",
    ),
    pytest.param(
        'version: 1\nflags:\n  variant: {doc: Variant., values: [a, b]}\nparameters:\n  max_batch_size: {doc: Batch., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n  act_dtype: {doc: Dtype., type: dtype, default: float16}\nsizes:\n  num_tokens: {doc: Tokens., max: "max_num_tokens"}\n  num_requests: {doc: Requests., max: "max_batch_size"}\nfamilies:\n  fam_a: {doc: A., flags: {variant: a}}\ntensors:\n  - name: host_ids\n    doc: Ids.\n    dtype: int32\n    memory: pinned\n    capacity: ["index"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}\n  - name: ids\n    doc: Ids on device.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids\n',
        [
            "buffers.yaml:18:17: 'index' is a member label of an index set; a capacity (fixed at construction) may use only construct-time parameters and derived values"
        ],
        id="indexoutside",
    ),
]


@pytest.mark.parametrize(("text", "expected"), FORMAT_CASES)
def test_format_extension_diagnostic(text, expected):
    assert diagnostics(text) == expected


def test_bindings_under_exclusive_boolean_parameters_may_share_an_engine_name():
    text = BASE.replace(
        "  act_dtype: {doc: Dtype., type: dtype, default: float16}",
        "  act_dtype: {doc: Dtype., type: dtype, default: float16}\n"
        "  wide: {doc: Wide., type: bool, default: false}",
    ).replace(
        "      - input: input_ids",
        "      - input: input_ids\n        when: wide\n      - input: ids_b\n        when: max_batch_size > 1",
    )
    text += (
        "  - name: other\n    doc: Other.\n    memory: device\n    fill: {mirror: host_ids}\n"
        "    bind:\n      - input: input_ids\n        when: not wide\n"
    )
    assert diagnostics(text) == []
    overlapping = text.replace(
        "        when: not wide\n", "        when: wide or max_batch_size > 1\n"
    )
    assert diagnostics(overlapping) == [
        "buffers.yaml:36:16: engine input 'input_ids' is bound by both 'ids' (line 22) and 'other' "
        "in family 'fam_a'; make their 'when' conditions exclusive"
    ]


@pytest.mark.parametrize(
    ("index_set", "expected"),
    [
        (
            "{doc: Layers., names: mods, first: 0, count: 2}",
            "buffers.yaml:13:10: an index set takes either 'names' (a names parameter) or 'first' "
            "and 'count' (plus an optional 'where')",
        ),
        (
            "{doc: Layers., names: mods, where: index > 0}",
            "buffers.yaml:13:3: index set 'layer': 'where' filters numbered sets only",
        ),
    ],
)
def test_index_set_shape(index_set, expected):
    text = BASE.replace(
        "  act_dtype: {doc: Dtype., type: dtype, default: float16}",
        "  act_dtype: {doc: Dtype., type: dtype, default: float16}\n"
        "  mods: {doc: Modules., type: names, values: [q, k]}",
    ).replace("families:", f"index_sets:\n  layer: {index_set}\nfamilies:")
    assert diagnostics(text) == [expected]


def test_dtype_parameter_values_must_be_dtypes_and_hold_the_default():
    text = BASE.replace(
        "  act_dtype: {doc: Dtype., type: dtype, default: float16}",
        "  act_dtype: {doc: Dtype., type: dtype, default: float16, values: [bfloat16, float33]}",
    )
    assert diagnostics(text) == [
        "buffers.yaml:7:3: 'float33' in the values of 'act_dtype' is not a dtype "
        "(did you mean 'float32'?)",
        "buffers.yaml:7:3: default float16 of 'act_dtype' is not one of its values",
    ]
