"""Steps built at a CUDA-graph bucket (``step(..., bucket=(tokens, rows))``): every tensor the
step writes is laid out at the bucket's sizes, so that the one view at the bucket that a
captured graph reads holds the step whatever the tensor's layout.

A tensor whose step rows lead its shape (``[rows, ...]``) is already laid out so: the rows past
the step hold its pad. One whose rows do not lead (several KV pools or groups,
``[pools, sequences, 2, width]``; LoRA's ``[modules, layers, sequences]``; ChatGLM's
``[2, tokens]``) is written by its rule at the step's sizes, then moved to the bucket's layout,
the elements around it holding its pad: an O(bucket) copy through a scratch row kept per tensor
(allocated on its first bucketed step, never per step).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import BatchError
from ..requests.values import is_int
from .bindings import Bindings, prefix_layout
from .decl import Mirror, Rule, TensorDecl
from .staging import Targets


def at_bucket(sizes: Any, bucket: Any) -> Any:
    """The step's sizes padded to `bucket`, ``(tokens, rows)`` (StepSizes.padded), or
    BatchError when the step does not fit it."""
    if not isinstance(bucket, tuple) or len(bucket) != 2 or not all(is_int(x) for x in bucket):
        raise BatchError(f"bucket must be (tokens, rows), two non-negative ints; got {bucket!r}")
    tokens, rows = int(bucket[0]), int(bucket[1])
    if tokens < 0 or rows < 0:
        raise BatchError(f"bucket must be (tokens, rows), two non-negative ints; got {bucket!r}")
    if tokens < sizes.num_tokens or rows < sizes.num_sequences:
        raise BatchError(
            f"the step has {sizes.num_tokens} tokens and {sizes.num_sequences} sequences, more "
            f"than its bucket (tokens, rows) = {(tokens, rows)}: pick a larger bucket"
        )
    return sizes.padded(tokens, rows)


class Relayout:
    """The rule tensors of a family moved to a bucket's layout after their fill: those the
    engine reads through the step's views (bound, or mirrored by a bound tensor). An unbound
    one (the beam-search copy lists a decoder reads) keeps the step's own layout."""

    def __init__(self, decls: dict[str, TensorDecl], config: Any, bind: Bindings) -> None:
        # what the step's views bind under this Config (bindings.py decides it), and the host
        # tensors their mirrors copy
        bound = {tensor for _, tensor, _, _ in bind.inputs + bind.outputs}
        bound |= {
            d.fill.source for n, d in decls.items() if isinstance(d.fill, Mirror) and n in bound
        }
        self._all = {n: d for n, d in decls.items() if n in bound}  # what a bucket shapes
        self._decls = {n: d for n, d in self._all.items() if isinstance(d.fill, Rule)}
        self._config = config
        self._scratch: dict[str, np.ndarray] = {}

    def moved(self, sizes: Any, layout: Any) -> list[str]:
        """The rule tensors whose values at `sizes` are no prefix of their layout at `layout`."""
        c = self._config
        return [
            n
            for n, d in self._decls.items()
            if not prefix_layout(tuple(d.shape(c, sizes)), tuple(d.shape(c, layout)))
        ]

    def check(self, targets: Targets, sizes: Any, layout: Any) -> None:
        """BatchError, before anything is written, for a tensor no bucket can lay out here: one
        a rule writes on the device, or one whose pad repeats its last value; and for a bucket
        beyond a tensor's capacity."""
        self.within_capacity(layout)
        for name in self.moved(sizes, layout):
            target = getattr(targets, name)
            if not isinstance(target.out, np.ndarray) or target.repeat or target.pad is None:
                raise BatchError(
                    f"{name} cannot be laid out at a bucket (its rows do not lead its shape, and "
                    "it is written on the device or has no constant pad): run this step unpadded"
                )

    def within_capacity(self, layout: Any) -> None:
        """BatchError for a bucket beyond the capacity of a tensor the engine reads."""
        c = self._config
        for name, d in self._all.items():
            if math.prod(d.shape(c, layout)) > math.prod(d.capacity(c)):
                raise BatchError(
                    f"at the bucket {name} would be {list(d.shape(c, layout))}, beyond its "
                    f"capacity {list(d.capacity(c))}: pick a smaller bucket"
                )

    def apply(
        self, targets: Targets, sizes: Any, layout: Any, names: list[str] | None = None
    ) -> None:
        """Each moved tensor's step values (the first elements of its storage, laid out at
        `sizes`) into its layout at `layout`, every other element of that layout its pad
        (`names`: those of the moved tensors alone)."""
        c = self._config
        for name in self.moved(sizes, layout) if names is None else names:
            d, target = self._decls[name], getattr(targets, name)
            step, bucket = tuple(d.shape(c, sizes)), tuple(d.shape(c, layout))
            n, size = math.prod(step), math.prod(bucket)
            scratch = self._scratch.get(name)
            if scratch is None:
                scratch = self._scratch[name] = np.empty_like(target.out)
            scratch[:n] = target.out[:n]
            out = target.out[:size]
            out[:] = target.pad
            out.reshape(bucket)[tuple(slice(0, k) for k in step)] = scratch[:n].reshape(step)
            target.written[0] = size  # past it, the pad (what the next fill re-pads from)
