"""Where the real-model tests of the stateful families (tests/test_mamba_model.py,
tests/test_recurrentgemma_model.py) make their one wrong value, and what its failure must
say: a picker chooses a row of a step of the clean run, ``first_target`` the first step it
picks."""

from __future__ import annotations


def first_row(kind, row_ok):
    """A picker: the first row of a `kind` step for which row_ok(step, row) holds, or None."""

    def pick(s):
        if s.kind == kind:
            return next((i for i in range(len(s.rids)) if row_ok(s, i)), None)
        return None

    return pick


def first_target(steps, pick) -> tuple[int, int]:
    """(step, row) of the first step of `steps` that `pick` picks a row of."""
    for s in steps:
        row = pick(s)
        if row is not None:
            return s.step, row
    raise AssertionError("the workload has no step for this mutation")


def assert_fails_at(exc, step: int, name: str) -> None:
    """The comparison's Mismatch (`exc`, from pytest.raises) names `step` and the logits."""
    message = str(exc.value)
    print(f"{name}: {message}")
    assert message.startswith(f"step {step} (") and "logits differ from transformers" in message
