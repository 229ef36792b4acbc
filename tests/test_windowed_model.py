"""A real Qwen2 whose layers alternate a sliding window and full attention, served in flight on
the llama family's KV pools (one pool per window, each layer addressed through
host_kv_cache_pool_mapping and its pool's offsets, masked by host_max_attention_window_sizes):
its tokens equal transformers.generate, its logits a teacher-forced forward within 1e-9, with
chunks that cross the window and slots reused; and each broken piece of the pool layout fails
the run."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from bufc.examples.compare import Mismatch, reference_tokens, workload  # noqa: E402
from bufc.examples.windowed import layer_windows, serve, tiny_qwen2  # noqa: E402
from bufc.rules.pools import kv_pools  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 12
MAX_SEQ = 128


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2(seed=0, window=WINDOW)


@pytest.fixture(scope="module")
def jobs():
    return workload(12, seed=3, vocab_size=256, max_prompt=40)


@pytest.fixture(scope="module")
def reference(model, jobs):
    return reference_tokens(model, jobs)


def check(model, jobs, served, reference) -> None:
    """Mismatch unless every request's tokens equal generate's and the logits each was
    sampled from equal a teacher-forced forward's within 1e-9."""
    for job in jobs:
        got, want = served.tokens[job.rid], reference[job.rid]
        if got != want:
            raise Mismatch(f"request {job.rid}: tokens {got}, transformers.generate {want}")
        ids = torch.tensor([list(job.prompt) + got[:-1]])
        with torch.no_grad():
            full = model(ids).logits[0]
        for k, row in enumerate(served.logits[job.rid]):
            err = (row - full[len(job.prompt) - 1 + k]).abs().max().item()
            if err > 1e-9:
                raise Mismatch(f"request {job.rid}, token {k}: logits off by {err:.3g}")


def test_sliding_and_full_layers_on_their_pools_equal_transformers(model, jobs, reference):
    served = serve(model, jobs, max_sequence_length=MAX_SEQ)
    check(model, jobs, served, reference)
    assert served.crossed, "no chunk crossed a sliding window's span"
    assert served.reused_slots, "no slot was reused"


def _pool_layers(model) -> tuple[int, ...]:
    windows = layer_windows(model, MAX_SEQ)
    return kv_pools(windows, (), MAX_SEQ, 0, len(windows)).layers


def _swap_mapping_rows(inputs, fixed):
    fixed["mapping"][[0, 1]] = fixed["mapping"][[1, 0]].clone()


def _layer_index_in_pool(inputs, fixed):
    fixed["mapping"][2, 1] = 0  # layer 2 shares layer 0's slabs in their pool


def _read_outside_the_window(inputs, fixed):
    fixed["windows"].fill_(MAX_SEQ)  # sliding layers read every block, freed ones included


MUTATIONS = {
    "swapped pool-mapping rows": _swap_mapping_rows,
    "wrong layer index in the pool": _layer_index_in_pool,
    "blocks read outside the window": _read_outside_the_window,
}


@pytest.mark.parametrize("name", [*MUTATIONS, "offsets encoded with the model's layers"])
def test_a_broken_pool_layout_fails_the_run(model, jobs, reference, name):
    if name in MUTATIONS:
        mutate = MUTATIONS[name]
    else:
        layers, total = _pool_layers(model), model.config.num_hidden_layers

        def mutate(inputs, fixed):  # block b of pool p as b * model layers * 2, not b * L_p * 2
            off = inputs["kv_cache_block_offsets"]
            for p, n in enumerate(layers):
                k = off[p, :, 0] // n * total
                off[p, :, 1] = torch.where(off[p, :, 1] != 0, k + 1, 0)
                off[p, :, 0] = k

    with pytest.raises((Mismatch, IndexError)):
        check(
            model, jobs, serve(model, jobs, max_sequence_length=MAX_SEQ, mutate=mutate), reference
        )


def test_the_flash_contract_s_kv_cache_groups_give_the_same_model(model, jobs, reference):
    """The same model through llama_flash: one block table and slot mapping per KV-cache group
    (a group per window), each layer reading its group's."""
    served = serve(model, jobs, max_sequence_length=MAX_SEQ, contract="flash")
    check(model, jobs, served, reference)
    assert served.crossed and served.reused_slots


def test_a_layer_reading_another_group_s_table_fails_the_run(model, jobs, reference):
    def swap(inputs, fixed):
        tables = inputs["group_block_tables"]
        tables[[0, 1]] = tables[[1, 0]].clone()

    served = serve(model, jobs, max_sequence_length=MAX_SEQ, contract="flash", mutate=swap)
    with pytest.raises(Mismatch):
        check(model, jobs, served, reference)


@pytest.mark.parametrize("contract", ["trtllm", "flash"])
def test_every_step_at_one_cuda_graph_bucket_gives_the_same_model(model, jobs, reference, contract):
    """Both contracts with every step built at one bucket (the pools' or groups' rows at the
    bucket's sequences, padded rows and tokens holding their pads): the same tokens."""
    served = serve(model, jobs, max_sequence_length=MAX_SEQ, contract=contract, bucket=True)
    check(model, jobs, served, reference)
    assert served.crossed and served.reused_slots
