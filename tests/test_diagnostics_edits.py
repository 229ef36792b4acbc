"""One test per diagnostic: a tiny edit of a valid spec, and the exact messages it must give.

Every message starts with FILE:LINE:COL (1-based), so the positions are asserted too.
"""

from __future__ import annotations

import pytest
from diagnostics_spec import BASE, diagnostics


def test_base_spec_is_valid():
    assert diagnostics(BASE) == []


CASES = [
    pytest.param(
        "  fam_a:",
        "  fam_a: {doc: X.}\n  fam_a:",
        ["buffers.yaml:13:3: duplicate key 'fam_a' (first defined at line 12)"],
        id="dup",
    ),
    pytest.param(
        "  fam_a: {doc: A., flags: {variant: a}}",
        "  fam_a: {doc: A., flags: {variant: a}}\n  fam_b: *x",
        [
            "buffers.yaml:13:10: aliases (*name) are not allowed in a buffer spec; write the value out"
        ],
        id="alias",
    ),
    pytest.param(
        "  fam_a: {doc",
        "  fam_a: &x {doc",
        [
            "buffers.yaml:12:10: anchors (&name) are not allowed in a buffer spec; write the value out"
        ],
        id="anchor",
    ),
    pytest.param(
        "  fam_a: {doc: A., flags: {variant: a}}",
        "  fam_a: {doc: A., flags: {variant: a}}\n  on: {doc: B.}",
        [
            "buffers.yaml:13:3: key 'on' is not a string; quote it (YAML 1.1 reads on/off/yes/no as booleans)"
        ],
        id="nonstr",
    ),
    pytest.param(
        "  fam_a: {doc: A., flags: {variant: a}}",
        "  fam_a: {doc: A., flags: {variant: a}, <<: {x: 1}}",
        ["buffers.yaml:12:41: merge keys (<<) are not allowed"],
        id="merge",
    ),
    pytest.param(
        None,
        "# nothing\n",
        ["buffers.yaml:1:1: the file is empty; a spec needs at least 'version'"],
        id="empty",
    ),
    pytest.param(
        None,
        "version: 1\n---\nversion: 1\n",
        ["buffers.yaml:2:1: only one YAML document is allowed (remove the '---' separator)"],
        id="multi",
    ),
    pytest.param(
        "    doc: Ids.\n",
        "    doc: Ids.\n\t  x: 1\n",
        ["buffers.yaml:16:1: a tab cannot indent YAML; indent with spaces"],
        id="syntax",
    ),
    pytest.param(
        "    doc: Ids.\n",
        "    doc: !!python/object:os.system Ids.\n",
        [
            "buffers.yaml:15:10: tag 'python/object:os.system' is not allowed in a buffer spec; "
            "write the value without it"
        ],
        id="badtag",
    ),
    pytest.param(
        '    shape: ["num_tokens"]',
        '    shpae: ["num_tokens"]',
        [
            "buffers.yaml:19:5: unknown key 'shpae' in tensors[0] (did you mean 'shape'?); allowed keys: bind, capacity, capture, doc, dtype, fill, memory, name, pad, ring, shape, when"
        ],
        id="unknownkey",
    ),
    pytest.param(
        "    doc: Ids on device.\n",
        "",
        ["buffers.yaml:21:5: tensors[1] is missing the required key 'doc'"],
        id="required",
    ),
    pytest.param(
        "    memory: pinned",
        "    memory: pined",
        ["buffers.yaml:17:13: 'pined' is not one of device, host, pinned (did you mean 'pinned'?)"],
        id="enum",
    ),
    pytest.param(
        "    doc: Ids.",
        "    doc: 5",
        ["buffers.yaml:15:10: tensors[0].doc must be a string, not an integer"],
        id="type",
    ),
    pytest.param(
        "  - name: host_ids",
        "  - name: Host-ids",
        [
            "buffers.yaml:14:11: 'Host-ids' is not a valid name: use a lower-case ASCII letter, then letters, digits or '_'"
        ],
        id="pattern",
    ),
    pytest.param(
        "  fam_a: {",
        "  Fam-A: {",
        [
            "buffers.yaml:12:3: 'Fam-A' is not a valid name: use a lower-case ASCII letter, then letters, digits or '_'"
        ],
        id="propnames",
    ),
    pytest.param(
        "    fill: {rule: token_ids}",
        "    fill: {rules: token_ids}",
        [
            "buffers.yaml:20:11: fill must be 'engine', 'external' or 'static', or one of "
            "{rule: NAME}, {mirror: TENSOR}, {constant: FORMULA}"
        ],
        id="fill",
    ),
    pytest.param(
        "      - input: input_ids",
        "      - input: input_ids\n        output: x",
        [
            "buffers.yaml:26:9: a binding names exactly one of 'input' or 'output' "
            "(plus optional 'when' and 'each')"
        ],
        id="binding",
    ),
    pytest.param(
        "version: 1",
        "version: 2",
        ["buffers.yaml:1:10: version must be 1"],
        id="const",
    ),
    pytest.param(
        "    doc: Ids.",
        '    doc: "Ids\\nimport os"',
        ["buffers.yaml:15:11: tensors[0].doc must be one line of printable ASCII"],
        id="doc_ascii",
    ),
    pytest.param(
        '    capacity: ["max_num_tokens"]',
        '    capacity: ["max_num_tokens / 2"]',
        [
            "buffers.yaml:18:32: unexpected character '/' (use // for floor division or cdiv(a, b) for ceiling division)"
        ],
        id="parse",
    ),
    pytest.param(
        "  variant: {doc: Variant., values: [a, b]}",
        "  variant: {doc: Variant.}",
        [
            "buffers.yaml:3:3: flag 'variant' needs exactly one of 'values' (an enum flag) or 'type: bool'"
        ],
        id="flagkind",
    ),
    pytest.param(
        "  max_num_tokens: {doc: Tokens., min: 1}",
        "  max_num_tokens: {doc: Tokens., min: 1}\n  lambda: {doc: L.}",
        [
            "buffers.yaml:7:3: construct-time parameter name 'lambda' is reserved; choose another name"
        ],
        id="reserved",
    ),
    pytest.param(
        '  num_requests: {doc: Requests., max: "max_batch_size"}',
        '  num_requests: {doc: Requests., max: "max_batch_size"}\n  max_batch_size: {doc: X.}',
        [
            "buffers.yaml:11:3: name 'max_batch_size' is already declared at line 5; flags, parameters, derived values, sizes and scalars share one namespace",
            "buffers.yaml:11:3: unknown step size 'max_batch_size'; the runtime computes: num_context_requests, num_context_tokens, num_generation_requests, num_generation_sequences, num_generation_tokens, num_logits, num_sequences, num_tokens, num_requests, max_context_length, "
            "num_encoder_tokens, num_encoder_input_tokens, max_encoder_input_length, beam_width, "
            "max_generation_length",
        ],
        id="dupsym",
    ),
    pytest.param(
        "  num_requests: {doc",
        "  num_reqs: {doc",
        [
            "buffers.yaml:10:3: unknown step size 'num_reqs' (did you mean 'num_requests'?); the runtime computes: num_context_requests, num_context_tokens, num_generation_requests, num_generation_sequences, num_generation_tokens, num_logits, num_sequences, num_tokens, num_requests, max_context_length, "
            "num_encoder_tokens, num_encoder_input_tokens, max_encoder_input_length, beam_width, "
            "max_generation_length"
        ],
        id="unknownsize",
    ),
    pytest.param(
        '    capacity: ["max_num_tokens"]',
        '    capacity: ["max_num_tokns"]',
        ["buffers.yaml:18:17: unknown name 'max_num_tokns' (did you mean 'max_num_tokens'?)"],
        id="unknownname",
    ),
    pytest.param(
        '    capacity: ["max_num_tokens"]',
        '    capacity: ["act_dtype"]',
        ["buffers.yaml:18:17: 'act_dtype' is a dtype parameter; it can only be a tensor's dtype"],
        id="dtypeinformula",
    ),
    pytest.param(
        '    capacity: ["max_num_tokens"]',
        '    capacity: ["num_tokens"]',
        [
            "buffers.yaml:18:17: 'num_tokens' is a step size; a capacity (fixed at construction) may use only construct-time parameters and derived values"
        ],
        id="sizeincap",
    ),
    pytest.param(
        '    capacity: ["max_num_tokens"]',
        '    capacity: ["variant"]',
        [
            "buffers.yaml:18:17: 'variant' is a generate-time flag; a capacity (fixed at construction) may use only construct-time parameters and derived values"
        ],
        id="flagincap",
    ),
    pytest.param(
        '    capacity: ["max_num_tokens"]',
        '    capacity: ["max_num_tokens > 1"]',
        [
            "buffers.yaml:18:17: a capacity (fixed at construction) must be an integer, got a condition: 'max_num_tokens > 1'"
        ],
        id="capbool",
    ),
    pytest.param(
        "    fill: {rule: token_ids}",
        '    fill: {rule: token_ids}\n    when: "max_batch_size"',
        [
            "buffers.yaml:21:12: 'when' must be a condition (a comparison, a flag, and/or/not), got an integer: 'max_batch_size'"
        ],
        id="whenint",
    ),
    pytest.param(
        "    fill: {rule: token_ids}",
        "    fill: {rule: token_ids}\n    when: \"variant == 'c'\"",
        ["buffers.yaml:21:12: 'c' is not a value of flag 'variant'; values: a, b"],
        id="enumvalue",
    ),
    pytest.param(
        "    fill: {rule: token_ids}",
        "    fill: {rule: token_ids}\n    when: \"variant < 'a'\"",
        ["buffers.yaml:21:12: flag 'variant' can only be compared with == or !="],
        id="enumlt",
    ),
    pytest.param(
        "    fill: {rule: token_ids}",
        '    fill: {rule: token_ids}\n    when: "variant == 1"',
        ["buffers.yaml:21:12: flag 'variant' must be compared with a quoted value"],
        id="enumint",
    ),
    pytest.param(
        "    fill: {rule: token_ids}",
        '    fill: {rule: token_ids}\n    when: "max_batch_size > 1 and max_num_tokens"',
        ["buffers.yaml:21:35: 'and' needs conditions, got an integer"],
        id="andint",
    ),
    pytest.param(
        "    fill: {rule: token_ids}",
        "    fill: {rule: token_ids}\n    when: \"max_batch_size < 'a'\"",
        ["buffers.yaml:21:12: '<' compares integers, got a string"],
        id="cmpstr",
    ),
    pytest.param(
        "    fill: {rule: token_ids}",
        '    fill: {rule: token_ids}\n    when: "variant + 1 > 2"',
        [
            "buffers.yaml:21:12: arithmetic needs integers, got the enum flag 'variant' (compare it with a quoted value)"
        ],
        id="arith_flag",
    ),
    pytest.param(
        "default: float16}",
        "default: flaot16}",
        ["buffers.yaml:7:3: default of 'act_dtype' is not a dtype (did you mean 'float16'?)"],
        id="dtypedefault",
    ),
    pytest.param(
        "type: dtype, default: float16}",
        "type: dtype, default: float16, min: 1}",
        ["buffers.yaml:7:3: 'act_dtype' is a dtype parameter and cannot have 'min'"],
        id="dtypemin",
    ),
    pytest.param(
        "  max_batch_size: {doc: Batch., min: 1}",
        "  max_batch_size: {doc: Batch., min: 1, default: x}",
        ["buffers.yaml:5:3: default of 'max_batch_size' must be an integer"],
        id="intdefault",
    ),
    pytest.param(
        "  max_batch_size: {doc: Batch., min: 1}",
        "  max_batch_size: {doc: Batch., min: 1, default: 0}",
        ["buffers.yaml:5:3: default 0 of 'max_batch_size' is below its min 1"],
        id="belowmin",
    ),
    pytest.param(
        "sizes:",
        'derived:\n  aa: {doc: A., value: "bb + 1"}\n  bb: {doc: B., value: "aa * 2"}\nsizes:',
        ["buffers.yaml:9:3: derived values form a cycle: aa -> bb -> aa"],
        id="cycle",
    ),
    pytest.param(
        "{variant: a}}",
        "{variant: a, varient: b}}",
        [
            "buffers.yaml:12:40: family 'fam_a' sets unknown flag 'varient' (did you mean 'variant'?)"
        ],
        id="famflag",
    ),
    pytest.param(
        "{variant: a}}",
        "{variant: c}}",
        ["buffers.yaml:12:28: 'c' is not a value of flag 'variant'; values: a, b"],
        id="famvalue",
    ),
    pytest.param(
        "{doc: A., flags: {variant: a}}",
        "{doc: A.}",
        ["buffers.yaml:12:3: family 'fam_a' does not set flag 'variant', which has no default"],
        id="fammissing",
    ),
    pytest.param(
        "  - name: ids",
        "  - name: host_ids",
        ["buffers.yaml:21:11: tensor 'host_ids' is already declared at line 14"],
        id="dupT",
    ),
    pytest.param(
        "    dtype: int32\n",
        "",
        ["buffers.yaml:14:11: tensor 'host_ids' needs 'dtype'"],
        id="missingdtype",
    ),
    pytest.param(
        "    dtype: int32",
        "    dtype: int23",
        [
            "buffers.yaml:16:5: unknown dtype 'int23' (did you mean 'int32'?); use one of bool, uint8, int8, int32, int64, float16, bfloat16, float32, float64 or a dtype parameter"
        ],
        id="unknowndtype",
    ),
    pytest.param(
        '    shape: ["num_tokens"]',
        '    shape: ["num_tokens", 2]',
        [
            "buffers.yaml:19:5: fill rule 'token_ids' writes shape [num_tokens], but 'host_ids' declares [num_tokens, 2]",
            "buffers.yaml:19:5: tensor 'host_ids': shape has 2 dimensions but capacity has 1",
        ],
        id="rank",
    ),
    pytest.param(
        '    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]',
        '    capacity: ["max_batch_size"]\n    shape: ["max_batch_size + 1"]',
        [
            "buffers.yaml:19:5: fill rule 'token_ids' writes shape [num_tokens], but 'host_ids' declares [max_batch_size + 1]",
            "buffers.yaml:19:14: tensor 'host_ids': step shape dimension 0 'max_batch_size + 1' is always larger than its capacity 'max_batch_size'",
        ],
        id="toosmall",
    ),
    pytest.param(
        "    fill: {mirror: host_ids}",
        "    fill: {mirror: host_ids}\n    dtype: int32",
        ["buffers.yaml:25:5: mirror 'ids' inherits 'dtype' from its source; remove it"],
        id="mirrorinherits",
    ),
    pytest.param(
        "    fill: {mirror: host_ids}",
        "    fill: {mirror: host_idz}",
        ["buffers.yaml:24:20: mirror source 'host_idz' is not a tensor (did you mean 'host_ids'?)"],
        id="mirrorsrc",
    ),
    pytest.param(
        "    memory: pinned",
        "    memory: host",
        [
            "buffers.yaml:24:20: mirror source 'host_ids' must be pinned host memory, not host (it is staged in the pinned arena that is copied to the device each step)"
        ],
        id="mirrorpinned",
    ),
    pytest.param(
        "    memory: device",
        "    memory: pinned",
        ["buffers.yaml:23:5: mirror 'ids' is a host-to-device copy; its memory must be device"],
        id="mirrordev",
    ),
    pytest.param(
        "    fill: {rule: token_ids}",
        "    fill: {rule: token_id}",
        [
            "buffers.yaml:20:18: unknown fill rule 'token_id' (did you mean 'token_ids'?); "
            "docs/spec.md lists the built-in rules, and a project declares its own under rules"
        ],
        id="unknownrule",
    ),
    pytest.param(
        '    memory: pinned\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}',
        '    memory: device\n    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n    fill: {rule: token_ids}',
        [
            "buffers.yaml:17:5: fill rule 'token_ids' runs on the host: make 'host_ids' pinned and add a device tensor with fill: {mirror: host_ids}",
            "buffers.yaml:24:20: mirror source 'host_ids' must be pinned host memory, not device (it is staged in the pinned arena that is copied to the device each step)",
        ],
        id="ruledevice",
    ),
    pytest.param(
        "    dtype: int32",
        "    dtype: float32",
        ["buffers.yaml:16:5: fill rule 'token_ids' writes int32 or int64, not float32"],
        id="ruledtype",
    ),
    pytest.param(
        '    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]',
        '    capacity: ["max_batch_size"]\n    shape: ["num_requests"]',
        [
            "buffers.yaml:19:5: fill rule 'token_ids' writes shape [num_tokens], but 'host_ids' declares [num_requests]"
        ],
        id="ruleshape",
    ),
    pytest.param(
        "      - input: input_ids",
        "      - input: input_ids\n  - name: ids2\n    doc: Again.\n    memory: device\n    fill: {mirror: host_ids}\n    bind:\n      - input: input_ids",
        [
            "buffers.yaml:32:16: engine input 'input_ids' is bound by both 'ids' (line 21) and 'ids2' in family 'fam_a'; make their 'when' conditions exclusive"
        ],
        id="twice",
    ),
    pytest.param(
        "    fill: {mirror: host_ids}\n",
        "    fill: {mirror: host_ids}\n  - name: flags_t\n    doc: F.\n    dtype: bool\n    memory: device\n    capacity: [1]\n    shape: [1]\n    fill: engine\n    pad: 2\n",
        ["buffers.yaml:32:5: pad of bool tensor 'flags_t' must be 0 or 1"],
        id="padbool",
    ),
    pytest.param(
        "    fill: {mirror: host_ids}\n",
        "    fill: {mirror: host_ids}\n  - name: wide_t\n    doc: W.\n    dtype: int64\n    memory: device\n    capacity: [1]\n    shape: [1]\n    fill: engine\n    pad: 3000000000\n",
        [
            "buffers.yaml:32:10: tensors[2].pad 3000000000 is outside the int32 range: a constant pad needs an integer in -2147483648..2147483647 (or repeat_last, the last written element repeated)"
        ],
        id="padwide",
    ),
    pytest.param(
        "    fill: {mirror: host_ids}\n",
        '    fill: {mirror: host_ids}\n  - name: k\n    doc: K.\n    dtype: int32\n    memory: host\n    capacity: [1]\n    shape: [1]\n    fill: {constant: "num_tokens"}\n',
        [
            "buffers.yaml:31:23: 'num_tokens' is a step size; a constant fill (written at construction) may use only construct-time parameters and derived values"
        ],
        id="constint",
    ),
]


