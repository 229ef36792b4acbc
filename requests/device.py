"""What a step built on the device (``build='device'``) runs: the device forms lay a step out
as one token per generation row, so a request in flight there has one beam, no explicit
position ids and no draft tokens. Refused by the call that hands them over (``add``, and
``step`` for drafts), never by a later step."""

from __future__ import annotations

from typing import Any

from ..errors import BatchError


def admit(entry: Any) -> None:
    """BatchError for a request arriving with what the device build does not run."""
    if entry.beam_width != 1:
        what = f"beam_width {entry.beam_width}"
    elif entry.position_ids is not None:
        what = "explicit position_ids"
    elif entry.context_drafts:
        what = "draft tokens"
    else:
        return
    raise BatchError(
        f"request (seq_slot {entry.seq_slot}): the device build (build='device') runs one beam "
        f"per request, without explicit position ids or draft tokens; this request has {what}: "
        "use build='host' for it"
    )


def refuse_drafts(drafts: Any, accepted: Any) -> None:
    """BatchError for a step handing over draft tokens or accepted counts (anything but None
    or an empty mapping)."""
    if _given(drafts) or _given(accepted):
        raise BatchError(
            "step(): the device build (build='device') runs no draft tokens; use build='host' "
            "for speculative decoding"
        )


def _given(value: Any) -> bool:
    if value is None:
        return False
    try:
        return len(value) > 0
    except TypeError:  # not even sized: given, and refused
        return True
