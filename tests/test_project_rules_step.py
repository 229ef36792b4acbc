"""A project rule that misbehaves at step time (a fill that returns a bad count, an
implementation that raises) is named in the BatchError, and its step abandoned: the last step
stays current."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from project_spec import with_token_tensors

from bufc.codegen import compile_text
from bufc.runtime import BatchError, Request

# ------------------------------------------------------------- a fill's returned count
COUNT_SPEC = with_token_tensors(
    textwrap.dedent(
        """\
        version: 1
        parameters:
          max_batch_size: {doc: Requests., min: 1}
          max_num_tokens: {doc: Tokens., min: 1}
        sizes:
          num_tokens: {doc: Tokens., max: "max_num_tokens"}
          num_sequences: {doc: Sequences., max: "max_batch_size"}
        rules:
          marks:
            doc: one mark per input token
            impl: countpkg.rules:marks
            dtypes: [int32]
            shape: ["num_tokens"]
            sizes: [num_tokens]
            advance: countpkg.rules:advance_marks
        families:
          fam: {doc: A decoder with a project tensor.}
        tensors:
          - TOKEN_TENSORS
          - name: host_marks
            doc: A mark per token.
            dtype: int32
            memory: pinned
            capacity: ["max_num_tokens"]
            shape: ["num_tokens"]
            fill: {rule: marks}
            pad: -1
          - name: marks
            doc: Device copy of host_marks.
            memory: device
            fill: {mirror: host_marks}
            bind: [{input: marks}]
        """
    )
)

COUNT_RULES = textwrap.dedent(
    """\
    import numpy as np

    COUNT = None  # the test's bad count: COUNT(n, len(out)) instead of n


    def marks(out, b):
        n = b.sizes.num_tokens
        out[:n] = np.arange(7, 7 + n)
        return n if COUNT is None else COUNT(n, len(out))


    def advance_marks(out, prev, d):
        n = len(d.tokens)
        np.add(prev[:n], 1, out=out[:n])
        return n if COUNT is None else COUNT(n, len(out))
    """
)

BAD_COUNTS = {
    "-1": lambda n, size: -1,
    "3.0": lambda n, size: 3.0,
    "1000000000000000000": lambda n, size: 10**18,
    "True": lambda n, size: True,
    "21": lambda n, size: size + 5,  # len(out) + 5
    "None": lambda n, size: None,
    "np.float64(3.0)": lambda n, size: np.float64(3),
    "np.int64(-2)": lambda n, size: np.int64(-2),
}


def _generated_project(tmp_path: Path, monkeypatch, package: str, spec: str, rules: str):
    """The family `fam` of `spec` generated as module `{package}_fam` beside its rules module
    `{package}.rules` (source `rules`), both imported afresh; yields (module, rules) and
    forgets both after."""
    from bufc.codegen import emit

    names = (package, f"{package}.rules", f"{package}_fam")
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "rules.py").write_text(rules)
    (tmp_path / f"{package}_fam.py").write_text(emit.render_all(compile_text(spec))["fam.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module(names[2]), importlib.import_module(names[1])
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The generated module of COUNT_SPEC and its rules module (countpkg.rules)."""
    yield from _generated_project(tmp_path, monkeypatch, "countpkg", COUNT_SPEC, COUNT_RULES)


def _same_tensors(a, b) -> None:
    ta, tb = a.tensors, b.tensors
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