@pytest.mark.parametrize(("old", "new", "expected"), CASES)
def test_diagnostic(old, new, expected):
    if old is None:
        text = new
    else:
        assert old in BASE
        text = BASE.replace(old, new, 1)
    assert diagnostics(text) == expected


def test_all_errors_are_reported_sorted():
    text = BASE.replace('["max_num_tokens"]', '["max_num_tokns"]').replace("pinned", "pined")
    assert diagnostics(text) == [
        "buffers.yaml:17:13: 'pined' is not one of device, host, pinned (did you mean 'pinned'?)",
    ]
    text = BASE.replace('["max_num_tokens"]', '["max_num_tokns"]').replace(
        "{rule: token_ids}", "{rule: tokens}"
    )
    assert diagnostics(text) == [
        "buffers.yaml:18:17: unknown name 'max_num_tokns' (did you mean 'max_num_tokens'?)",
        "buffers.yaml:20:18: unknown fill rule 'tokens' (did you mean 'token_ids'?); "
        "docs/spec.md lists the built-in rules, and a project declares its own under rules",
    ]


def _repeated_outputs(count: str, plain: str = "") -> str:
    """BASE with an index set `layer` of `count` members and a tensor `outs` bound as
    `out{layer}` over it (and as `plain` too, where given)."""
    sets = f'index_sets:\n  layer: {{doc: L., first: "0", count: "{count}"}}\nfamilies:'
    outs = (
        "      - input: input_ids\n  - name: outs\n    doc: O.\n    memory: device\n"
        "    dtype: int32\n    capacity: [2, 4]\n    shape: [2, 4]\n    fill: engine\n"
        '    bind:\n      - {output: "out{layer}", each: [layer]}'
        + (f"\n      - {{output: {plain}}}" if plain else "")
    )
    return BASE.replace("families:", sets).replace("      - input: input_ids", outs)


