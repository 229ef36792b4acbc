"""One step's view of its requests: the ``Batch`` every fill rule reads, made in one place.

``view`` makes a step's ``Batch`` from its checked columns, whichever path read the requests
(``stateless.build`` from the scheduled request objects, the request table from its per-slot
columns): the step sizes of the reference's setBufferSizes, the per-request and per-sequence
columns the fill rules vectorise over, and what they derive once (drafts ride on a last chunk,
each generation request's first input token).

Row layout (docs/contract.md): context requests one row each in scheduled order,
then the beams of each generation request in order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BatchError
from .blocks import id_limit, raw_id_limit
from .sizes import StepSizes
from .values import EMPTY, INT32_MAX, check_int, show


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a family's Config bounds in every request, decided once per RuntimeBuffers.

    Token ids lie in 0 .. token_limit - 1: the vocabulary, plus the prompt-table rows of a
    family with prompt tuning (ids >= vocab_size index the request's prompt table)."""

    max_batch_size: int
    max_beam_width: int = 1
    max_draft_tokens: int = 0
    token_limit: int = INT32_MAX + 1
    token_limit_text: str = "the int32 range"
    max_input_length: int = INT32_MAX  # encoder input tokens of one request
    max_encoder_length: int = INT32_MAX  # encoder output rows of one request
    encoder_engine: bool = False  # the step runs an encoder engine: sizes from encoder inputs
    # a paged KV cache: at most kv_width blocks per list, ids in 0 .. kv_limit[0] - 1 (0: none)
    kv_width: int = 0
    kv_limit: tuple[int, str] = (0, "")
    # the attention windows a request carries block lists for, ascending (one table each);
    # () or one window: the plain form of kv_block_ids
    kv_windows: tuple[int, ...] = ()
    # the Request fields (name, default) the family never reads, refused when set (the
    # runtime fills them in from the family's step program), and the family's name
    unread: tuple[tuple[str, Any], ...] = ()
    unread_getter: Any = None  # values.unread_getter(unread)
    family: str = ""
    # the Request fields beyond the core ones (prompt, beams, drafts, positions, block lists)
    # that the family reads, (name, default): a request in flight keeps its own copy of each
    read: tuple[tuple[str, Any], ...] = ()


def limits(
    *,
    max_batch_size: int,
    max_beam_width: int = 1,
    max_draft_tokens: int = 0,
    vocab_size: int | None = None,
    max_prompt_vocab_size: int = 0,
    max_input_length: int = INT32_MAX,
    max_encoder_length: int = INT32_MAX,
    encoder_only: bool = False,
    max_blocks_per_seq: int = 0,
    kv_pool_layers: tuple[int, ...] = (),
    num_kv_blocks: int = 0,
    attention_window_sizes: tuple[int, ...] = (),
) -> Limits:
    """A family's request limits from its Config values (each family's generated module passes
    the ones it has; the rest keep their defaults) and the spec's `requests` conditions."""
    if vocab_size is None:
        limit, text = INT32_MAX + 1, "the int32 range"
    elif max_prompt_vocab_size:
        limit = vocab_size + max_prompt_vocab_size
        text = f"vocab_size + max_prompt_vocab_size = {vocab_size} + {max_prompt_vocab_size}"
    else:
        limit, text = vocab_size, f"vocab_size={vocab_size}"
    return Limits(
        max_batch_size=max_batch_size,
        max_beam_width=max_beam_width,
        max_draft_tokens=max_draft_tokens,
        token_limit=min(limit, INT32_MAX + 1),
        token_limit_text=text,
        max_input_length=max_input_length,
        max_encoder_length=max_encoder_length,
        encoder_engine=encoder_only,
        kv_width=max_blocks_per_seq,
        # a block id is encoded with its pool's layers where the family has KV pools
        # (TensorRT-LLM's offsets: the largest pool bounds it; a hybrid model's recurrent
        # layers are in none); without pools (FlashAttention, FlashInfer) it is bound as it is
        kv_limit=(
            (
                id_limit(max(kv_pool_layers), num_kv_blocks)
                if kv_pool_layers
                else raw_id_limit(num_kv_blocks)
            )
            if max_blocks_per_seq
            else (0, "")
        ),
        kv_windows=tuple(attention_window_sizes) if max_blocks_per_seq else (),
    )


@dataclasses.dataclass(frozen=True)
class FlightLists:
    """Requests in flight: where each sequence of the step finds its KV block ids in the
    request table's block table (``blocks``, a ``blocks.BlockTable``): ``index`` is the row of
    each sequence's list (context requests, then every generation beam; slot * lists + the
    list's index among the slot's, 0 where one list serves every beam). With several attention
    windows, ``tables`` holds each window's block table (ascending windows; ``blocks`` is the
    first), their rows laid out alike."""

    blocks: Any
    index: np.ndarray
    tables: tuple[Any, ...] = ()

    def per_window(self) -> tuple[Any, ...]:
        """Each window's block table (one: ``blocks``)."""
        return self.tables or (self.blocks,)