@pytest.mark.parametrize("shown", BAD_COUNTS)
def test_a_project_fill_that_returns_a_bad_count_is_named_and_its_step_abandoned(counted, shown):
    fam, rules = counted
    config = fam.Config(max_batch_size=4, max_num_tokens=16)
    buffers, twin = fam.RuntimeBuffers(config), fam.RuntimeBuffers(config)
    for b in (buffers, twin):  # a long step: its rows past the next ones must be re-padded
        b.prepare_step([Request(seq_slot=0, prompt=list(range(1, 9)))], [])
    rules.COUNT = BAD_COUNTS[shown]
    with pytest.raises(BatchError) as info:
        buffers.prepare_step([Request(seq_slot=1, prompt=[4, 5, 6])], [])
    assert str(info.value) == (
        f"fill of tensor 'host_marks' (rule countpkg.rules:marks) returned {shown}; a fill "
        "returns the number of elements it wrote, an int in 0..16. The step was abandoned "
        "and the last step stays current"
    )
    _same_tensors(buffers, twin)  # the last step stays current
    rules.COUNT = None
    generation = Request(seq_slot=2, prompt=[3, 4], generated=[[5]])
    for b in (buffers, twin):  # a shorter step
        b.prepare_step([], [generation])
    _same_tensors(buffers, twin)

    # the same from the rule's advance form
    rules.COUNT = BAD_COUNTS[shown]
    with pytest.raises(BatchError) as info:
        buffers.advance([6])
    assert str(info.value) == (
        "advance(): the advance form of rule countpkg.rules:marks (tensor 'host_marks') "
        f"returned {shown}; an advance form returns the number of elements it wrote, an int "
        "in 0..16. The step was abandoned and the last step stays current"
    )
    _same_tensors(buffers, twin)
    rules.COUNT = None
    for b in (buffers, twin):
        b.advance([6])
    _same_tensors(buffers, twin)


def test_a_project_fill_may_count_in_a_numpy_integer(counted):
    fam, rules = counted
    buffers = fam.RuntimeBuffers(fam.Config(max_batch_size=4, max_num_tokens=16))
    rules.COUNT = lambda n, size: np.int32(n)
    step = buffers.prepare_step([Request(seq_slot=0, prompt=[1, 2, 3])], [])
    assert step.inputs["marks"].tolist() == [7, 8, 9]


# ------------------------------------------------- a project rule that raises at step time
FAIL_SPEC = with_token_tensors(
    textwrap.dedent(
        """\
        version: 1
        parameters:
          max_batch_size: {doc: Requests., min: 1}
          max_num_tokens: {doc: Tokens., min: 1}
        sizes:
          num_tokens: {doc: Tokens., max: "max_num_tokens"}
          num_sequences: {doc: Sequences., max: "max_batch_size"}
        request_checks:
          first_mark:
            doc: The first mark of the step.
            impl: failpkg.rules:check_marks
            result: true
        rules:
          marks:
            doc: one mark per sequence
            impl: failpkg.rules:marks
            dtypes: [int32]
            shape: ["num_sequences"]
            sizes: [num_sequences]
            check: first_mark
            advance: failpkg.rules:advance_marks
            advance_check: {impl: failpkg.rules:check_advance_marks}
            device_advance: failpkg.rules:device_advance_marks
        families:
          fam: {doc: A decoder with a project tensor in every form.}
        tensors:
          - TOKEN_TENSORS
          - name: host_marks
            doc: A mark per sequence.
            dtype: int32
            memory: pinned
            capacity: ["max_batch_size"]
            shape: ["num_sequences"]
            fill: {rule: marks}
            pad: -1
          - name: marks
            doc: Device copy of host_marks.
            memory: device
            fill: {mirror: host_marks}
            bind: [{input: marks}]
        """
    )
)

FAIL_RULES = textwrap.dedent(
    """\
    import numpy as np

    FAIL = set()  # the forms that raise: check, fill, advance_check, advance, device_advance


    def _broken(form):  # a helper: the error names the implementation that called it
        if form in FAIL:
            raise ValueError(f"{form} is broken")


    def check_marks(b):
        _broken("check")
        return 7


    def marks(out, b, first):
        n = b.sizes.num_sequences
        out[:n] = np.arange(first, first + n)  # written before it raises: the step is abandoned
        _broken("fill")
        return n


    def check_advance_marks(d):
        _broken("advance_check")


    def advance_marks(out, prev, d):
        n = len(d.tokens)
        np.add(prev[:n], 1, out=out[:n])
        _broken("advance")
        return n


    def device_advance_marks(mirror, d):
        mirror[: len(d.tokens)] += 1
        _broken("device_advance")
    """
)

