"""Pipeline and tensor parallelism for real: processes on loopback with torch.distributed
(gloo), each rank with its own generated buffers for its role, hidden states passed rank to rank
through hidden_states_output / hidden_states_input, logits sharded over the padded vocabulary
and gathered. Greedy tokens must equal transformers.generate."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

from bufc.examples.compare import assert_same_tokens, reference_tokens, tiny_llama, workload  # noqa: E402
from bufc.examples.distributed import run_world  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs the gloo backend")

MODEL = {"seed": 3, "vocab_size": 509}  # 509 pads to 510 or 512: logits carry padding columns
JOBS = {"n": 10, "seed": 4, "max_prompt": 70}
EXECUTOR = {
    "max_batch_size": 4,
    "token_budget": 40,
    "chunk_size": 24,
    "tokens_per_block": 8,
    "max_sequence_length": 128,
}


@pytest.fixture(scope="module")
def reference():
    model = tiny_llama(**MODEL)
    return reference_tokens(model, workload(vocab_size=MODEL["vocab_size"], **JOBS))


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 1), (2, 2)], ids=["pp2", "tp2", "tp2xpp2"])
def test_parallel_ranks_equal_transformers_generate(reference, tp, pp):
    run = run_world(tp, pp, model_args=MODEL, jobs_args=JOBS, executor_args=EXECUTOR)
    assert_same_tokens(run.result, reference)
    steps = run.result.steps
    assert any(s.context_requests and s.generation_requests for s in steps), "no mixed step"