FEW_RANGES = 2  # context chunks whose positions are a range each (past them: gathers)


class derived:  # noqa: N801 - used as a decorator, like functools.cached_property
    """A column a ``Batch`` derives from its others on first use, kept in the instance's
    ``__dict__`` (which shadows this non-data descriptor from then on). functools'
    cached_property takes a lock on every first use in Python 3.11: a step reads a
    handful of these, once each."""

    def __init__(self, compute: Any) -> None:
        self.compute, self.name = compute, compute.__name__
        self.__doc__ = compute.__doc__

    def __get__(self, batch: Any, owner: type | None = None) -> Any:
        if batch is None:
            return self
        value = batch.__dict__[self.name] = self.compute(batch)
        return value


@dataclasses.dataclass(frozen=True)
class Batch:  # not slotted: a derived column is kept in __dict__
    context: tuple[Any, ...]
    generation: tuple[Any, ...]
    sizes: StepSizes
    # context columns (one entry per context request)
    ctx_begin: np.ndarray
    ctx_chunk: np.ndarray
    ctx_prompt_len: np.ndarray
    ctx_drafts: np.ndarray  # draft tokens appended this step (only on a last chunk)
    ctx_input_len: np.ndarray  # chunk + drafts
    # generation columns (one entry per generation request)
    gen_beam_width: np.ndarray
    gen_prompt_len: np.ndarray
    gen_drafts: np.ndarray
    gen_max_generated: np.ndarray
    # per generation sequence (one entry per beam)
    seq_num_tokens: np.ndarray  # prompt + generated tokens of that beam
    seq_last_token: np.ndarray  # the last token of that beam
    seq_slot: np.ndarray  # per request, context first
    explicit_positions: tuple[int, ...]  # request indices (context first) with position_ids
    limits: Limits
    prompts: dict = dataclasses.field(default_factory=dict, repr=False)  # see prompt_array
    flight: FlightLists | None = None  # requests in flight: where each sequence's lists are

    def prompt_array(self, i: int) -> np.ndarray:
        """Context request i's prompt as an int64 array (converted and checked by ``build``)."""
        return self.prompts[id(self.context[i])][1]

    @derived
    def seq_request(self) -> np.ndarray:
        """The generation request of each generation sequence."""
        return np.repeat(np.arange(len(self.generation)), self.gen_beam_width)

    @derived
    def gen_starts(self) -> np.ndarray:
        """Each generation request's first input token in the packed tokens (after the context
        tokens: per request each beam's token, then its drafts), computed once for the token
        rule and the device gather alike."""
        width = self.gen_beam_width + self.gen_drafts
        return self.sizes.num_context_tokens + np.cumsum(width) - width

    @derived
    def seq_query_tokens(self) -> np.ndarray:
        """Input tokens of each sequence this step: a context chunk (with a last chunk's
        drafts), or a generation beam's token plus its request's drafts."""
        return np.concatenate((self.ctx_input_len, self.per_sequence(1 + self.gen_drafts)))

    @derived
    def seq_kv_tokens(self) -> np.ndarray:
        """KV tokens of each sequence once this step's tokens are written (what its block
        list must cover), computed once for the KV check and the rules that read it."""
        gen = self.seq_num_tokens
        if self.has_generation_drafts:
            gen = gen + self.per_sequence(self.gen_drafts)
        return np.concatenate((self.ctx_begin + self.ctx_input_len, gen))

    @derived
    def ctx_positions(self) -> np.ndarray:
        """The KV position of every context input token, chunk after chunk (a chunk's first
        position onwards, a last chunk's drafts after its prompt), computed once for the
        positions and the KV slots."""
        k = self.ctx_input_len
        if len(k) <= FEW_RANGES:  # a step's usual arrivals: cheaper than the gathers
            return np.concatenate(
                [
                    np.arange(begin, begin + n)
                    for begin, n in zip(self.ctx_begin.tolist(), k.tolist())
                ]
                or [EMPTY]
            )
        starts = np.add.accumulate(k) - k
        return np.arange(self.sizes.num_context_tokens) + np.repeat(self.ctx_begin - starts, k)

    @derived
    def ctx_logit_rows(self) -> np.ndarray:
        """The logit row of each context chunk's last token (a last chunk's drafts follow it,
        one row each), for the rules that place a chunk's logit row."""
        if not self.has_context_drafts:
            return np.arange(self.sizes.num_context_requests)
        rows = 1 + self.ctx_drafts
        return np.add.accumulate(rows) - rows

    @derived
    def seq_first(self) -> np.ndarray:
        """The first generation sequence of each generation request."""
        return np.add.accumulate(self.gen_beam_width) - self.gen_beam_width

    @property
    def has_generation_drafts(self) -> bool:
        """Some generation request carries draft tokens (from the sizes: no numpy call)."""
        s = self.sizes
        return s.num_generation_tokens != s.num_generation_sequences

    @property
    def has_context_drafts(self) -> bool:
        """Some last context chunk carries draft tokens."""
        s = self.sizes
        return s.num_logits != s.num_context_requests + s.num_generation_tokens

    def per_sequence(self, gen_values: np.ndarray) -> np.ndarray:
        """Repeat one value per generation request over its beams."""
        if self.sizes.num_generation_sequences == self.sizes.num_generation_requests:
            return gen_values  # one beam each
        return np.repeat(gen_values, self.gen_beam_width)


