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
    "num_encoder_tokens",
    "num_encoder_input_tokens",
    "max_encoder_input_length",
)


# Sizes the runtime computes only for families whose shapes read them (they read request
# fields other families do not have).
ENCODER_SIZES = frozenset(
    {"num_encoder_tokens", "num_encoder_input_tokens", "max_encoder_input_length"}
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
    device: bool = False  # copies request tensors into a device tensor (no host staging)


_INT = ("int32", "int64")
_FLOAT = ("float16", "bfloat16", "float32", "float64")  # device copies of request tensors
_LORA = ("lora_modules", "first_local_layer", "num_local_layers")
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
        needs=("num_local_layers", "max_blocks_per_seq", "tokens_per_block", "num_kv_blocks"),
    ),
    "context_position_ids": FillRule(
        "positions of the context tokens only (a drafter writes the generation part)",
        _INT,
        ("num_tokens",),
    ),
    "cache_indirection_copies": FillRule(
        "source, destination and size of each generation request's cache-indirection copy",
        ("int64",),
        ("3", "num_generation_requests"),
        needs=("max_beam_width", "max_attention_window"),
    ),
    "cache_indirection_decoder_copies": FillRule(
        "source, destination and size of each request's decoder cache-indirection copy",
        ("int64",),
        ("3", "num_requests"),
        needs=("max_beam_width", "max_attention_window"),
    ),
    "generation_beam_widths": FillRule(
        "beam width of each generation request", _INT, ("num_generation_requests",)
    ),
    "encoder_output_lengths": FillRule(
        "encoder output length of each sequence's request", _INT, ("num_sequences",)
    ),
    "encoder_output": FillRule(
        "encoder outputs of the context requests, concatenated",
        _FLOAT,
        ("num_encoder_tokens", "encoder_hidden_size"),
        needs=("encoder_hidden_size",),
        device=True,
    ),
    "cross_kv_cache_block_offsets": FillRule(
        "cross-attention KV-cache block indices of each sequence, K then V",
        ("int32",),
        ("1", "num_sequences", "2", "max_cross_blocks_per_seq"),
        needs=(
            "num_local_layers",
            "max_cross_blocks_per_seq",
            "tokens_per_block",
            "num_kv_blocks",
        ),
    ),
    "cross_attention_mask": FillRule(
        "each token's row of its request's cross-attention mask",
        ("bool",),
        ("num_tokens", "max_encoder_input_length"),
    ),
    "skip_cross_attn_blocks": FillRule(
        "whether every request skips the cross-attention blocks", ("bool",), ("1",)
    ),
    "encoder_input_ids": FillRule(
        "encoder input tokens of each request, concatenated", _INT, ("num_encoder_input_tokens",)
    ),
    "encoder_position_ids": FillRule(
        "0 .. length - 1 over each request's encoder input", _INT, ("num_encoder_input_tokens",)
    ),
    "encoder_input_lengths": FillRule(
        "encoder input length of each request", _INT, ("num_requests",)
    ),
    "lora_weights_pointers": FillRule(
        "(A, B, DoRA scale) adapter addresses per module, layer and sequence",
        ("int64",),
        ("num_lora_modules", "num_local_layers", "num_sequences", "3"),
        needs=_LORA,
    ),
    "lora_ranks": FillRule(
        "adapter rank per module, layer and sequence",
        _INT,
        ("num_lora_modules", "num_local_layers", "num_sequences"),
        needs=_LORA,
    ),
    "prompt_embedding_table": FillRule(
        "each request's prompt table at rows [b * max_prompt_vocab_size, ...)",
        _FLOAT,
        ("max_prompt_embedding_table_size", "hidden_size"),
        needs=("max_prompt_vocab_size", "hidden_size"),
        device=True,
    ),
    "prompt_tasks": FillRule("prompt table (task) of every input token", _INT, ("num_tokens",)),
    "slot_mapping": FillRule(
        "state slot of each sequence", _INT, ("num_sequences",), needs=("max_batch_size",)
    ),
    "mrope_rotary_cos_sin": FillRule(
        "each context request's M-RoPE cos/sin table in its row",
        ("float32",),
        ("num_sequences", "max_position_embeddings * rotary_embedding_dim"),
        needs=("max_position_embeddings", "rotary_embedding_dim"),
        device=True,
    ),
    "mrope_position_deltas": FillRule(
        "M-RoPE position delta of each generation sequence", _INT, ("num_sequences", "1")
    ),
    "language_adapter_routings": FillRule(
        "language adapter of every input token",
        _INT,
        ("num_tokens", "1"),
        needs=("num_languages",),
    ),
    "posterior_thresholds": FillRule(
        "Eagle posterior threshold of each request", ("float32",), ("num_sequences",)
    ),
    "posterior_alphas": FillRule(
        "square root of each request's Eagle posterior threshold", ("float32",), ("num_sequences",)
    ),
    "chunked_context_next_tokens": FillRule(
        "the token after each context chunk, -1 on a last chunk and for generation",
        _INT,
        ("num_sequences",),
    ),
}
