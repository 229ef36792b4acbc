"""The README's two usage examples print exactly these values (tests/test_docs.py runs every
block of the page against its comments; this pins the values themselves)."""

from __future__ import annotations

import contextlib
import io
import re

from conftest import REPO


def test_readme_usage_example_runs_and_its_comments_are_true():
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Usage\n.*?```python\n(.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})  # noqa: S102 - our own README
    printed = out.getvalue().splitlines()
    assert printed == [
        "514",
        "[511, 4, 4]",
        "[512, 513, 514]",
        "torch.Size([3, 32000])",
        "[87] 768",
    ]
    comments = [line.split("#", 1)[1] for line in block.splitlines() if line.startswith("print(")]
    for got, comment in zip(printed, comments, strict=True):
        assert comment.strip().startswith(got), (got, comment)


def test_readme_in_flight_example_runs_and_its_comment_is_true():
    text = (REPO / "README.md").read_text()
    block = re.search(r"### Requests in flight.*?```python\n(.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})  # noqa: S102 - our own README
    printed = out.getvalue().splitlines()
    assert printed == ["[11, 12] [5, 2]", "decode [3, 1]"]
    lines = [line for line in block.splitlines() if line.startswith("print(")]
    assert [line.split("#", 1)[1].strip() for line in lines] == printed
