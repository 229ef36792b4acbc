"""How the batch fuzz judges a call: buffers, a step's views and a generation bucket's views
against a fresh RuntimeBuffers that ran only the last successful step."""

from __future__ import annotations

import math

import torch
from fuzz_configs import HISTORY

from bufc.runtime import REPEAT_LAST
from bufc.runtime.decl import DEVICE, Constant, Rule


# ------------------------------------------------------------------------------ comparing
def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)}/{got.dtype} vs {tuple(want.shape)}/{want.dtype}"
    diff = (got != want).flatten().nonzero()
    i = int(diff[0]) if len(diff) else -1
    return f"first at flat {i}: {got.flatten()[i].item()} vs {want.flatten()[i].item()}"


def diff_tensors(buffers, ref, ref_sizes) -> list[str]:
    """Every tensor of `buffers` at capacity against `ref`, a fresh RuntimeBuffers that ran only
    the last successful step (of sizes `ref_sizes`; None: it ran nothing). Engine, external and
    static tensors are skipped; device rules that leave the rows of absent requests as they are
    (encoder_output, prompt tables, M-RoPE tables) are compared over the used prefix."""
    out = []
    got, want = buffers.tensors, ref.tensors
    for name, d in buffers.decls.items():
        if any(d.fill is h for h in HISTORY):
            continue
        g, w = got[name], want[name]
        if d.memory == DEVICE and isinstance(d.fill, Rule) and ref_sizes is not None:
            n = math.prod(d.shape(buffers.config, ref_sizes))
            g, w = g.flatten()[:n], w.flatten()[:n]
        if not torch.equal(g, w):
            out.append(f"tensor {name}: {_first_difference(g, w)}")
    return out


def diff_tensors_exact(buffers, before: dict[str, torch.Tensor]) -> list[str]:
    """Every tensor against a snapshot taken before the call (a rejected call writes nothing)."""
    return [
        f"tensor {name} changed: {_first_difference(t, before[name])}"
        for name, t in buffers.tensors.items()
        if not torch.equal(t, before[name])
    ]


def diff_views(got: dict, want: dict, what: str) -> list[str]:
    out = []
    if sorted(got) != sorted(want):
        return [f"{what} names {sorted(got)} vs {sorted(want)}"]
    for key, w in want.items():
        g = got[key]
        if g.shape != w.shape or not torch.equal(g, w):
            out.append(f"{what}[{key}]: {_first_difference(g, w)}")
    return out


def diff_step(step, ref_step) -> list[str]:
    out = diff_views(step.inputs, ref_step.inputs, "step.inputs")
    out += diff_views(step.outputs, ref_step.outputs, "step.outputs")
    if step.sizes != ref_step.sizes:
        out.append(f"step.sizes {step.sizes} vs {ref_step.sizes}")
    if step.scalars != ref_step.scalars:
        out.append(f"scalars {dict(step.scalars)} vs {dict(ref_step.scalars)}")
    return out


