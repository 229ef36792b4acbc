"""A real Llama driven by the generated llama buffers equals transformers.generate, token for
token, under in-flight batching with chunked prefill and a paged KV cache; and the comparison
can fail: one wrong position id, context length or last-token index breaks it."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bufc.examples.compare import (  # noqa: E402
    Mismatch,
    assert_same_tokens,
    reference_tokens,
    tiny_llama,
    workload,
)
from bufc.examples.executor import Executor  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def jobs():
    return workload(32, seed=1)


@pytest.fixture(scope="module")
def reference(model, jobs):
    return reference_tokens(model, jobs)


CONFIGS = {
    # chunks that end mid-block, a budget far below the longest prompt (400), one-token blocks
    "tpb1-chunk7-budget64": dict(tokens_per_block=1, chunk_size=7, token_budget=64),
    "tpb16-chunk24-budget100": dict(tokens_per_block=16, chunk_size=24, token_budget=100),
    "tpb64-chunk100-budget150": dict(tokens_per_block=64, chunk_size=100, token_budget=150),
    "tpb16-budget256-few-slots": dict(tokens_per_block=16, token_budget=256, max_batch_size=5),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_in_flight_batching_equals_transformers_generate(model, jobs, reference, name):
    kwargs = {"max_batch_size": 12, "max_sequence_length": 512, **CONFIGS[name]}
    result = Executor(model, **kwargs).run(jobs)
    assert_same_tokens(result, reference)
    steps = result.steps
    assert any(s.context_requests and s.generation_requests for s in steps), "no mixed step"
    assert max(s.tokens for s in steps) <= kwargs["token_budget"]


@pytest.mark.parametrize("mode", ["in_flight", "overlap"])
@pytest.mark.parametrize("name", ["tpb1-chunk7-budget64", "tpb16-budget256-few-slots"])
def test_requests_in_flight_equal_transformers_generate(model, jobs, reference, name, mode):
    """The executor on add/finish/step; with overlap the sampled tokens stay a tensor on the
    device (device_tokens, here the CPU) and are read one step late."""
    kwargs = {"max_batch_size": 12, "max_sequence_length": 512, **CONFIGS[name], mode: True}
    ex = Executor(model, **kwargs)
    assert_same_tokens(ex.run(jobs), reference)
    assert ex.allocator.free == ex.allocator.num_blocks


DECODE_MUTATIONS = {
    "input id + 1": ("input_ids", lambda t: t[-1].add_(1)),
    # the fixed-shape decode reads the lengths on the device: 3 tokens short
    "sequence lengths - 3": ("sequence_length", lambda t: t.sub_(3)),
}


@pytest.mark.parametrize("name", DECODE_MUTATIONS)
def test_overlap_can_fail(model, jobs, reference, name):
    """One wrong input of the first decode step, after the device gather and the device-side
    update, breaks the run."""
    ex = standard_executor(model, overlap=True)
    tensor, mutation = DECODE_MUTATIONS[name]
    decode_steps = []

    def mutate(i, step):
        if not step.sizes.num_context_requests and not decode_steps:
            decode_steps.append(i)
            mutation(step.inputs[tensor])

    with pytest.raises(Mismatch):
        assert_same_tokens(ex.run(jobs, mutate=mutate), reference)


def test_blocks_and_slots_are_returned(model, jobs):
    ex = Executor(
        model, max_batch_size=8, token_budget=128, tokens_per_block=16, max_sequence_length=512
    )
    ex.run(jobs)
    assert ex.allocator.free == ex.allocator.num_blocks


STANDARD = dict(
    max_batch_size=12, token_budget=100, chunk_size=24, tokens_per_block=16, max_sequence_length=512
)


def standard_executor(model, **overrides) -> Executor:
    return Executor(model, **{**STANDARD, **overrides})


def _first_step_where(result_steps, predicate):
    return next(s.step for s in result_steps if predicate(s))


def _mutated_run(model, jobs, mutation):
    ex = standard_executor(model)
    clean = standard_executor(model).run(jobs)
    target = _first_step_where(clean.steps, lambda s: s.context_requests and s.generation_requests)

    def mutate(index, step):
        if index == target:
            mutation(step)

    return ex.run(jobs, mutate=mutate)


MUTATIONS = {
    "position id + 1": lambda step: step.inputs["position_ids"][-1].add_(1),
    "context length - 1": lambda step: step.inputs["host_context_lengths"][0].sub_(1),
    "last-token index - 1": lambda step: step.inputs["last_token_ids"][-1].sub_(1),
    # the packed forward takes each sequence's KV length from the host input (no device read)
    "past KV length + 1": lambda step: step.inputs["host_past_key_value_lengths"][-1].add_(1),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_one_wrong_index_makes_the_comparison_fail(model, jobs, reference, name):
    with pytest.raises((Mismatch, ValueError)) as exc:
        assert_same_tokens(_mutated_run(model, jobs, MUTATIONS[name]), reference)
    if exc.type is Mismatch:
        assert "diverges at generated token" in str(exc.value) and "(step " in str(exc.value)


def test_a_mismatch_names_the_request_and_the_step(model, jobs, reference):
    result = Executor(
        model, max_batch_size=12, token_budget=100, tokens_per_block=16, max_sequence_length=512
    ).run(jobs)
    rid = next(r for r, toks in result.tokens.items() if len(toks) >= 2)
    result.tokens[rid][1] += 1
    with pytest.raises(
        Mismatch, match=rf"request {rid} diverges at generated token 1 \(step \d+\)"
    ):
        assert_same_tokens(result, reference)


@pytest.mark.parametrize("extra", [[], ["--overlap", "--threads", "2"]])
def test_demo_runs_and_reports_the_match(capsys, extra):
    import torch

    from bufc.codegen.cli import main

    threads = torch.get_num_threads()
    assert (
        main(
            [
                "demo",
                *extra,
                "--requests",
                "8",
                "--max-prompt",
                "60",
                "--token-budget",
                "32",
                "--chunk-size",
                "10",
                "--every",
                "5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "prepare_step" in out and "tokens/s (bufc executor)" in out
    assert out.rstrip().endswith("all 8 requests match transformers.generate")
    # the setting is printed (1 by default) and torch's own is restored afterwards
    setting = extra[extra.index("--threads") + 1] if "--threads" in extra else "1"
    assert f"torch intra-op threads             {setting} per process (--threads)" in out
    assert torch.get_num_threads() == threads


@pytest.mark.gpu
def test_in_flight_batching_on_cuda_equals_transformers_generate(model, jobs, reference):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import copy

    cuda_model = copy.deepcopy(model).to("cuda")
    result = standard_executor(cuda_model, device="cuda").run(jobs)
    assert_same_tokens(result, reference)


def test_bucketed_fixed_shape_decode_reads_only_pads_past_the_batch(model, jobs, reference):
    """Generation-only steps run over a power-of-two bucket of rows: the rows past the batch
    are the buffers' pad values (token 0, offsets to the reserved block 0, length 0), so the
    tokens still equal transformers.generate."""
    ex = standard_executor(model, bucketed_decode=True)
    result = ex.run(jobs)
    assert_same_tokens(result, reference)
    assert any(not s.context_requests for s in result.steps)


@pytest.mark.gpu
def test_cuda_graph_per_bucket_replays_new_batches_with_identical_tokens(model):
    import copy

    import torch

    from bufc.examples.executor import Job

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # all prompts in the first step, then decode-only steps whose batch shrinks as requests
    # finish: buckets 12, 8, 4, 2 and 1 are each captured once and replayed
    jobs = [
        Job(rid=i, prompt=tuple(range(3 + 3 * i, 8 + 7 * i)), max_new_tokens=2 + i)
        for i in range(12)
    ]
    reference = reference_tokens(model, jobs)
    cuda_model = copy.deepcopy(model).to("cuda")
    ex = Executor(
        cuda_model,
        max_batch_size=12,
        token_budget=512,
        tokens_per_block=16,
        max_sequence_length=128,
        device="cuda",
        cuda_graphs=True,
    )
    result = ex.run(jobs)
    assert_same_tokens(result, reference)
    assert sorted(ex.graphs) == [1, 2, 4, 8, 12]
    assert sum(1 for s in result.steps if not s.context_requests) > len(ex.graphs)


def test_steady_decoding_uses_advance_and_stays_exact(model):
    from bufc.examples.executor import Job

    jobs = [Job(rid=i, prompt=tuple(range(5 + i, 30 + 9 * i)), max_new_tokens=12) for i in range(4)]
    ex = Executor(
        model, max_batch_size=4, token_budget=512, tokens_per_block=4, max_sequence_length=128
    )
    calls = []
    advance = ex.buffers.advance
    ex.buffers.advance = lambda tokens: calls.append(len(tokens)) or advance(tokens)
    result = ex.run(jobs)
    assert calls == [4] * 10  # steps 3..12: the same four requests, one token longer each
    assert_same_tokens(result, reference_tokens(model, jobs))