def test_a_plain_engine_name_a_repeated_binding_also_takes():
    """`out1` bound plainly and `out{layer}` over layers 0 and 1 both bind `out1`; `out_1` and
    `outx` are no name of the repeated binding."""
    text = _repeated_outputs("2", "out1")
    assert diagnostics(text) == [
        "buffers.yaml:38:18: engine output 'out1' of 'outs' is also a name that 'outs' binds as "
        "'out{layer}' (line 29) in family 'fam_a'; rename one, or make their 'when' conditions "
        "exclusive"
    ]
    for other in ("out_1", "outx"):
        assert diagnostics(text.replace("{output: out1}", f"{{output: {other}}}")) == []


def test_a_negative_index_set_count_is_a_located_error():
    """A count below 0 for some value of the parameters: the set's bindings would bind nothing
    (it read as an empty set)."""
    assert diagnostics(_repeated_outputs("max_batch_size - 3")) == [
        "buffers.yaml:12:40: the count of index set 'layer', 'max_batch_size - 3', is negative "
        "(-2) when max_batch_size = 1: its bindings would bind nothing"
    ]


def test_a_name_that_is_a_dtype_is_refused():
    """A dtype parameter named float32 was silently ignored: `dtype: float32` reads as the
    dtype."""
    assert diagnostics(BASE.replace("act_dtype", "float32")) == [
        "buffers.yaml:7:3: dtype parameter name 'float32' is a dtype: a tensor's 'dtype: "
        "float32' would mean the dtype, not this name; choose another name"
    ]


