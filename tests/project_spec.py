"""What the small project specs of the tests share: the token ids every decoder family binds
(a host tensor filled by bufc's `token_ids` rule and its device mirror)."""

from __future__ import annotations

TOKEN_TENSORS = """\
  - name: host_input_ids
    doc: Token ids.
    dtype: int32
    memory: pinned
    capacity: ["max_num_tokens"]
    shape: ["num_tokens"]
    fill: {rule: token_ids}
    pad: 0
  - name: input_ids
    doc: Token ids on the device.
    memory: device
    fill: {mirror: host_input_ids}
    bind: [{input: input_ids}]
"""
MARKER = "  - TOKEN_TENSORS\n"  # where a spec's text takes them, as its first tensors


def with_token_tensors(spec: str) -> str:
    """`spec` (dedented) with its MARKER line replaced by TOKEN_TENSORS."""
    assert spec.count(MARKER) == 1, "a spec takes the token tensors once"
    return spec.replace(MARKER, TOKEN_TENSORS)