def bucket_pad_problems(buffers, ref_step, bucket) -> list[str]:
    """The views of `bucket` (a generation batch bucket of the step `ref_step`) against the
    step's views: along the one dimension that grows with the bucket, the step's rows hold the
    step's values and the rows past the batch their pad values."""
    inputs, _ = buffers.views(bucket)
    tensor_of = {
        engine_name: d.name
        for d in buffers.decls.values()
        for b in d.inputs
        for engine_name, _ in b.expand(buffers.config)
    }
    out = []
    for engine_name, view in inputs.items():
        d = buffers.decls[tensor_of.get(engine_name, engine_name)]
        if isinstance(d.fill, Constant) or any(d.fill is h for h in HISTORY):
            continue
        step_view = ref_step.inputs[engine_name]
        grown = [k for k, (a, b) in enumerate(zip(view.shape, step_view.shape)) if a != b]
        if view.dim() != step_view.dim() or len(grown) > 1:
            out.append(
                f"bucket view {engine_name}: shape {tuple(view.shape)} vs the step's "
                f"{tuple(step_view.shape)}"
            )
            continue
        if not grown:
            if not torch.equal(view, step_view):
                out.append(f"bucket view {engine_name}: {_first_difference(view, step_view)}")
            continue
        k, n = grown[0], step_view.shape[grown[0]]
        used, rest = view.narrow(k, 0, n), view.narrow(k, n, view.shape[k] - n)
        if not torch.equal(used, step_view):
            out.append(
                f"bucket view {engine_name}{tuple(view.shape)}: its first {n} rows differ from "
                f"the step's ({_first_difference(used, step_view)})"
            )
            continue
        pad = d.pad
        if pad == REPEAT_LAST:  # a cumulative tensor: its last value, 0 after an empty step
            pad = step_view.flatten()[-1].item() if step_view.numel() else 0
        if pad is not None and rest.numel() and not bool((rest == pad).all()):
            bad = rest.flatten()[(rest != pad).flatten().nonzero()[0]].item()
            out.append(
                f"bucket view {engine_name}: a row past the batch holds {bad}, not its pad {pad}"
            )
    return out


def _non_decreasing_from_0(v: torch.Tensor, top: int | None) -> str | None:
    if v.numel() and (v[0] != 0 or bool((v[1:] < v[:-1]).any())):
        return f"not non-decreasing from 0: {v.tolist()}"
    if top is not None and v.numel() and int(v[-1]) > top:
        return f"ends at {int(v[-1])}, past the bucket's {top} tokens"
    return None


def bucket_index_problems(buffers, bucket, step_tokens: int) -> list[str]:
    """Every index tensor of a bucket's views in its valid range, padded rows included: the
    cumulative starts non-decreasing from 0 (never a negative length) and within the bucket's
    tokens, TensorRT-LLM's 1-based last_token_ids in 1 .. tokens, logits_indices in
    0 .. tokens - 1, KV slots a slot for the step's `step_tokens` tokens and -1 (skipped) for
    the padded ones, lengths and block ids in range."""
    inputs, _ = buffers.views(bucket)
    c, tokens = buffers.config, bucket.num_tokens
    got = {name: view.cpu().long().flatten() for name, view in inputs.items()}
    names = {
        name: d.name for d in buffers.decls.values() for b in d.inputs for name, _ in b.expand(c)
    }
    out = []

    def bad(name: str, why: str | None) -> None:
        if why:
            out.append(f"bucket view {name}: {why}")

    for name in ("query_start_loc", "query_start_loc_cpu", "qo_indptr", "qo_indptr_cpu"):
        if name in got:
            bad(name, _non_decreasing_from_0(got[name], tokens))
    for name in ("paged_kv_indptr", "paged_kv_indptr_cpu"):
        if name in got:
            bad(name, _non_decreasing_from_0(got[name], None))
    ranges = {
        "last_token_ids": (1, tokens + 1),  # 1-based
        "logits_indices": (0, tokens),
        "seq_lens": (0, 2**31),
        "seq_lens_cpu": (0, 2**31),
        "paged_kv_last_page_len": (0, getattr(c, "tokens_per_block", 0) + 1),
    }
    pool = getattr(c, "num_kv_blocks", 0) or 2**31
    ranges.update(block_table=(0, pool), paged_kv_indices=(0, pool))
    if names.get("slot_mapping") == "kv_slot_mapping":  # the KV slot of each token, or -1
        ranges["slot_mapping"] = (-1, pool * getattr(c, "tokens_per_block", 1))
    slots = got.get("slot_mapping")
    if "slot_mapping" in ranges and slots is not None and bool((slots[step_tokens:] >= 0).any()):
        bad("slot_mapping", "a padded token writes to a live slot (its pad must be negative)")
    for name, (low, high) in ranges.items():
        v = got.get(name)
        if v is not None and v.numel() and not bool(((v >= low) & (v < high)).all()):
            outside = v[(v < low) | (v >= high)][0].item()
            bad(name, f"holds {outside}, outside {low} .. {high - 1}")
    return out
