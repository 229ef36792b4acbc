"""A stateless step's requests, read and checked: ``build`` (the entry point of
``prepare_step``) runs every check on the scheduled request objects, so that a bad batch
raises before any buffer is touched, and hands the checked columns to ``batch.view``.

Every value a fill will write is checked here (types, ranges, tokens against the vocabulary,
slots, beams of equal length, explicit positions), each request field read once, column by
column, and each check a vectorised test over the columns: O(1) Python work per request and
per beam, none per token (a context request's prompt is checked once, when it is first
scheduled, and again only when it changed). Only when a check fails are the requests walked
one by one to name the culprit (``diagnose``).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any, NoReturn

import numpy as np

from ..errors import BatchError
from .batch import (
    Batch,
    Limits,
    _where,
    int64s,
    view,
)
from .diagnose import MALFORMED, diagnose, diagnose_slots
from .values import (
    EMPTY,
    INT32_MAX,
    in_range,
    int_array,
    is_int,
    same_requests,
    unread_error,
    unread_set,
)

_POSITION_IDS = attrgetter("position_ids")
_SEQ_SLOT = attrgetter("seq_slot")
_DRAFT_TOKENS = attrgetter("draft_tokens")
_GENERATED = attrgetter("generated")
_PROMPT = attrgetter("prompt")
_LAST = itemgetter(-1)
_IS_NONE = functools.partial(operator.is_, None)

# What a malformed request raises while its columns are read (a str where an int belongs, a
# missing field, ...): the build then walks the requests to name the culprit.


def build(
    context: Sequence[Any],
    generation: Sequence[Any],
    limits: Limits,
    *,
    memo: Memo | None = None,
    encoder: bool = False,
) -> Batch:
    """Validate the scheduled requests and lay them out; raise BatchError on a problem."""
    context, generation = tuple(context), tuple(generation)
    if len(limits.kv_windows) > 1:
        raise BatchError(
            f"layers with different attention windows ({', '.join(map(str, limits.kv_windows))}) "
            "keep block lists per window, which only requests in flight carry: drive these "
            "buffers with add/finish/step"
        )
    try:
        if limits.encoder_engine:
            return _build_encoder_engine(context, generation, limits)
        return _build(context, generation, limits, memo, encoder)
    except BatchError:
        raise
    except MALFORMED as exc:
        diagnose(context, generation, limits)
        raise BatchError(f"the batch is malformed ({type(exc).__name__}: {exc})") from None


@dataclasses.dataclass
class Memo:
    """What ``build`` keeps from one step to the next: the columns of the in-flight
    generation requests that cannot change (reused while the generation list is the last
    step's) and the converted prompts of the context requests still being chunked. Written
    only once every check of the build has passed."""

    generation: _Reused | None = None
    prompts: dict[int, tuple[Any, np.ndarray]] = dataclasses.field(default_factory=dict)
    context: tuple[Any, ...] = ()  # the last step's context requests


def _build(
    context: tuple[Any, ...],
    generation: tuple[Any, ...],
    limits: Limits,
    memo: Memo | None,
    encoder: bool,
) -> Batch:
    def fail() -> NoReturn:
        diagnose(context, generation, limits)
        raise BatchError("the batch is invalid")  # pragma: no cover - diagnose raised

    for size, count in (
        ("num_context_requests", len(context)),
        ("num_generation_requests", len(generation)),
        ("num_requests", len(context) + len(generation)),
    ):  # before the slots: more requests than slots cannot all have one
        if count > limits.max_batch_size:
            raise BatchError(
                f"{size} = {count} exceeds its capacity {limits.max_batch_size}; schedule fewer "
                "requests"
            )
    prompts = _prompt_cache(memo, context)
    c_begin, c_chunk, c_plen, c_ndraft, c_beam = _context_columns(context, limits, prompts, fail)
    # A request's prompt, beam_width, position_ids and seq_slot are fixed while it is in
    # flight, so when the generation list is the previous step's (same objects, same order:
    # steady decoding) those columns are reused (they were checked then) and only the
    # generated tokens and drafts are read.
    static = memo.generation if memo is not None else None
    reused = static is not None and same_requests(static.requests, generation)
    if not reused:
        if limits.unread:  # the fields of the requests the last step did not schedule
            _refuse_unread(_arrived(memo, generation), "generation", limits)
        static = _fixed_columns(generation, limits, fail)
    assert static is not None
    g_ndraft, g_max, last = _generation_columns(generation, static, limits, fail)
    ndraft = np.concatenate((c_ndraft, g_ndraft))
    if ndraft.any():
        beam = np.concatenate((c_beam, static.beam_width))
        if (ndraft > limits.max_draft_tokens).any() or ((ndraft > 0) & (beam > 1)).any():
            fail()
        for d in chain(map(_DRAFT_TOKENS, context), map(_DRAFT_TOKENS, generation)):
            if d is not None and len(d) and not _tokens_ok(d, limits.token_limit):
                fail()
    n_ctx = len(context)
    explicit = tuple(
        [i for i, r in enumerate(context) if r.position_ids is not None]
        + [n_ctx + i for i in static.explicit_at]
    )
    slot_array: np.ndarray | None = static.slots  # the same requests: slots checked then
    if context or not reused:
        slot_array = int_array(list(map(_SEQ_SLOT, context)) + list(map(_SEQ_SLOT, generation)))
        if (
            slot_array is None
            or not in_range(slot_array, 0, limits.max_batch_size)
            or len(np.unique(slot_array)) != len(slot_array)
        ):
            fail()
    assert slot_array is not None
    b = view(
        context,
        generation,
        limits,
        ctx=(c_begin, c_chunk, c_plen, c_ndraft),
        gen=(static.beam_width, static.prompt_len, g_ndraft, g_max),
        slots=slot_array,  # (reused arrays are never written)
        last=last,
        explicit=explicit,
        prompts=prompts,
        encoder=encoder,
    )
    if explicit and not _explicit_positions_ok(
        context, generation, explicit, b.ctx_drafts, g_max, checked=reused
    ):
        fail()
    if memo is not None:  # only once every check of the build has passed
        memo.generation = dataclasses.replace(static, slots=slot_array[n_ctx:])
        memo.context = context
    return b


def _context_columns(
    context: tuple[Any, ...], limits: Limits, prompts: dict, fail: Callable[[], NoReturn]
) -> tuple[np.ndarray, ...]:
    """The context requests' first positions, chunks, prompt lengths, drafts and beams, each
    checked, in one pass in plain Python (context lists are short, and numpy's per-call cost
    outweighs its loops at these sizes; a decode step has none)."""
    if not context:
        return EMPTY, EMPTY, EMPTY, EMPTY, EMPTY
    if limits.unread:
        _refuse_unread(enumerate(context), "context", limits)
    mbw = limits.max_beam_width
    plen_l, begin_l, chunk_l, ndraft_l, beam_l = [], [], [], [], []
    for r in context:
        n, b, x, beam = len(r.prompt), r.context_position, r.context_chunk_size, r.beam_width
        c = n - b if x is None else x
        drafts = r.draft_tokens
        plen_l.append(n)
        begin_l.append(b)
        chunk_l.append(c)
        ndraft_l.append(0 if drafts is None else len(drafts))
        beam_l.append(beam)
        g = r.generated
        if (
            n < 1
            or not 0 <= b < n
            or c < 1
            or b + c > n
            or (g is not None and len(g) and any(map(len, g)))
            or not 1 <= beam <= mbw
        ):
            fail()
    c_begin, c_chunk, c_beam = int_array(begin_l), int_array(chunk_l), int_array(beam_l)
    if c_begin is None or c_chunk is None or c_beam is None:
        fail()  # a float or another non-integer
    for r in context:  # each prompt converted and checked once while it is scheduled
        if _prompt(prompts, r, limits.token_limit) is None:
            fail()
    return c_begin, c_chunk, int64s(plen_l), int64s(ndraft_l), c_beam


def _fixed_columns(
    generation: tuple[Any, ...], limits: Limits, fail: Callable[[], NoReturn]
) -> _Reused:
    """The generation requests' columns that cannot change in flight, checked."""
    plen_list = list(map(len, map(_PROMPT, generation)))
    bw_list = [r.beam_width for r in generation]
    bw = int_array(bw_list)
    if bw is None or (
        generation and (min(plen_list) < 1 or not in_range(bw, 1, limits.max_beam_width + 1))
    ):
        fail()
    explicit = list(map(_POSITION_IDS, generation))
    at = [i for i, p in enumerate(explicit) if p is not None]
    return _Reused(generation, int64s(plen_list), bw, explicit, bw_list, EMPTY, at)


def _generation_columns(
    generation: tuple[Any, ...],
    static: _Reused,
    limits: Limits,
    fail: Callable[[], NoReturn],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each generation request's drafts and tokens generated per beam, and each sequence's
    last token, checked; per-beam columns come from one flat pass over the beams."""
    drafts = list(map(_DRAFT_TOKENS, generation))
    try:
        drafts_list = list(map(len, drafts))
    except TypeError:  # None for no drafts (or not a list: _diagnose names it)
        drafts_list = [0 if d is None else len(d) for d in drafts]
    beams = list(map(_GENERATED, generation))
    if any(map(_IS_NONE, beams)):
        fail()
    flat = list(chain.from_iterable(beams))
    len_list = list(map(len, flat))
    if generation and (list(map(len, beams)) != static.beam_list or min(len_list, default=0) < 1):
        fail()
    last = int_array(list(map(_LAST, flat)))
    if last is None or not in_range(last, 0, limits.token_limit):
        fail()
    g_ndraft = int64s(drafts_list) if any(drafts_list) else np.zeros(len(generation), np.int64)
    seq_len = int64s(len_list)
    seq_offsets = np.cumsum(static.beam_width) - static.beam_width
    g_max = np.maximum.reduceat(seq_len, seq_offsets) if len(seq_len) else seq_len
    if len(flat) != len(generation) and (np.minimum.reduceat(seq_len, seq_offsets) != g_max).any():
        fail()  # beams of unequal length
    return g_ndraft, g_max, last


def _refuse_unread(requests: Iterable[tuple[int, Any]], kind: str, limits: Limits) -> None:
    """No request (index, request) sets a field the family never reads (``Limits.unread``)."""
    for i, r in requests:
        unread = unread_set(r, limits.unread, limits.unread_getter)
        if unread is not None:
            raise unread_error(_where(f"{kind} request {i}", r), unread, limits.family)


def _arrived(memo: Memo | None, generation: tuple[Any, ...]) -> list[tuple[int, Any]]:
    """The generation requests (index, request) that the last step did not schedule (those it
    did had their fields read then): a generation request is usually the last step's."""
    if memo is None:
        return list(enumerate(generation))
    try:  # the memo holds the last step's requests
        new = set(generation).difference(memo.context)
        if new and memo.generation is not None:
            new.difference_update(memo.generation.requests)
    except TypeError:  # request objects that cannot be hashed: each is looked at
        return list(enumerate(generation))
    return [(i, r) for i, r in enumerate(generation) if r in new] if new else []


@dataclasses.dataclass(frozen=True)
class _Reused:
    """The columns of the last step's generation requests that cannot change in flight."""

    requests: tuple[Any, ...]
    prompt_len: np.ndarray
    beam_width: np.ndarray
    explicit: list
    beam_list: list
    slots: np.ndarray
    explicit_at: list


def _build_encoder_engine(
    context: tuple[Any, ...], generation: tuple[Any, ...], limits: Limits
) -> Batch:
    """An encoder engine's step: context requests only, sized by their encoder inputs alone
    (the reference's EncoderBuffers::setBufferSizes; the decoder prompt is not read)."""
    if generation:
        raise BatchError(
            "the encoder engine runs context requests only; got "
            f"{len(generation)} generation requests"
        )
    if limits.unread:
        _refuse_unread(enumerate(context), "context", limits)
    slots = int_array(list(map(_SEQ_SLOT, context)))
    if (
        slots is None
        or not in_range(slots, 0, limits.max_batch_size)
        or len(np.unique(slots)) != len(slots)
    ):
        diagnose_slots(context, (), limits)
    zeros = np.zeros(len(context), np.int64)
    return view(
        context,
        (),
        limits,
        ctx=(zeros, zeros, zeros, zeros),
        gen=(EMPTY, EMPTY, EMPTY, EMPTY),
        slots=slots if slots is not None else EMPTY,
        last=EMPTY,
        explicit=(),
        prompts={},
        encoder_engine=True,
    )


def _prompt(prompts: dict, r: Any, token_limit: int) -> np.ndarray | None:
    """Context request r's prompt as a checked int64 array, converted once per request and kept
    while the request is scheduled (a long prompt is read in chunks over several steps) and its
    prompt compares equal to the copy it was converted from (a list refilled in place is read
    again); None if a token is not an integer in the vocabulary."""
    prompt = r.prompt
    cached = prompts.get(id(r))
    if cached is not None and _unchanged(cached[0], prompt):
        return cached[1]
    a = int_array(prompt)
    if a is None or not in_range(a, 0, token_limit):
        return None
    if a is prompt:  # an int64 array: ours is a copy
        a = a.copy()
    # what the next step compares with: a tuple cannot change, a list or an array can
    kept = prompt if type(prompt) is tuple else list(prompt) if type(prompt) is list else a
    prompts[id(r)] = (kept, a)
    return a


def _unchanged(kept: Any, prompt: Any) -> bool:
    """The prompt still holds the tokens of `kept` (what ``_prompt`` kept from it)."""
    if type(prompt) is tuple or type(prompt) is list:
        return kept is prompt or type(kept) is type(prompt) and kept == prompt
    if isinstance(prompt, np.ndarray) and isinstance(kept, np.ndarray):
        return kept.shape == prompt.shape and bool((kept == prompt).all())
    return False


def _tokens_ok(tokens: Any, token_limit: int) -> bool:
    a = int_array(tokens)
    return a is not None and in_range(a, 0, token_limit)


def _explicit_positions_ok(
    context: tuple[Any, ...],
    generation: tuple[Any, ...],
    explicit: tuple[int, ...],
    c_drafts: np.ndarray,
    g_max: np.ndarray,
    checked: bool,
) -> bool:
    """Explicit position ids: one integer per prompt token, every position written (drafts and
    generated tokens continue after the last one) inside the int32 range. The lists of
    generation requests carried over from the last step were checked then (`checked`)."""
    n_ctx = len(context)
    for i in explicit:
        r = context[i] if i < n_ctx else generation[i - n_ctx]
        after = int(c_drafts[i]) if i < n_ctx else int(g_max[i - n_ctx])
        if i >= n_ctx and checked:
            last = r.position_ids[-1]
            if not is_int(last) or not 0 <= last <= INT32_MAX - after:
                return False
            continue
        a = int_array(r.position_ids)
        if (
            a is None
            or len(a) != len(r.prompt)
            or not in_range(a, 0, INT32_MAX + 1)
            or int(a[-1]) + after > INT32_MAX
        ):
            return False
    return True


def _prompt_cache(memo: Memo | None, context: tuple) -> dict:
    """The prompt arrays of this step's context requests, carried over from the last step."""
    if memo is None:
        return {}
    previous = memo.prompts
    kept = {id(r): previous[id(r)] for r in context if id(r) in previous}
    memo.prompts = kept
    return kept