@functools.lru_cache(maxsize=64)  # serving repeats a step's counts: one StepSizes for them
def step_sizes(
    num_context_requests: int,
    context_tokens: int,
    context_drafts: int,
    max_context_length: int,
    num_generation_requests: int,
    num_generation_sequences: int,
    generation_drafts: int,
    beam_width: int = 1,
    max_generation_length: int = 1,
) -> StepSizes:
    """The reference's setBufferSizes from the step's counts (every builder's one formula):
    the context chunks' input tokens (drafts included) and the drafts on last chunks, the
    longest context prompt, and the generation requests, sequences and draft tokens (the
    longest request's tokens, `max_generation_length`, from ``generation_length``)."""
    n_ctx = num_context_requests
    gen_tokens = generation_drafts + num_generation_sequences
    return StepSizes(
        num_context_requests=n_ctx,
        num_context_tokens=context_tokens,
        num_generation_requests=num_generation_requests,
        num_generation_sequences=num_generation_sequences,
        num_generation_tokens=gen_tokens,
        num_logits=n_ctx + context_drafts + gen_tokens,
        num_sequences=n_ctx + num_generation_sequences,
        num_tokens=context_tokens + gen_tokens,
        beam_width=beam_width,
        max_generation_length=max_generation_length,
        num_requests=n_ctx + num_generation_requests,
        max_context_length=max_context_length,
    )


def generation_length(requests: int, most_drafts: int, limits: Limits) -> int:
    """The step's max_generation_length: 1 plus the most drafts of its `requests` generation
    requests, or max_draft_tokens + 1 without any (TensorRT-LLM's Eagle and ReDrafter
    fallback; its lookahead runtime binds 0 there, on a tensor of no rows either way)."""
    return 1 + most_drafts if requests else limits.max_draft_tokens + 1


