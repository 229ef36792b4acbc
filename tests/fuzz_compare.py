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
