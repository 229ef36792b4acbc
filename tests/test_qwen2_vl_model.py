"""A real Qwen2-VL (tiny, random, float64) driven by the generated qwen2_vl buffers: image
features as prompt tables, M-RoPE cos/sin tables and position deltas, chunked prefill that ends
inside images, mixed steps and a paged KV cache. Every request's tokens equal Hugging Face greedy
generation and every logit row of every step equals the Hugging Face forward within 1e-9; and the
comparison can fail: a delta row moved to the neighbouring request, the generation deltas written
after the context rows, a task id swapped or two requests' cos/sin rows swapped breaks it at that
step."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from bufc.examples import qwen2_vl as Q  # noqa: E402

TOL = 1e-9


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return Q.tiny_qwen2_vl(seed=0)


@pytest.fixture(scope="module")
def jobs(model):
    return Q.vl_workload(model, 12, seed=1)


@pytest.fixture(scope="module")
def reference(model, jobs):
    return Q.reference(model, jobs)


CONFIGS = {
    "tpb4-chunk7-budget24": dict(tokens_per_block=4, chunk_size=7, token_budget=24),
    "tpb1-chunk5-budget16-3-slots": dict(
        tokens_per_block=1, chunk_size=5, token_budget=16, max_batch_size=3
    ),
    "tpb16-chunk11-budget40-6-slots": dict(
        tokens_per_block=16, chunk_size=11, token_budget=40, max_batch_size=6
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_in_flight_batching_equals_hugging_face(model, jobs, reference, name):
    result = Q.VLExecutor(model, **CONFIGS[name]).run(jobs)
    worst = Q.assert_matches_hf(result, jobs, *reference, tol=TOL)
    assert worst <= TOL
    steps = result.steps
    assert any(s.context and s.generation for s in steps), "no mixed step"
    assert sum(s.chunks_ending_in_image for s in steps) >= 2, "no chunk ends inside an image"
    assert any(len(set(s.deltas)) > 1 for s in steps), "no step with different deltas"
    assert any(sum(n > 0 for n in s.image_tokens) > 1 for s in steps), "one prompt table a step"
    assert len({g for j in jobs for g in j.grids}) >= 5, "too few image sizes"


def test_the_workload_exercises_m_rope(model, jobs):
    """The deltas are not all zero, and the M-RoPE positions are not the 1-D ones."""
    deltas = {Q.rope_index(model, j)[1] for j in jobs}
    assert len(deltas) >= 3 and 0 in deltas
    positions, _ = Q.rope_index(model, jobs[0])
    assert not torch.equal(positions[1], torch.arange(positions.shape[1]))


def test_mrope_table_is_tensorrt_llm_layout(model, jobs):
    """The M-RoPE table equals TensorRT-LLM's construction, written out as its Qwen2-VL runner
    does it: cos/sin of the padded 3-D positions, split by section, section i % 3 taken,
    (cos, sin) interleaved per frequency, flattened."""
    max_positions = model.config.text_config.max_position_embeddings
    base = Q.rotary_cos_sin(model, max_positions)  # [max_positions, half, 2]
    cos_ori, sin_ori = base[:, :, 0], base[:, :, 1]
    section = model.config.text_config.rope_parameters["mrope_section"]
    for job in jobs[:3]:
        positions, _ = Q.rope_index(model, job)
        ids = positions[:, None, None, :]  # [3, batch, 1, L] -> transpose(1, 0): [batch, 3, L]
        ids = ids[:, :, 0].transpose(1, 0)
        padding = torch.zeros(ids.shape[:-1] + (max_positions,), dtype=torch.long)
        padding[:, :, : ids.shape[-1]] = ids
        cos, sin = cos_ori[padding], sin_ori[padding]  # [batch, 3, max_positions, half]
        cos = torch.cat([m[:, i % 3] for i, m in enumerate(cos.split(section, -1))], -1)
        sin = torch.cat([m[:, i % 3] for i, m in enumerate(sin.split(section, -1))], -1)
        trt = torch.cat((cos[..., None], sin[..., None]), -1).reshape(1, -1)
        ours = Q.mrope_rotary_cos_sin(base, positions, Q.mrope_sections(model))
        assert ours.dtype == torch.float32 and torch.equal(ours, trt[0])


# ------------------------------------------------------------------------------ mutations
STANDARD = CONFIGS["tpb4-chunk7-budget24"]


def _swap_rows(t: torch.Tensor, a: int, b: int) -> None:
    t[[a, b]] = t[[b, a]].clone()


def _delta_moved(steps):
    """The first mixed step with neighbouring generation requests of different deltas: their
    rows (generation request j in row j) swapped, each moved to the other request."""
    for s in steps:
        for j in range(len(s.generation) - 1):
            if s.context and s.deltas[j] != s.deltas[j + 1]:
                return s.step, lambda st, j=j: _swap_rows(
                    st.inputs["mrope_position_deltas"], j, j + 1
                )
    raise AssertionError("no mixed step with neighbouring generation rows of different deltas")


def _token_ranges(s):
    start, out = 0, []
    for _, _, n in s.context:
        out.append((start, start + n))
        start += n
    return out


def _task_swapped(steps):
    """The first step with two neighbouring context rows reading their prompt tables: the
    tasks of their tokens swapped."""
    for s in steps:
        for r in range(len(s.context) - 1):
            if s.image_tokens[r] and s.image_tokens[r + 1]:
                (a, b), (c, d) = _token_ranges(s)[r : r + 2]

                def mutation(st, a=a, b=b, c=c, d=d, r=r):
                    tasks = st.inputs["tasks"]
                    assert set(tasks[a:b].tolist()) == {r} and set(tasks[c:d].tolist()) == {r + 1}
                    tasks[a:b], tasks[c:d] = r + 1, r

                return s.step, mutation
    raise AssertionError("no step with two neighbouring context rows reading prompt tables")


def _cos_sin_swapped(steps):
    """The first step with two context rows, one reading image tokens: their
    mrope_rotary_cos_sin rows swapped."""
    for s in steps:
        for r in range(len(s.context) - 1):
            if s.image_tokens[r] or s.image_tokens[r + 1]:
                return s.step, lambda st, r=r: _swap_rows(
                    st.inputs["mrope_rotary_cos_sin"], r, r + 1
                )
    raise AssertionError("no step with two context rows and an image")


def _deltas_after_context(steps):
    """The first mixed step with a generation request of non-zero delta: the generation rows
    written after the context rows (this rule's former layout; TensorRT-LLM's plugin, as this
    engine, reads generation request j at row j)."""
    for s in steps:
        if s.context and any(s.deltas):
            n_ctx, n_gen = len(s.context), len(s.generation)

            def mutation(st, n_ctx=n_ctx, n_gen=n_gen):
                deltas = st.inputs["mrope_position_deltas"]
                rows = deltas[:n_gen].clone()
                deltas[:n_ctx] = 0
                deltas[n_ctx : n_ctx + n_gen] = rows

            return s.step, mutation
    raise AssertionError("no mixed step with a non-zero delta")


MUTATIONS = {
    "mrope delta row moved to the neighbouring request": _delta_moved,
    "generation deltas after the context rows": _deltas_after_context,
    "task ids of two requests swapped": _task_swapped,
    "mrope cos/sin rows of two requests swapped": _cos_sin_swapped,
}


@pytest.fixture(scope="module")
def clean_steps(model, jobs):
    return Q.VLExecutor(model, **STANDARD).run(jobs).steps


@pytest.mark.parametrize("name", MUTATIONS)
def test_one_wrong_row_makes_the_comparison_fail(model, jobs, reference, clean_steps, name):
    target, mutation = MUTATIONS[name](clean_steps)

    def mutate(index, step):
        if index == target:
            mutation(step)

    result = Q.VLExecutor(model, **STANDARD).run(jobs, mutate=mutate)
    with pytest.raises(Q.Mismatch, match=rf"step {target} \(") as exc:
        Q.assert_matches_hf(result, jobs, *reference, tol=TOL)
    assert "max |logit - HF|" in str(exc.value)


def test_a_token_mismatch_names_the_request_and_the_step(model, jobs, reference):
    result = Q.VLExecutor(model, **STANDARD).run(jobs)
    rid = next(r for r, toks in result.tokens.items() if len(toks) >= 2)
    result.tokens[rid][1] += 1
    with pytest.raises(Q.Mismatch, match=rf"request {rid} diverges at generated token 1"):
        Q.assert_matches_hf(result, jobs, *reference, tol=TOL)