def view(
    context: tuple[Any, ...],
    generation: tuple[Any, ...],
    limits: Limits,
    *,
    ctx: Sequence[np.ndarray],
    gen: Sequence[np.ndarray],
    slots: np.ndarray,
    last: np.ndarray,
    explicit: tuple[int, ...],
    prompts: dict,
    encoder: bool = False,
    encoder_engine: bool = False,
    flight: FlightLists | None = None,
    plain: tuple[int, int] | None = None,
) -> Batch:
    """The step's ``Batch`` from its checked columns: the only place one is made, whichever
    path read the requests. `ctx` holds the context requests' columns (first position, chunk,
    prompt length, the drafts each carries), `gen` the generation requests' (beam width, prompt
    length, drafts this step, tokens generated per beam); `slots` each request's seq slot,
    context first, and `last` each generation sequence's last token. Drafts ride on a last
    chunk only. `encoder`: the encoder sizes too (a decoder with cross-attention);
    `encoder_engine`: the encoder's own step, context requests sized by their encoder inputs
    alone (the reference's EncoderBuffers::setBufferSizes; no logits). `plain`: a step the
    caller knows has one beam and no draft tokens, with its context tokens and longest context
    prompt (its sizes then need no pass over the columns)."""
    c_begin, c_chunk, c_plen, c_ndraft = ctx
    g_bw, g_plen, g_ndraft, g_max = gen
    n_ctx = len(context)
    if plain is not None:  # one beam, no drafts: the counts are the caller's
        c_drafts, c_input, wide = c_ndraft, c_chunk, False
        seq_len = g_plen + g_max
        sizes = step_sizes(
            n_ctx,
            plain[0],
            0,
            plain[1],
            len(generation),
            len(last),
            0,
            1,
            generation_length(len(generation), 0, limits),
        )
    else:
        if c_ndraft.any():  # drafts ride on a last chunk only
            c_drafts = np.where(c_begin + c_chunk == c_plen, c_ndraft, 0)
            c_input = c_chunk + c_drafts
        else:
            c_drafts, c_input = c_ndraft, c_chunk
        wide = len(last) != len(g_bw)
        seq_len = np.repeat(g_plen + g_max, g_bw) if wide else g_plen + g_max
        gen_drafts = int(g_ndraft.sum())
        sizes = step_sizes(
            n_ctx,
            int(c_input.sum()),
            int(c_drafts.sum()),
            int(c_plen.max()) if n_ctx else 0,
            len(generation),
            len(last),
            gen_drafts,
            int(g_bw.max()) if wide else 1,
            generation_length(len(generation), int(g_ndraft.max()) if gen_drafts else 0, limits),
        )
    if encoder or encoder_engine:
        enc = encoder_sizes(context, generation, limits)
        sizes = dataclasses.replace(sizes, **enc)
    if encoder_engine:
        tokens = enc["num_encoder_input_tokens"]
        sizes = dataclasses.replace(
            sizes,
            num_context_tokens=tokens,
            num_tokens=tokens,
            num_logits=0,
            max_context_length=enc["max_encoder_input_length"] if n_ctx else 0,
        )
    # a frozen Batch with every field set at once: its dataclass __init__ would set each
    # through object.__setattr__ (2 us of a step that makes one)
    b = object.__new__(Batch)
    b.__dict__.update(
        context=context,
        generation=generation,
        sizes=sizes,
        ctx_begin=c_begin,
        ctx_chunk=c_chunk,
        ctx_prompt_len=c_plen,
        ctx_drafts=c_drafts,
        ctx_input_len=c_input,
        gen_beam_width=g_bw,
        gen_prompt_len=g_plen,
        gen_drafts=g_ndraft,
        gen_max_generated=g_max,
        seq_num_tokens=seq_len,
        seq_last_token=last,
        seq_slot=slots,
        explicit_positions=explicit,
        limits=limits,
        prompts=prompts,
        flight=flight,
    )
    if plain is not None and not encoder_engine:  # one query token per generation sequence
        ones = g_bw  # (one beam each)
        d = b.__dict__
        if n_ctx:
            d["seq_query_tokens"] = np.concatenate((c_chunk, ones))
            d["seq_kv_tokens"] = np.concatenate((c_begin + c_chunk, seq_len))
        else:
            d["seq_query_tokens"], d["seq_kv_tokens"] = ones, seq_len
    return b


def int64s(values: Sequence[int]) -> np.ndarray:
    """A flat int64 column of `values` (the builders' small Python lists)."""
    return np.asarray(values, dtype=np.int64).reshape(-1)


def encoder_input_length(r: Any) -> int:
    n = getattr(r, "encoder_input_length", None)
    if n is None:
        ids = getattr(r, "encoder_input_ids", None)
        if ids is None:
            raise BatchError(
                "an encoder-decoder request needs encoder_input_length or encoder_input_ids"
            )
        return len(ids)
    return int(n)


def encoder_output_length(r: Any) -> int:
    n = getattr(r, "encoder_output_length", None)
    return encoder_input_length(r) if n is None else int(n)


def _encoder_lengths(r: Any, w: str, limits: Limits) -> tuple[int, int]:
    """A request's encoder input and output lengths, each an integer within its Config bound
    (the reference checks only the step's sums, so one long request could overrun its rows)."""
    n_in = getattr(r, "encoder_input_length", None)
    if n_in is None:
        ids = getattr(r, "encoder_input_ids", None)
        if ids is None:
            raise BatchError(
                f"{w}: an encoder-decoder request needs encoder_input_length or encoder_input_ids"
            )
        n_in = len(ids)
    n_in = check_int(
        n_in, "encoder_input_length", w, 1, limits.max_input_length + 1, "max_input_length"
    )
    n_out = getattr(r, "encoder_output_length", None)
    n_out = n_in if n_out is None else n_out
    n_out = check_int(
        n_out, "encoder_output_length", w, 1, limits.max_encoder_length + 1, "max_encoder_length"
    )
    return n_in, n_out


def encoder_sizes(context: tuple, generation: tuple, limits: Limits) -> dict[str, int]:
    """The reference's EncoderBuffers::setBufferSizes: sums over the context requests, the
    longest input over every request."""
    tokens = inputs = longest = 0
    for kind, reqs in (("context", context), ("generation", generation)):
        for i, r in enumerate(reqs):
            n_in, n_out = _encoder_lengths(r, _where(f"{kind} request {i}", r), limits)
            longest = max(longest, n_in)
            if kind == "context":
                tokens, inputs = tokens + n_out, inputs + n_in
    return {
        "num_encoder_tokens": tokens,
        "num_encoder_input_tokens": inputs,
        "max_encoder_input_length": max(1, longest),
    }


def _where(kind: str, r: Any) -> str:
    return f"{kind} (seq_slot {show(getattr(r, 'seq_slot', None))})"