def test_a_scalar_named_like_a_field_of_the_step_is_refused():
    scalar = 'scalars:\n  inputs: {doc: I., value: "num_tokens"}\nfamilies:'
    assert diagnostics(BASE.replace("families:", scalar)) == [
        "buffers.yaml:12:3: step scalar name 'inputs' is a field of the step record: step.inputs "
        "would not read it; choose another name"
    ]


def test_division_by_a_constant_zero():
    text = BASE.replace('capacity: ["max_num_tokens"]', 'capacity: ["max_num_tokens // (2 - 2)"]')
    assert diagnostics(text) == ["buffers.yaml:18:17: 'max_num_tokens // (2 - 2)' divides by zero"]


def test_a_rule_that_reads_an_undeclared_parameter():
    text = BASE.replace("fill: {rule: token_ids}", "fill: {rule: kv_cache_block_offsets}")
    assert diagnostics(text) == [
        "buffers.yaml:19:5: fill rule 'kv_cache_block_offsets' writes shape [num_kv_pools, "
        "num_sequences, 2, max_blocks_per_seq], but 'host_ids' declares [num_tokens]",
        "buffers.yaml:20:18: fill rule 'kv_cache_block_offsets' reads 'kv_pool_layers' from the "
        "Config; declare it as a parameter or derived value",
        "buffers.yaml:20:18: fill rule 'kv_cache_block_offsets' reads 'kv_pool_windows' from the "
        "Config; declare it as a parameter or derived value",
        "buffers.yaml:20:18: fill rule 'kv_cache_block_offsets' reads 'max_blocks_per_seq' from the "
        "Config; declare it as a parameter or derived value",
        "buffers.yaml:20:18: fill rule 'kv_cache_block_offsets' reads 'num_kv_blocks' from the "
        "Config; declare it as a parameter or derived value",
        "buffers.yaml:20:18: fill rule 'kv_cache_block_offsets' reads 'num_local_layers' from the "
        "Config; declare it as a parameter or derived value",
        "buffers.yaml:20:18: fill rule 'kv_cache_block_offsets' reads 'tokens_per_block' from the "
        "Config; declare it as a parameter or derived value",
    ]


def test_file_too_large():
    assert diagnostics("#" * (1 << 20) + "\n") == [
        "buffers.yaml:1:1: file is larger than 1048576 bytes"
    ]


def test_billion_laughs_is_rejected_before_expansion():
    text = 'a: &a ["x","x"]\nb: &b [*a,*a]\nc: [*b,*b]\n'
    assert diagnostics(text) == [
        "buffers.yaml:1:4: anchors (&name) are not allowed in a buffer spec; write the value out"
    ]
