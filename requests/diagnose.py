"""The cold path of reading requests: walk them one by one, field by field, and raise a
BatchError naming the first request and field that is wrong. The vectorised readers
(``stateless.build``, ``RequestTable.add``) call it only once they know something is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import BatchError
from .batch import Limits, _where
from .values import INT32_MAX, check_draft_count, check_int, check_ints, show

MALFORMED = (TypeError, ValueError, OverflowError, AttributeError, IndexError, KeyError)


def diagnose(context: Sequence[Any], generation: Sequence[Any], limits: Limits) -> None:
    """Walk the requests one by one and raise for the first problem (the cold path)."""
    for kind, reqs in (("context", context), ("generation", generation)):
        for i, r in enumerate(reqs):
            w = _where(f"{kind} request {i}", r)
            try:
                check_request(r, w, limits, kind == "context")
            except BatchError:
                raise
            except MALFORMED as exc:
                raise BatchError(f"{w}: malformed request ({type(exc).__name__}: {exc})") from None
    diagnose_slots(context, generation, limits)


def diagnose_slots(context: Sequence[Any], generation: Sequence[Any], limits: Limits) -> None:
    seen: dict[int, str] = {}
    for kind, reqs in (("context request", context), ("generation request", generation)):
        for i, r in enumerate(reqs):
            w = _where(f"{kind} {i}", r)
            slot = getattr(r, "seq_slot", None)
            slot = check_int(slot, "seq_slot", w, 0, limits.max_batch_size)
            if slot in seen:
                raise BatchError(f"{w}: seq_slot {slot} is also used by {seen[slot]}")
            seen[slot] = w


def _length(value: Any, what: str, w: str) -> int:
    try:
        return len(value)
    except TypeError:
        raise BatchError(f"{w}: {what} must be a list, got {show(value)}") from None


def check_request(r: Any, w: str, limits: Limits, is_context: bool) -> None:
    """One request's fields against the limits, as a context or a generation request; a
    BatchError that names `w` and the field otherwise."""
    vocab = (0, limits.token_limit, limits.token_limit_text)
    prompt = r.prompt
    n = _length(prompt, "prompt", w)
    if n == 0:
        raise BatchError(f"{w}: the prompt is empty")
    beam = check_int(r.beam_width, "beam_width", w, 1, limits.max_beam_width + 1, "max_beam_width")
    drafts = r.draft_tokens
    n_drafts = 0 if drafts is None else _length(drafts, "draft_tokens", w)
    check_draft_count(n_drafts, beam, limits.max_draft_tokens, w)
    if n_drafts:
        check_ints(drafts, "draft_tokens", w, *vocab)
    if r.position_ids is not None:
        if _length(r.position_ids, "position_ids", w) != n:
            raise BatchError(f"{w}: {len(r.position_ids)} position_ids for a prompt of {n} tokens")
        check_ints(r.position_ids, "position_ids", w, 0, INT32_MAX + 1)
    gen = r.generated
    if is_context:
        b = check_int(r.context_position, "context_position", w, 0, n, f"a prompt of {n} tokens")
        c = r.context_chunk_size
        c = n - b if c is None else check_int(c, "context_chunk_size", w, 1, INT32_MAX + 1)
        if b + c > n:
            raise BatchError(
                f"{w}: context_chunk_size {c} at context_position {b} runs past the prompt of {n} tokens"
            )
        if gen is not None and _length(gen, "generated", w) and any(map(len, gen)):
            raise BatchError(f"{w}: a context request must not have generated tokens")
        check_ints(prompt, "prompt", w, *vocab)
        if (
            r.position_ids is not None
            and r.position_ids[-1] + (n_drafts if b + c == n else 0) > INT32_MAX
        ):
            raise BatchError(f"{w}: its draft tokens' positions run past the int32 range")
        return
    if gen is None or _length(gen, "generated", w) != beam:
        got = 0 if gen is None else len(gen)
        raise BatchError(f"{w}: 'generated' has {got} beams, beam_width is {beam}")
    lengths = [_length(g, "each beam of 'generated'", w) for g in gen]
    if min(lengths) < 1:
        raise BatchError(f"{w}: a generation request needs at least one generated token per beam")
    if len(set(lengths)) > 1:
        raise BatchError(
            f"{w}: its beams must be of equal length (beam search extends every beam each "
            f"step), got {lengths}"
        )
    for k, g in enumerate(gen):
        check_int(g[-1], f"the last token of beam {k}", w, *vocab)
    if r.position_ids is not None and r.position_ids[-1] + lengths[0] > INT32_MAX:
        raise BatchError(f"{w}: its generated tokens' positions run past the int32 range")
