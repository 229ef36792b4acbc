"""Specs that would only fail later (values out of their dtype, shadowed module names,
divisors that can be zero, negative capacities, conditions that can never hold, scalars,
captures and request checks) are errors now: one spec and its exact messages each.

Every message starts with FILE:LINE:COL (1-based), so the positions are asserted too.
"""

from __future__ import annotations

import pytest
from diagnostics_spec import BASE, diagnostics


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
        _scalar('top: {doc: T., value: "max_of(host_ids)", device: "max_of(host_ids)"}'),
        [
            "buffers.yaml:12:61: max_of() reads what a step wrote, so only a step scalar's value "
            "may use it, not a step scalar's device value"
        ],
        id="max_of_in_device_value",
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
        _with(
            "  - name: host_last\n    doc: T.\n    dtype: int32\n    memory: pinned\n"
            '    capacity: ["max_num_tokens"]\n    shape: ["num_logits"]\n'
            "    fill: {rule: last_token_ids}\n    pad: 0\n",
        ).replace(
            "  num_requests:",
            '  num_context_requests: {doc: C., max: "max_batch_size"}\n'
            '  num_logits: {doc: L., max: "max_num_tokens"}\n  num_requests:',
        ),
        [
            "buffers.yaml:36:5: tensor 'host_last': pad 0 does not fit its rule "
            "'last_token_ids', whose padded rows must repeat the last value (a cumulative or "
            "1-based index: a constant would make a padded row's count negative or point before "
            "the first row); set pad: repeat_last"
        ],
        id="pad_unfit_for_a_cumulative_rule",
    ),
    pytest.param(
        _with(
            "  - name: host_slots\n    doc: T.\n    dtype: int64\n    memory: pinned\n"
            '    capacity: ["max_num_tokens"]\n    shape: ["num_tokens"]\n'
            "    fill: {rule: kv_slot_mapping}\n",
            params="  max_blocks_per_seq: {doc: W., min: 1}\n"
            "  tokens_per_block: {doc: B., min: 1}\n  num_local_layers: {doc: L., min: 1}\n"
            "  num_kv_blocks: {doc: K., min: 0, default: 0}\n",
        ).replace(
            "  num_requests:",
            '  num_sequences: {doc: S., max: "max_batch_size"}\n'
            '  num_context_requests: {doc: C., max: "max_batch_size"}\n  num_requests:',
        ),
        [
            "buffers.yaml:39:5: tensor 'host_slots': pad 0 does not fit its rule "
            "'kv_slot_mapping', whose padded rows must hold a negative value (a skip: any other "
            "would alias a live slot); set pad: -1"
        ],
        id="pad_unfit_for_a_skip_rule",
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
