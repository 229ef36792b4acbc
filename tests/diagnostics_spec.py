"""What the diagnostics tests share: BASE, a small valid spec they edit, and diagnostics(),
the messages compiling a spec text gives (each starting with FILE:LINE:COL, 1-based)."""

from __future__ import annotations

import textwrap

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
