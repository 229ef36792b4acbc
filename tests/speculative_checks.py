"""What the real-model tests of draft-tree verification check alike (tests/test_eagle_model.py,
tests/test_lookahead_model.py): a run against transformers, a fault that must break that
comparison, what a run covers, and one step's tree inputs for three small trees. Import it
after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import pytest

from bufc.examples.compare import Mismatch, assert_same_tokens
from bufc.examples.eagle import DraftTree
from bufc.examples.speculative import LogitsMismatch, assert_logits_match, unpack_mask

TOL = 1e-9

# three generation requests' trees, with 2, 5 and 0 drafts: 3, 6 and 1 nodes
TREES = (
    DraftTree((7, 8), (0, 0)),
    DraftTree((4, 5, 6, 7, 8), (0, 0, 1, 2, 3)),
    DraftTree(),
)


def compare(result, reference, hf) -> float:
    """Logits first, in step order (a wrong token follows a wrong logit row), then tokens."""
    worst = assert_logits_match(result, hf, TOL)
    assert_same_tokens(result, reference)
    return worst


def assert_comparison_fails(result, reference, hf, name: str) -> None:
    """A run with the fault `name` differs from transformers in its logits and its tokens."""
    with pytest.raises(LogitsMismatch) as exc:
        assert_logits_match(result, hf, TOL)
    with pytest.raises(Mismatch):  # the tokens alone tell too
        assert_same_tokens(result, reference)
    print(f"\n{name}: {exc.value}")


def assert_chunked_and_reused(jobs, ex, result) -> None:
    """The run prefilled a prompt in chunks and handed slots on to later requests."""
    prompts = {j.rid: len(j.prompt) for j in jobs}
    assert any(r.first + 1 < prompts[r.rid] for r in result.records), "no chunked prefill"
    assert len(jobs) > ex.config.max_batch_size  # slots were reused


def assert_tree_inputs(inp) -> None:
    """``TREES`` written into a step's views: the generation lengths, the offsets bound at
    [3, 6] (each node's depth), the mask rows dense (0..2, 3..8, 9: bit j of row i, node j an
    ancestor-or-self of node i), nothing after."""
    assert inp["spec_decoding_generation_lengths"].tolist() == [3, 6, 1]
    assert inp["spec_decoding_position_offsets"].tolist() == [
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 2, 2, 3],
        [0, 0, 0, 0, 0, 0],
    ]
    rows = unpack_mask(inp["spec_decoding_packed_mask"], 6).int().tolist()
    assert rows[0:3] == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0]]
    assert rows[3:9] == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    assert rows[9] == [1, 0, 0, 0, 0, 0] and not any(map(any, rows[10:]))
