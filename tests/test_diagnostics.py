"""One test per diagnostic: a tiny edit of a valid spec, and the exact messages it must give.

Every message starts with FILE:LINE:COL (1-based), so the positions are asserted too.
"""

from __future__ import annotations

import textwrap

import pytest

from bufc.codegen import SpecError, compile_text

BASE = textwrap.dedent(
    """\
    version: 1
    flags:
      variant: {doc: Variant., values: [a, b]}
    parameters:
      max_batch_size: {doc: Batch., min: 1}
      max_num_tokens: {doc: Tokens., min: 1}
      act_dtype: {doc: Dtype., type: dtype, default: float16}
    sizes:
      num_tokens: {doc: Tokens., max: "max_num_tokens"}
      num_requests: {doc: Requests., max: "max_batch_size"}
    families:
      fam_a: {doc: A., flags: {variant: a}}
    tensors:
      - name: host_ids
        doc: Ids.
        dtype: int32
        memory: pinned
        capacity: ["max_num_tokens"]
        shape: ["num_tokens"]
        fill: {rule: token_ids}
      - name: ids
        doc: Ids on device.
        memory: device
        fill: {mirror: host_ids}
        bind:
          - input: input_ids
    """
)


def diagnostics(text: str) -> list[str]:
    try:
        compile_text(text, "buffers.yaml")
    except SpecError as exc:
        return [str(d) for d in exc.diagnostics]
    return []


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
            "num_encoder_tokens, num_encoder_input_tokens, max_encoder_input_length",
        ],
        id="dupsym",
    ),
    pytest.param(
        "  num_requests: {doc",
        "  num_reqs: {doc",
        [
            "buffers.yaml:10:3: unknown step size 'num_reqs' (did you mean 'num_requests'?); the runtime computes: num_context_requests, num_context_tokens, num_generation_requests, num_generation_sequences, num_generation_tokens, num_logits, num_sequences, num_tokens, num_requests, max_context_length, "
            "num_encoder_tokens, num_encoder_input_tokens, max_encoder_input_length"
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


def test_division_by_a_constant_zero():
    text = BASE.replace('capacity: ["max_num_tokens"]', 'capacity: ["max_num_tokens // (2 - 2)"]')
    assert diagnostics(text) == ["buffers.yaml:18:17: 'max_num_tokens // (2 - 2)' divides by zero"]


def test_a_rule_that_reads_an_undeclared_parameter():
    text = BASE.replace("fill: {rule: token_ids}", "fill: {rule: kv_cache_block_offsets}")
    assert diagnostics(text) == [
        "buffers.yaml:19:5: fill rule 'kv_cache_block_offsets' writes shape [1, num_sequences, 2, "
        "max_blocks_per_seq], but 'host_ids' declares [num_tokens]",
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
        ["buffers.yaml:18:21: len() takes the name of a list parameter"],
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


# ---- specs that would only fail later: values out of their dtype, shadowed module names,
# ---- divisors that can be zero, negative capacities, conditions that can never hold
def _tensor(name: str, dtype: str, extra: str, capacity: str = "[1]", shape: str = "[1]") -> str:
    return (
        f"  - name: {name}\n    doc: T.\n    dtype: {dtype}\n    memory: device\n"
        f"    capacity: {capacity}\n    shape: {shape}\n{extra}"
    )


def _with(*tensors: str, before_sizes: str = "", params: str = "") -> str:
    text = BASE + "".join(tensors)
    if before_sizes:
        text = text.replace("sizes:", before_sizes + "sizes:", 1)
    if params:
        text = text.replace(
            "  act_dtype: {doc: Dtype., type: dtype, default: float16}\n",
            "  act_dtype: {doc: Dtype., type: dtype, default: float16}\n" + params,
        )
    return text


def _scalar(declaration: str) -> str:
    return BASE.replace("families:", f"scalars:\n  {declaration}\nfamilies:")


SCALAR_CASES = [
    pytest.param(
        _scalar('top: {doc: T., value: "max_of(host_idz)"}'),
        ["buffers.yaml:12:33: unknown tensor 'host_idz' (did you mean 'host_ids'?)"],
        id="max_of_unknown",
    ),
    pytest.param(
        _scalar('top: {doc: T., value: "max_of(ids)"}'),
        [
            "buffers.yaml:12:33: max_of() reads a host or pinned tensor a rule fills; 'ids' is "
            "device memory filled by mirror"
        ],
        id="max_of_device",
    ),
    pytest.param(
        _scalar('top: {doc: T., value: "max_of(1 + 2)"}'),
        ["buffers.yaml:12:26: max_of() takes the name of a tensor"],
        id="max_of_expression",
    ),
    pytest.param(
        _scalar('top: {doc: T., value: "num_tokens // max_of(host_ids)"}'),
        [
            "buffers.yaml:12:47: 'num_tokens // max_of(host_ids)' may divide by zero: "
            "'max_of(host_ids)' is known only when a step runs; divide by a constant, a "
            "parameter or a derived value"
        ],
        id="scalar_divisor",
    ),
    pytest.param(
        BASE.replace(
            "fill: {rule: token_ids}\n",
            'fill: {rule: token_ids}\n    capture: "max_of(host_ids)"\n',
        ),
        [
            "buffers.yaml:21:22: max_of() reads what a step wrote, so only a step scalar's value "
            "may use it, not a capture value"
        ],
        id="max_of_in_capture",
    ),
    pytest.param(
        BASE.replace(
            "  max_num_tokens: {doc: Tokens., min: 1}\n",
            "  max_sequence_length: {doc: S., min: 1}\n  max_num_tokens: {doc: Tokens., min: 1}\n",
        ),
        [
            "buffers.yaml:6:3: construct-time parameter name 'max_sequence_length' is reserved; "
            "choose another name"
        ],
        id="capture_argument_reserved",
    ),
    pytest.param(
        _with(_tensor("k", "int32", '    fill: engine\n    capture: "1"\n')),
        [
            "buffers.yaml:34:5: tensor 'k': prepare_for_cuda_graph writes a capture value into "
            "a host or pinned tensor a rule fills, not device memory filled by engine"
        ],
        id="capture_engine",
    ),
    pytest.param(
        _scalar('top: {doc: T., value: "cdiv(max_of(host_ids), 4) * 4"}').replace(
            "fill: {rule: token_ids}\n",
            'fill: {rule: token_ids}\n    capture: "min(max_sequence_length - 1, top)"\n',
        ),
        [],
        id="scalar_and_capture_ok",
    ),
]


FAMILY_CHECK_CASES = [
    pytest.param(
        BASE.replace(
            "families:", "requests:\n  checks:\n    fixd_drafts: \"variant == 'a'\"\nfamilies:"
        ),
        [
            "buffers.yaml:13:19: requests.checks names 'fixd_drafts', which is no request check "
            "(did you mean 'fixed_drafts'?); declare it under request_checks"
        ],
        id="family_check_unknown",
    ),
    pytest.param(
        BASE.replace(
            "families:", 'requests:\n  checks:\n    fixed_drafts: "max_batch_size > 1"\nfamilies:'
        ),
        [
            "buffers.yaml:13:20: 'max_batch_size' is a construct-time parameter; a condition "
            "under requests may use only generate-time flags"
        ],
        id="family_check_not_a_flag_condition",
    ),
]


@pytest.mark.parametrize(("text", "expected"), FAMILY_CHECK_CASES)
def test_family_check_diagnostic(text: str, expected: list[str]) -> None:
    assert diagnostics(text) == expected


@pytest.mark.parametrize(("text", "expected"), SCALAR_CASES)
def test_scalar_and_capture_diagnostic(text: str, expected: list[str]) -> None:
    assert diagnostics(text) == expected


LATER_CASES = [
    pytest.param(
        _with(_tensor("k", "int32", "    fill: engine\n    pad: repeat_last\n")),
        [
            "buffers.yaml:34:5: tensor 'k': pad repeat_last repeats the last element its rule "
            "wrote and needs a one-dimensional rule tensor, but 'k' is filled by engine; give a "
            "constant pad"
        ],
        id="repeat_last_engine",
    ),
    pytest.param(
        _with(
            "  - name: host_pos\n    doc: T.\n    dtype: int32\n    memory: pinned\n"
            '    capacity: [2, "max_num_tokens"]\n'
            '    shape: [2, "num_context_tokens + num_generation_sequences"]\n'
            "    fill: {rule: chatglm_position_ids}\n    pad: repeat_last\n",
            before_sizes="",
        ).replace(
            "  num_requests:",
            '  num_context_tokens: {doc: C., max: "max_num_tokens"}\n'
            '  num_generation_sequences: {doc: G., max: "max_num_tokens"}\n  num_requests:',
        ),
        [
            "buffers.yaml:36:5: tensor 'host_pos': pad repeat_last repeats the last element its "
            "rule wrote and needs a one-dimensional rule tensor, but 'host_pos' has 2 "
            "dimensions; give a constant pad"
        ],
        id="repeat_last_2d",
    ),
    pytest.param(
        BASE.replace("fill: {rule: token_ids}\n", "fill: {rule: token_ids}\n    pad: repeat\n"),
        [
            "buffers.yaml:21:10: tensors[0].pad must be an integer in the int32 range (a "
            "constant) or repeat_last (the last written element repeated), not a string"
        ],
        id="pad_policy_unknown",
    ),
    pytest.param(
        _with(_tensor("small", "int8", "    fill: engine\n    pad: 1000\n")),
        ["buffers.yaml:34:5: pad 1000 of tensor 'small' is outside the range of int8, -128 to 127"],
        id="pad_int8",
    ),
    pytest.param(
        _with(_tensor("bytes", "uint8", "    fill: engine\n    pad: -1\n")),
        ["buffers.yaml:34:5: pad -1 of tensor 'bytes' is outside the range of uint8, 0 to 255"],
        id="pad_uint8",
    ),
    pytest.param(
        _with(_tensor("acts", "act_dtype", "    fill: engine\n    pad: 70000\n")).replace(
            "default: float16}", "default: float16, values: [float32, float16]}"
        ),
        [
            "buffers.yaml:34:5: pad 70000 of tensor 'acts' is outside the range of float16, "
            "-65504 to 65504 (dtype parameter 'act_dtype' may be float16)"
        ],
        id="pad_dtype_parameter",
    ),
    pytest.param(
        _with(_tensor("k", "uint8", "    fill: {constant: 300}\n")),
        [
            "buffers.yaml:33:22: tensor 'k': constant fill '300' is always outside its dtype "
            "(uint8 holds 0 to 255)"
        ],
        id="constant_literal",
    ),
    pytest.param(
        _with(_tensor("k", "uint8", '    fill: {constant: "max_batch_size - 5"}\n')),
        [
            "buffers.yaml:33:23: tensor 'k': constant fill 'max_batch_size - 5' is -4 when "
            "max_batch_size = 1, outside its dtype (uint8 holds 0 to 255)"
        ],
        id="constant_formula",
    ),
    pytest.param(
        _with(_tensor("k", "int8", '    fill: {constant: "max_batch_size + 200"}\n')),
        [
            "buffers.yaml:33:23: tensor 'k': constant fill 'max_batch_size + 200' is always "
            "outside its dtype (int8 holds -128 to 127)"
        ],
        id="constant_always",
    ),
    pytest.param(
        _with(params="  dataclasses: {doc: Shadows an import., default: 1}\n"),
        [
            "buffers.yaml:8:3: construct-time parameter name 'dataclasses' is reserved: "
            "generated modules use it at module level; choose another name"
        ],
        id="shadows_import",
    ),
    pytest.param(
        _with(
            before_sizes='derived:\n  per: {doc: P., value: "max_num_tokens // (max_batch_size - 1)"}\n'
        ),
        [
            "buffers.yaml:9:45: 'max_num_tokens // (max_batch_size - 1)' divides by zero when "
            "max_batch_size = 1: 'max_batch_size - 1' is 0; make it provably non-zero "
            "(e.g. max(..., 1)) or raise the parameters' min"
        ],
        id="divisor_zero",
    ),
    pytest.param(
        _with(_tensor("k", "int32", '    fill: {constant: "cdiv(7, max_batch_size - 2000)"}\n')),
        [
            "buffers.yaml:33:31: 'cdiv(7, max_batch_size - 2000)' may divide by zero: "
            "'max_batch_size - 2000' is not provably non-zero for the parameters' declared "
            "ranges; make it provably non-zero (e.g. max(..., 1)) or raise the parameters' min"
        ],
        id="divisor_unproven",
    ),
    pytest.param(
        _with(
            _tensor(
                "neg",
                "int32",
                "    fill: engine\n",
                capacity='["max_batch_size - 5"]',
                shape='["max_batch_size - 5"]',
            )
        ),
        [
            "buffers.yaml:31:17: tensor 'neg': capacity dimension 0 'max_batch_size - 5' is "
            "negative (-4) when max_batch_size = 1"
        ],
        id="capacity_negative",
    ),
    pytest.param(
        BASE.replace('max: "max_num_tokens"', 'max: "max_num_tokens - 3"'),
        [
            "buffers.yaml:9:36: the max of step size 'num_tokens', 'max_num_tokens - 3', is "
            "negative (-2) when max_num_tokens = 1: no step could be prepared"
        ],
        id="size_max_negative",
    ),
    pytest.param(
        _with(
            _tensor(
                "never",
                "int32",
                '    fill: engine\n    when: "max_batch_size > 1 and max_batch_size < 1"\n',
            )
        ),
        [
            "buffers.yaml:34:12: tensor 'never' exists in no family: its 'when' "
            "'max_batch_size > 1 and max_batch_size < 1' never holds (a contradiction, or flag "
            "values no family sets)"
        ],
        id="when_contradiction",
    ),
    pytest.param(
        _with(_tensor("never", "int32", '    fill: engine\n    when: "max_batch_size < 1"\n')),
        [
            "buffers.yaml:34:12: tensor 'never' exists in no family: its 'when' "
            "'max_batch_size < 1' never holds (a contradiction, or flag values no family sets)"
        ],
        id="when_below_min",
    ),
    pytest.param(
        _with(
            _tensor(
                "never",
                "int32",
                "    fill: engine\n    when: \"variant == 'a' and variant == 'b'\"\n",
            )
        ),
        [
            "buffers.yaml:34:12: tensor 'never' exists in no family: its 'when' "
            "'variant == 'a' and variant == 'b'' never holds (a contradiction, or flag values "
            "no family sets)"
        ],
        id="when_flags",
    ),
    pytest.param(
        _with(
            _tensor(
                "out",
                "int32",
                '    fill: engine\n    when: "max_batch_size > 2"\n    bind:\n'
                '      - {output: out, when: "max_batch_size == 1"}\n',
            )
        ),
        [
            "buffers.yaml:36:30: the binding of 'out' to engine output 'out' never applies: its "
            "'when' 'max_batch_size == 1' never holds where 'out' exists"
        ],
        id="binding_never",
    ),
    pytest.param(
        _with(before_sizes='checks:\n  - {require: "max_batch_size < 1", message: Never.}\n'),
        [
            "buffers.yaml:9:16: check 'max_batch_size < 1' can never hold for the parameters' "
            "declared ranges: every Config would fail it"
        ],
        id="check_never",
    ),
    pytest.param(
        _with(
            before_sizes='checks:\n  - {require: "max_batch_size > 4", message: Big.}\n'
            '  - {require: "max_num_tokens >= 1", message: Tokens.}\n'
            '  - {require: "max_batch_size < 2", message: Small.}\n'
        ),
        [
            "buffers.yaml:11:16: check 'max_batch_size < 2' contradicts the check(s) at line(s) 9 "
            "in family 'fam_a': every Config would fail one of them"
        ],
        id="checks_contradict",
    ),
    pytest.param(
        BASE.replace("default: float16}", "default: int32, values: [int32, float32]}").replace(
            "    dtype: int32\n", "    dtype: act_dtype\n", 1
        ),
        [
            "buffers.yaml:16:5: fill rule 'token_ids' writes int32 or int64, but dtype parameter "
            "'act_dtype' of 'host_ids' may be float32; limit its 'values'"
        ],
        id="dtype_values_rule",
    ),
]


@pytest.mark.parametrize(("text", "expected"), LATER_CASES)
def test_what_would_only_fail_later_is_an_error_now(text, expected):
    assert diagnostics(text) == expected


def test_a_check_that_holds_somewhere_and_exclusive_conditions_are_fine():
    text = _with(
        _tensor("a", "int32", '    fill: engine\n    when: "max_batch_size > 1"\n'),
        _tensor("b", "int32", '    fill: engine\n    when: "max_batch_size <= 1"\n'),
        before_sizes='checks:\n  - {require: "max_batch_size >= 2 or max_num_tokens > 3", '
        "message: M.}\n",
    )
    assert diagnostics(text) == []