RAISED = {
    "check": "request check 'first_mark' (failpkg.rules:check_marks)",
    "fill": "rule 'marks' (failpkg.rules:marks)",
    "advance_check": "the advance check of rule 'marks' (failpkg.rules:check_advance_marks)",
    "advance": "the advance form of rule 'marks' (failpkg.rules:advance_marks)",
    "device_advance": "the device advance form of rule 'marks' "
    "(failpkg.rules:device_advance_marks)",
}


@pytest.fixture
def failing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The generated module of FAIL_SPEC and its rules module (failpkg.rules)."""
    yield from _generated_project(tmp_path, monkeypatch, "failpkg", FAIL_SPEC, FAIL_RULES)


def _raises(buffers, rules, form: str, step) -> None:
    """`step(buffers)` with the implementation of `form` broken: the BatchError names it."""
    rules.FAIL = {form}
    try:
        with pytest.raises(BatchError) as info:
            step(buffers)
    finally:
        rules.FAIL = set()
    where = ", on the host and the device" if form == "device_advance" else ""
    assert str(info.value) == (
        f"{RAISED[form]} raised ValueError: {form} is broken; the step was abandoned and the "
        f"last step stays current{where}"
    )
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("form", ["check", "fill", "advance_check", "advance"])
def test_a_project_rule_that_raises_at_step_time_is_named_and_its_step_abandoned(failing, form):
    fam, rules = failing
    config = fam.Config(max_batch_size=4, max_num_tokens=16)
    buffers, twin = fam.RuntimeBuffers(config), fam.RuntimeBuffers(config)
    long = [Request(seq_slot=s, prompt=[1, 2, 3]) for s in range(3)]
    generation = Request(seq_slot=3, prompt=[3, 4], generated=[[5]])
    for b in (buffers, twin):  # a longer step: its rows past the next ones must be re-padded
        b.prepare_step(long, [])
        if form.startswith("advance"):
            b.prepare_step([], [generation])
    if form.startswith("advance"):
        _raises(buffers, rules, form, lambda b: b.advance([6]))
    else:
        _raises(buffers, rules, form, lambda b: b.prepare_step([], [generation]))
    _same_tensors(buffers, twin)  # the last step stays current
    for b in (buffers, twin):  # the next good step equals the twin's, which never failed
        b.prepare_step([], [generation])
    _same_tensors(buffers, twin)
    for b in (buffers, twin):
        step = b.advance([6])
    _same_tensors(buffers, twin)
    assert step.inputs["marks"].tolist() == [8]


def test_a_project_device_advance_form_that_raises_is_named_and_its_step_abandoned(failing):
    fam, rules = failing
    config = fam.Config(max_batch_size=2, max_num_tokens=16)
    pair = [fam.RuntimeBuffers(config, device_tokens=True) for _ in range(2)]
    buffers, twin = pair
    tokens = torch.full((2,), 9, dtype=torch.int64)
    for b in pair:
        for slot in (0, 1):
            b.add(Request(seq_slot=slot, prompt=[5, 6, 7]))
        b.step()
        b.step(tokens)  # the first generation step (a full one); steady ones on the device next
    _raises(buffers, rules, "device_advance", lambda b: b.step(tokens))
    _same_tensors(buffers, twin)
    for _ in range(2):
        for b in pair:
            step = b.step(tokens)
        _same_tensors(buffers, twin)
    assert step.inputs["marks"].tolist() == [9, 10]  # 7, 8 advanced twice


def test_a_built_in_rule_that_raises_is_still_a_bug_to_report(failing, monkeypatch):
    """Only the spec's own implementations are named: bufc's own, in the same step, ask for a
    report."""
    from bufc.rules import core

    fam, _ = failing
    buffers = fam.RuntimeBuffers(fam.Config(max_batch_size=4, max_num_tokens=16))

    def broken(out, b):
        raise ValueError("token_ids is broken")

    monkeypatch.setattr(core, "token_ids", broken)
    with pytest.raises(BatchError) as info:
        buffers.prepare_step([Request(seq_slot=0, prompt=[1, 2])], [])
    assert str(info.value).startswith(
        "a fill failed after the checks passed (ValueError: token_ids is broken)"
    )
    assert str(info.value).endswith("Please report this batch.")
