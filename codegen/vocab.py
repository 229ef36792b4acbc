"""Closed tables the spec may name: dtypes, memory kinds, step sizes and fill rules.

These mirror what ``bufc.runtime`` implements; a test checks the two stay in step. They live
here (and not in the runtime) because generating must not need torch.
"""

from __future__ import annotations

import dataclasses

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

# spec memory kind -> runtime constant name
MEMORY_KINDS: dict[str, str] = {"device": "DEVICE", "host": "HOST", "pinned": "PINNED"}

# The step-time sizes the runtime computes every step (the reference's setBufferSizes).
STEP_SIZES: tuple[str, ...] = (
    "num_context_requests",
    "num_context_tokens",
    "num_generation_requests",
    "num_generation_sequences",
    "num_generation_tokens",
    "num_logits",
    "num_sequences",
    "num_tokens",
    "num_requests",
    "max_context_length",
)


@dataclasses.dataclass(frozen=True)
class FillRule:
    """A named host-side fill implemented in ``bufc.runtime.fills``.

    `shape` is the step shape the rule writes (formulas over step sizes), checked against the
    tensor's declared shape so the two cannot drift apart.
    """

    doc: str
    dtypes: tuple[str, ...]
    shape: tuple[str, ...]
    needs: tuple[str, ...] = ()  # construct-time names the rule reads from the Config


_INT = ("int32", "int64")
_POSITIONS_2D = ("2", "num_context_tokens + num_generation_sequences")

FILL_RULES: dict[str, FillRule] = {
    "token_ids": FillRule(
        "context chunks (plus drafts on a last chunk), then each beam's last token and drafts",
        _INT,
        ("num_tokens",),
    ),
    "position_ids": FillRule(
        "positions of each input token; explicit position ids when a request has them",
        _INT,
        ("num_context_tokens + num_generation_sequences",),
    ),
    "chatglm_position_ids": FillRule("ChatGLM-6B two-row positions", _INT, _POSITIONS_2D),
    "glm_position_ids": FillRule(
        "GLM-10B two-row positions with the mask position", _INT, _POSITIONS_2D
    ),
    "context_lengths": FillRule("input length of each sequence", _INT, ("num_sequences",)),
    "sequence_lengths": FillRule("total length of each sequence", _INT, ("num_sequences",)),
    "past_key_value_lengths": FillRule("KV length of each sequence", _INT, ("num_sequences",)),
    "request_types": FillRule("0 = context, 1 = generation", _INT, ("num_sequences",)),
    "last_token_ids": FillRule(
        "1-based index of each logit row's last token", _INT, ("num_logits",)
    ),
    "seq_slots": FillRule("decoder slot of each request", _INT, ("num_requests",)),
    "kv_cache_block_offsets": FillRule(
        "paged KV-cache block indices of each sequence, K then V",
        ("int32",),
        ("1", "num_sequences", "2", "max_blocks_per_seq"),
        needs=("num_local_layers", "max_blocks_per_seq", "tokens_per_block"),
    ),
}
