"""One step's batch, validated and laid out once for every fill rule to read.

``Batch.build`` runs every check on the scheduled requests (so that a bad batch raises before
any buffer is touched) and computes the step sizes of the reference's setBufferSizes and the
per-request and per-sequence columns the fill rules vectorise over.

Row layout (reference, buffer-inventory §0): context requests one row each in scheduled order,
then the beams of each generation request in order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from .errors import BatchError


@dataclasses.dataclass(frozen=True, slots=True)
class StepSizes:
    """The sizes of one step (the reference's setBufferSizes)."""

    num_context_requests: int
    num_context_tokens: int
    num_generation_requests: int
    num_generation_sequences: int
    num_generation_tokens: int
    num_logits: int
    num_sequences: int
    num_tokens: int
    num_requests: int
    max_context_length: int
    # computed only for families that read them (encoder-decoder models)
    num_encoder_tokens: int = 0
    num_encoder_input_tokens: int = 0
    max_encoder_input_length: int = 0

    def generation_bucket(self, rows: int) -> StepSizes:
        """The sizes of a generation-only step (one token per sequence) padded to `rows`
        sequences: the shapes a CUDA graph for that batch bucket is captured with."""
        if (
            self.num_context_requests
            or self.num_tokens != self.num_sequences
            or rows < self.num_sequences
        ):
            raise ValueError(
                "a generation bucket needs a generation-only step without draft tokens, "
                f"padded to at least its {self.num_sequences} sequences"
            )
        return dataclasses.replace(
            self,
            num_generation_requests=rows,
            num_generation_sequences=rows,
            num_generation_tokens=rows,
            num_logits=rows,
            num_sequences=rows,
            num_tokens=rows,
            num_requests=rows,
        )


STEP_SIZES = tuple(f.name for f in dataclasses.fields(StepSizes))
# computed only when a family's shapes read them (``Batch.build(encoder=True)``)
ENCODER_SIZES = ("num_encoder_tokens", "num_encoder_input_tokens", "max_encoder_input_length")


_POSITION_IDS = attrgetter("position_ids")
_SEQ_SLOT = attrgetter("seq_slot")
_DRAFT_TOKENS = attrgetter("draft_tokens")
_GENERATED = attrgetter("generated")
_LAST = itemgetter(-1)

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def _i64(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Batch:  # not slotted: cached_property needs __dict__
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
    prompts: dict = dataclasses.field(default_factory=dict, repr=False)  # see prompt_array
    scratch: dict = dataclasses.field(default_factory=dict, repr=False)  # rule checks -> fills
    # state the fill rules keep from step to step (owned by the RuntimeBuffers; written only
    # by fills, after every check passed)
    carry: dict = dataclasses.field(default_factory=dict, repr=False)

    @staticmethod
    def build(
        context: Sequence[Any],
        generation: Sequence[Any],
        *,
        max_beam_width: int = 1,
        max_draft_tokens: int = 0,
        reuse: dict | None = None,
        encoder: bool = False,
    ) -> Batch:
        """Validate the scheduled requests and lay them out; raise BatchError on a problem.

        Each request field is read once, column by column (one comprehension per field), and
        every check is a vectorised test over the columns: O(1) Python work per request and per
        beam, none per token. Only when a check fails are the requests walked one by one to
        name the culprit (``_diagnose``).
        """
        context, generation = tuple(context), tuple(generation)
        limits = (max_beam_width, max_draft_tokens)

        # ---- context columns: one pass in plain Python (context lists are short, and numpy's
        # per-call cost outweighs its loops at these sizes; a decode step has none)
        if context:
            plen_l, begin_l, chunk_l, ndraft_l, beam_l = [], [], [], [], []
            bad = False
            for r in context:
                n, b, x, beam = (
                    len(r.prompt),
                    r.context_position,
                    r.context_chunk_size,
                    r.beam_width,
                )
                c = n - b if x is None else x
                drafts = r.draft_tokens
                plen_l.append(n)
                begin_l.append(b)
                chunk_l.append(c)
                ndraft_l.append(len(drafts) if drafts else 0)
                beam_l.append(beam)
                if (
                    n < 1
                    or not 0 <= b < n
                    or c < 1
                    or b + c > n
                    or (r.generated and any(r.generated))
                    or not 1 <= beam <= max_beam_width
                ):
                    bad = True
            c_plen, c_begin, c_chunk = _i64(plen_l), _i64(begin_l), _i64(chunk_l)
            c_ndraft, c_beam = _i64(ndraft_l), _i64(beam_l)
            c_explicit = [r.position_ids for r in context]
        else:
            c_plen = c_begin = c_chunk = c_ndraft = c_beam = _EMPTY
            c_explicit = []
            bad = False

        # ---- generation columns; per-beam columns come from one flat pass over the beams.
        # A request's prompt, beam_width, position_ids and seq_slot are fixed while it is in
        # flight, so when the generation list is the previous step's (same objects, same order:
        # steady decoding) those columns are reused and only the generated tokens and drafts
        # are read. Checks on the plain lists use Python's C builtins (cheaper than numpy for
        # the sizes of a batch).
        static = reuse.get("generation") if reuse is not None else None
        if static is not None and static[0] == generation:
            _, g_plen, g_bw, g_explicit, g_slots, bw_list, _, g_explicit_at = static
        else:
            plen_list = [len(r.prompt) for r in generation]
            bw_list = [r.beam_width for r in generation]
            if generation and (
                min(plen_list) < 1 or min(bw_list) < 1 or max(bw_list) > max_beam_width
            ):
                bad = True
            g_plen, g_bw = _i64(plen_list), _i64(bw_list)
            g_explicit = list(map(_POSITION_IDS, generation))
            g_slots = list(map(_SEQ_SLOT, generation))
            g_explicit_at = [i for i, p in enumerate(g_explicit) if p is not None]
        drafts = list(map(_DRAFT_TOKENS, generation))
        drafts_list = [len(d) if d else 0 for d in drafts] if any(drafts) else None
        beams = list(map(_GENERATED, generation))
        if None in beams:
            bad = True
            beams = [bs or () for bs in beams]
        flat = list(chain.from_iterable(beams))
        len_list = list(map(len, flat))
        if generation and (list(map(len, beams)) != bw_list or min(len_list) < 1):
            bad = True
        g_ndraft = _i64(drafts_list) if drafts_list else np.zeros(len(generation), np.int64)
        seq_len = _i64(len_list)

        ndraft = np.concatenate((c_ndraft, g_ndraft))
        if not bad and ndraft.any():
            beam = np.concatenate((c_beam, g_bw))
            bad = bool((ndraft > max_draft_tokens).any() or ((ndraft > 0) & (beam > 1)).any())
        n_ctx = len(context)
        explicit = tuple(
            [i for i, p in enumerate(c_explicit) if p is not None]
            + [n_ctx + i for i in g_explicit_at]
        )
        if not bad and explicit:
            lens = np.concatenate((c_plen, g_plen))
            bad = any(len((c_explicit + g_explicit)[i]) != lens[i] for i in explicit)
        if not context and static is not None and static[0] == generation:
            slot_array = static[6]  # the same requests as the last step: slots checked then
        else:
            slots = list(map(_SEQ_SLOT, context)) + g_slots
            slot_array = np.asarray(slots) if slots else _EMPTY
            if (
                slot_array.dtype.kind not in "iu"
                or (len(slot_array) and slot_array.min() < 0)
                or len(set(slots)) != len(slots)
            ):
                bad = True
        if bad:
            _diagnose(context, generation, *limits)
        if reuse is not None:
            g_slot_array = slot_array[len(context) :]
            reuse["generation"] = (
                generation,
                g_plen,
                g_bw,
                g_explicit,
                g_slots,
                bw_list,
                g_slot_array,
                g_explicit_at,
            )

        c_drafts = np.where(c_begin + c_chunk == c_plen, c_ndraft, 0)  # drafts ride on a last chunk
        c_input = c_chunk + c_drafts
        seq_offsets = np.cumsum(g_bw) - g_bw
        g_max = np.maximum.reduceat(seq_len, seq_offsets) if len(seq_len) else seq_len
        n_gen = len(generation)
        n_gen_seq = len(flat)
        ctx_tokens = int(c_input.sum())
        gen_tokens = int(g_ndraft.sum()) + n_gen_seq
        sizes = StepSizes(
            num_context_requests=n_ctx,
            num_context_tokens=ctx_tokens,
            num_generation_requests=n_gen,
            num_generation_sequences=n_gen_seq,
            num_generation_tokens=gen_tokens,
            num_logits=n_ctx + int(c_drafts.sum()) + gen_tokens,
            num_sequences=n_ctx + n_gen_seq,
            num_tokens=ctx_tokens + gen_tokens,
            num_requests=n_ctx + n_gen,
            max_context_length=int(c_plen.max()) if n_ctx else 0,
        )
        if encoder:
            sizes = dataclasses.replace(sizes, **_encoder_sizes(context, generation))
        return Batch(
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
            seq_num_tokens=np.repeat(g_plen, g_bw) + seq_len,
            seq_last_token=_i64(list(map(_LAST, flat))),
            seq_slot=slot_array.astype(np.int64, copy=False),  # (reused arrays are never written)
            explicit_positions=explicit,
            prompts=_prompt_cache(reuse, context),
            carry=reuse.setdefault("rules", {}) if reuse is not None else {},
        )

    def prompt_array(self, i: int) -> np.ndarray:
        """Context request i's prompt as an int64 array, converted once per request and kept
        while the request is scheduled (a long prompt is read in chunks over several steps)."""
        r = self.context[i]
        cached = self.prompts.get(id(r))
        if cached is None or cached[0] is not r.prompt:
            cached = self.prompts[id(r)] = (r.prompt, np.asarray(r.prompt, dtype=np.int64))
        return cached[1]

    @functools.cached_property
    def seq_request(self) -> np.ndarray:
        """The generation request of each generation sequence."""
        return np.repeat(np.arange(len(self.generation)), self.gen_beam_width)

    @functools.cached_property
    def seq_first(self) -> np.ndarray:
        """The first generation sequence of each generation request."""
        return np.cumsum(self.gen_beam_width) - self.gen_beam_width

    def per_sequence(self, gen_values: np.ndarray) -> np.ndarray:
        """Repeat one value per generation request over its beams."""
        if self.sizes.num_generation_sequences == self.sizes.num_generation_requests:
            return gen_values  # one beam each
        return np.repeat(gen_values, self.gen_beam_width)

    @functools.cached_property
    def past_key_value_lengths(self) -> np.ndarray:
        """KV length of each sequence after this step (reference §2.3.7)."""
        gen = self.per_sequence(self.gen_prompt_len + self.gen_max_generated - 1)
        if not self.context:
            return gen
        return np.concatenate((self.ctx_begin + self.ctx_input_len, gen))


def encoder_input_length(r: Any) -> int:
    n = getattr(r, "encoder_input_length", None)
    if n is None:
        ids = getattr(r, "encoder_input_ids", None)
        if ids is None:
            raise BatchError(
                "an encoder-decoder request needs encoder_input_length or encoder_input_ids"
            )
        n = len(ids)
    return int(n)


def encoder_output_length(r: Any) -> int:
    n = getattr(r, "encoder_output_length", None)
    return encoder_input_length(r) if n is None else int(n)


def _encoder_sizes(context: tuple, generation: tuple) -> dict[str, int]:
    """The reference's EncoderBuffers::setBufferSizes: sums over the context requests, the
    longest input over every request."""
    tokens = inputs = longest = 0
    for kind, reqs in (("context", context), ("generation", generation)):
        for i, r in enumerate(reqs):
            try:
                n_in, n_out = encoder_input_length(r), encoder_output_length(r)
                if n_out < 1:
                    raise BatchError("its encoder output is empty")
            except BatchError as exc:
                raise BatchError(f"{_where(f'{kind} request {i}', r)}: {exc}") from None
            longest = max(longest, n_in)
            if kind == "context":
                tokens, inputs = tokens + n_out, inputs + n_in
    return {
        "num_encoder_tokens": tokens,
        "num_encoder_input_tokens": inputs,
        "max_encoder_input_length": max(1, longest),
    }


def _prompt_cache(reuse: dict | None, context: tuple) -> dict:
    """The prompt arrays of this step's context requests, carried over from the last step."""
    if reuse is None:
        return {}
    previous = reuse.get("prompts", {})
    kept = {id(r): previous[id(r)] for r in context if id(r) in previous}
    reuse["prompts"] = kept
    return kept


def _where(kind: str, r: Any) -> str:
    return f"{kind} (seq_slot {getattr(r, 'seq_slot', None)!r})"


def _diagnose(
    context: Sequence[Any], generation: Sequence[Any], max_beam_width: int, max_draft_tokens: int
) -> None:
    """Walk the requests one by one and raise for the first problem (the cold path)."""
    for i, r in enumerate(context):
        _check_request(r, _where(f"context request {i}", r), max_beam_width, max_draft_tokens, True)
    for i, r in enumerate(generation):
        _check_request(
            r, _where(f"generation request {i}", r), max_beam_width, max_draft_tokens, False
        )
    seen: dict[int, str] = {}
    for kind, reqs in (("context request", context), ("generation request", generation)):
        for i, r in enumerate(reqs):
            w = _where(f"{kind} {i}", r)
            slot = r.seq_slot
            if not (type(slot) is int or isinstance(slot, np.integer)):
                raise BatchError(f"{w}: seq_slot must be an integer, got {slot!r}")
            if slot < 0:
                raise BatchError(f"{w}: seq_slot must not be negative")
            if int(slot) in seen:
                raise BatchError(f"{w}: seq_slot {slot} is also used by {seen[int(slot)]}")
            seen[int(slot)] = w
    raise BatchError("the batch is invalid")  # pragma: no cover - a check above fires first


def _check_request(
    r: Any, w: str, max_beam_width: int, max_draft_tokens: int, is_context: bool
) -> None:
    n = len(r.prompt)
    beam = r.beam_width
    drafts = len(r.draft_tokens) if r.draft_tokens else 0
    if n == 0:
        raise BatchError(f"{w}: the prompt is empty")
    if not 1 <= beam <= max_beam_width:
        raise BatchError(f"{w}: beam_width {beam} is outside 1..{max_beam_width} (max_beam_width)")
    if drafts and beam > 1:
        raise BatchError(f"{w}: draft tokens need beam_width 1, got {beam}")
    if drafts > max_draft_tokens:
        raise BatchError(f"{w}: {drafts} draft tokens exceed max_draft_tokens={max_draft_tokens}")
    if r.position_ids is not None and len(r.position_ids) != n:
        raise BatchError(f"{w}: {len(r.position_ids)} position_ids for a prompt of {n} tokens")
    if is_context:
        b = r.context_position
        c = n - b if r.context_chunk_size is None else r.context_chunk_size
        if not 0 <= b < n:
            raise BatchError(f"{w}: context_position {b} is outside the prompt of {n} tokens")
        if c < 1 or b + c > n:
            raise BatchError(
                f"{w}: context_chunk_size {c} at context_position {b} runs past the prompt of {n} tokens"
            )
        if r.generated and any(r.generated):
            raise BatchError(f"{w}: a context request must not have generated tokens")
        return
    gen = r.generated or ()
    if len(gen) != beam:
        raise BatchError(f"{w}: 'generated' has {len(gen)} beams, beam_width is {beam}")
    if not all(gen):
        raise BatchError(f"{w}: a generation request needs at least one generated token per beam")
