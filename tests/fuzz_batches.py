"""An adversarial batch fuzzer for ``RuntimeBuffers.prepare_step`` and ``advance`` (used by
tests/test_batch_fuzz.py).

A simulated client drives one family's buffers with realistic traffic: requests arrive, are
computed in context chunks, become generation requests (beams, draft tokens), decode in runs of
``advance()`` and finish, their paged-KV block lists growing as their sequences enter new blocks.
About half of the calls are mutated first: one value of the batch (or of the advance tokens) is
replaced by an invalid one (an edge of a dtype, a wrong type, an uncovered block list, a
duplicate slot, ...). Every call is then judged against the contract:

* a call either returns a Step or raises ``BatchError`` (any other exception is a crash);
* a rejected call leaves every tensor exactly as it was (and all state: the calls that follow
  are judged too);
* after every call, every tensor at its full capacity (padding included) equals a fresh
  ``RuntimeBuffers`` of the same Config that ran only the last successful step, and so do the
  step's views and sizes, and the views of a generation batch bucket (``buffers.views``);
* an invalid batch is never accepted, a valid one never rejected.

Mutations labelled MAYBE touch values the contract leaves open (a token the step does not read,
numpy arrays where lists are expected, bools): either outcome is fine, but not a crash, and an
accepted step must still equal a fresh one.

The parts: fuzz_configs.py (the families' Configs and buffers), fuzz_client.py (the
traffic), fuzz_mutators.py and fuzz_feature_mutators.py (the mutations), fuzz_compare.py (the
judging); this module runs them (Fuzzer) and counts the outcomes (Counts).
"""

from __future__ import annotations

import copy
import dataclasses
import random

import numpy as np
import pytest
import torch
from fuzz_client import Client
from fuzz_compare import (
    bucket_index_problems,
    bucket_pad_problems,
    diff_step,
    diff_tensors,
    diff_tensors_exact,
    diff_views,
)
from fuzz_configs import ADVANCES, INVALID, MAYBE, VALID, family, make_config
from fuzz_feature_mutators import mutate_advance, mutate_prepare
from fuzz_mutators import Plan

from bufc.runtime import BatchError


# ------------------------------------------------------------------------------ the fuzzer
@dataclasses.dataclass
class Counts:
    family: str
    tried: int = 0
    valid_accepted: int = 0
    invalid_rejected: int = 0
    maybe_accepted: int = 0
    maybe_rejected: int = 0
    advances: int = 0
    advances_after_a_rejection: int = 0
    bucket_checks: int = 0
    invalid_accepted: int = 0
    valid_rejected: int = 0
    crashes: int = 0
    corruptions: int = 0
    examples: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def note(self, kind: str, text: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        shown = self.examples.setdefault(kind, [])
        if len(shown) < 6:
            shown.append(text)

    @property
    def bad(self) -> int:
        return self.invalid_accepted + self.valid_rejected + self.crashes + self.corruptions

    def line(self) -> str:
        return (
            f"{self.family:9} tried {self.tried:4}  valid accepted {self.valid_accepted:4}  "
            f"invalid rejected {self.invalid_rejected:4}  maybe accepted/rejected "
            f"{self.maybe_accepted}/{self.maybe_rejected}  (advance calls {self.advances}, "
            f"{self.advances_after_a_rejection} right after a rejected call, "
            f"bucket checks {self.bucket_checks})  |  INVALID ACCEPTED {self.invalid_accepted}  "
            f"VALID REJECTED {self.valid_rejected}  CRASHES {self.crashes}  "
            f"CORRUPTIONS {self.corruptions}"
        )

    def report(self) -> str:
        lines = [self.line()]
        for kind, shown in self.examples.items():
            lines += [f"  {kind}:"] + [f"    {s}" for s in shown]
        return "\n".join(lines)


def _integral_block_ids(args: tuple) -> tuple:
    """`args` with block ids that are floats of integral value as ints (what a kept row holds)."""
    args = copy.deepcopy(args)
    for r in args[0] + args[1]:
        for field in ("kv_block_ids", "cross_kv_block_ids"):
            ids = getattr(r, field, None)
            if isinstance(ids, list):
                setattr(
                    r,
                    field,
                    [
                        [int(v) if isinstance(v, float) and v == int(v) else v for v in b]
                        if isinstance(b, list)
                        else b
                        for b in ids
                    ],
                )
    return args


class Fuzzer:
    def __init__(self, name: str, seed: int, p_mutate: float = 0.5) -> None:
        self.name = name
        self.rng = random.Random(seed)
        self.config = make_config(name)
        self.p_mutate = p_mutate
        self.counts = Counts(name)
        self.last_rejected = False
        self.client = Client(name, self.config, self.rng)
        self.reset()

    def new(self):
        return family(self.name).RuntimeBuffers(self.config)

    def reset(self) -> None:
        """Fresh buffers after a failure (so one bug is not counted on every later step)."""
        self.buffers = self.new()
        self.ref, self.ref_step = self.new(), None
        self.client.advanceable = False

    def ref_advanceable(self) -> bool:
        """Whether advance() may follow the last successful step."""
        s = self.ref_step and self.ref_step.sizes
        return bool(
            s
            and self.name in ADVANCES
            and s.num_sequences
            and not s.num_context_requests
            and s.num_tokens == s.num_sequences
        )

    def fresh(self, ctx, gen):
        ref = self.new()
        return ref, ref.prepare_step(ctx, gen)

    # ------------------------------------------------------------------ one call
    def run(self, calls: int) -> Counts:
        # one thread: torch parallelises copies of large tensors (the logits), which only costs
        # on a shared 2-core machine; the values do not depend on it
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for i in range(calls):
                self.call(i)
                if self.rng.random() < 0.3:
                    self.check_bucket(i)
        finally:
            torch.set_num_threads(threads)
        return self.counts

    def call(self, i: int) -> None:
        rng, client, counts = self.rng, self.client, self.counts
        saved = client.save()
        advance = client.advanceable and rng.random() < 0.5
        wrong_advance = not self.ref_advanceable() and rng.random() < 0.03
        label, what = VALID, "valid"
        tokens = ctx = gen = None
        if advance or wrong_advance:
            n = self.ref_step.sizes.num_sequences if self.ref_step else 1
            tokens = client.plan_advance() if advance else [1] * max(n, 1)
            if wrong_advance:
                label, what = INVALID, "advance() after a step it cannot follow"
            elif rng.random() < self.p_mutate:
                done = mutate_advance(rng, tokens, client)
                if done is not None:
                    tokens, label, what = done
            if advance and client.advance_past_int32():
                what = ("" if label == VALID else f"{what}; ") + "a position past int32"
                label = INVALID
            args = None
        else:
            ctx, gen = client.plan_prepare()
            if rng.random() < self.p_mutate:
                done = mutate_prepare(Plan(ctx, gen, client, rng), self.name)
                if done is not None:
                    label, what = done
            args = copy.deepcopy((ctx, gen))  # what the fresh buffers replay
        kind = "advance" if advance or wrong_advance else "prepare_step"
        where = f"call {i} ({kind}, {label}: {what})"
        before = {k: v.clone() for k, v in self.buffers.tensors.items()}
        counts.tried += 1
        counts.advances += kind == "advance"
        counts.advances_after_a_rejection += kind == "advance" and self.last_rejected
        self.last_rejected = False
        try:
            step = (
                self.buffers.advance(tokens)
                if kind == "advance"
                else self.buffers.prepare_step(ctx, gen)
            )
        except BatchError as exc:
            client.restore(saved)
            problems = diff_tensors_exact(self.buffers, before)
            problems += diff_tensors(self.buffers, self.ref, self.ref_step and self.ref_step.sizes)
            if problems:
                counts.note(
                    "corruptions", f"{where}: rejected ({exc}) but " + "; ".join(problems[:3])
                )
                self.reset()
            elif label == VALID:
                counts.note("valid_rejected", f"{where}: {exc}")
                if kind == "prepare_step":
                    client.drop(gen + ctx)
                client.advanceable = False
            elif label == MAYBE:
                counts.maybe_rejected += 1
            else:
                counts.invalid_rejected += 1
            self.last_rejected = True
            return
        except Exception as exc:  # noqa: BLE001 - the contract allows BatchError only
            client.restore(saved)
            changed = diff_tensors_exact(self.buffers, before)
            counts.note(
                "crashes",
                f"{where}: {type(exc).__name__}: {exc}"
                + (f" (and {len(changed)} tensors changed)" if changed else ""),
            )
            self.reset()
            return
        if label == INVALID:
            client.restore(saved)
            counts.note("invalid_accepted", f"{where}: accepted")
            self.reset()
            return
        # accepted: equal to a fresh RuntimeBuffers that ran only this step
        if kind == "advance":  # the equivalent requests: the tokens it took appended
            values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
            client.commit_advance([int(v) for v in np.asarray(values).reshape(-1)])
            args = ([], copy.deepcopy(client.last_gen))
        try:
            if label == MAYBE:  # a kept row's list equal by value: the fresh run gets the ints
                args = _integral_block_ids(args)
            ref, ref_step = self.fresh(*args)
        except Exception as exc:  # noqa: BLE001
            counts.note(
                "corruptions",
                f"{where}: accepted here, but a fresh RuntimeBuffers raises "
                f"{type(exc).__name__}: {exc}",
            )
            client.restore(saved)
            self.reset()
            return
        problems = diff_step(step, ref_step) + diff_tensors(self.buffers, ref, ref_step.sizes)
        if problems:
            counts.note("corruptions", f"{where}: " + "; ".join(problems[:4]))
            client.restore(saved)
            self.reset()
            return
        self.ref, self.ref_step = ref, ref_step
        if label == MAYBE:
            counts.maybe_accepted += 1
            if kind == "prepare_step":  # the buffers ran copies: the live requests did not move
                client.restore(saved)
                client.advanceable = False
            return
        counts.valid_accepted += 1
        if kind == "prepare_step":
            client.commit_prepare(ctx, gen)

    def check_bucket(self, i: int) -> None:
        """views() of a generation batch bucket: equal to the fresh buffers' views, with the
        rows past the batch holding their pad values."""
        s = self.ref_step and self.ref_step.sizes
        if not s or s.num_context_requests or s.num_tokens != s.num_sequences:
            return
        # a bucket counts requests of one sequence each, at most max_batch_size
        if s.num_sequences > self.config.max_batch_size:
            return
        rows = self.rng.randint(s.num_sequences, self.config.max_batch_size)
        bucket = s.generation_bucket(rows)
        self.counts.bucket_checks += 1
        if self.name == "gpt_lora" and rows != s.num_sequences:  # [.., sequences]: refused
            with pytest.raises(ValueError, match=r"build the step at its bucket instead"):
                self.buffers.views(bucket)
            return
        try:
            got_in, got_out = self.buffers.views(bucket)
            want_in, want_out = self.ref.views(bucket)
            problems = diff_views(got_in, want_in, "bucket inputs")
            problems += diff_views(got_out, want_out, "bucket outputs")
            problems += bucket_pad_problems(self.buffers, self.ref_step, bucket)
            if s.num_tokens:  # a bucket of an empty step has no real row to point at
                problems += bucket_index_problems(self.buffers, bucket, s.num_tokens)
        except Exception as exc:  # noqa: BLE001
            problems = [f"{type(exc).__name__}: {exc}"]
        if problems:  # (no reset: a layout problem of views() is not a damaged state)
            self.counts.note(
                "corruptions",
                f"after call {i}: views({rows}-row bucket): " + "; ".join(problems[:3]),
            )
