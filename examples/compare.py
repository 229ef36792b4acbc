"""The ground truth: each request alone through ``transformers.generate``, greedy."""

from __future__ import annotations

import argparse
import contextlib
import random
from collections.abc import Callable, Iterator

import torch

from .executor import Job, Result

THREADS_HELP = (
    "torch intra-op threads (default 1: the example models are tiny, and on a busy machine "
    "extra threads wait for a core and stall every operation)"
)


def threads_option(p: argparse.ArgumentParser) -> None:
    """`--threads N` (default 1) on an example's command line."""

    def at_least_one(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} is below 1")
        return value

    p.add_argument("--threads", type=at_least_one, default=1, metavar="N", help=THREADS_HELP)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside, the previous count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_llama(seed: int = 0, *, vocab_size: int = 512, init_scale: float = 0.3) -> torch.nn.Module:
    """A small random Llama in float64. A large init scale keeps attention far from uniform, so
    a wrong position, length or gather index changes the tokens (and float64 avoids ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=init_scale,
    )
    return float64_model(LlamaForCausalLM, config, seed)


def float64_model(model_class, config, seed: int) -> torch.nn.Module:
    """``model_class(config)``, its weights drawn after ``torch.manual_seed(seed)``, in float64
    and eval mode; eos disabled (pad id 0), so ``generate`` gives exactly ``max_new_tokens``
    tokens, as the executors do."""
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def random_jobs(
    rng: random.Random,
    lengths: list[int],
    *,
    vocab_size: int,
    new_tokens: tuple[int, int],
    last_arrival: int,
) -> list[Job]:
    """One request per prompt length, in order (request ids 0..): random prompt tokens below
    `vocab_size`, ``new_tokens[0]`` to ``new_tokens[1]`` new tokens, arriving at a step from 0
    to `last_arrival`, all drawn from `rng`."""
    return [
        Job(
            rid=i,
            prompt=tuple(rng.randrange(vocab_size) for _ in range(length)),
            max_new_tokens=rng.randint(*new_tokens),
            arrival_step=rng.randint(0, last_arrival),
        )
        for i, length in enumerate(lengths)
    ]


def workload(
    n: int = 32, *, seed: int = 0, vocab_size: int = 512, max_prompt: int = 400
) -> list[Job]:
    """`n` requests: prompts of 1 to `max_prompt` tokens, arriving over the first steps,
    each stopping after its own number of tokens."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, max_prompt] + [rng.randint(1, max_prompt) for _ in range(n - 4)]
    return random_jobs(
        rng, lengths, vocab_size=vocab_size, new_tokens=(1, 12), last_arrival=3 * n // 4
    )


def reference_tokens(model: torch.nn.Module, jobs: list[Job]) -> dict[int, list[int]]:
    out = {}
    for job in jobs:
        prompt = torch.tensor([job.prompt], device=model.device)
        full = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=job.max_new_tokens,
        )
        out[job.rid] = full[0, len(job.prompt) :].tolist()
    return out


class Mismatch(AssertionError):
    pass


def assert_same_tokens(result: Result, reference: dict[int, list[int]]) -> None:
    """Raise on the earliest diverging token (by step), naming the request and the step."""
    worst = None
    for rid, want in reference.items():
        got = result.tokens[rid]
        for k, (a, b) in enumerate(zip(got, want)):
            if a != b:
                step = result.token_steps[rid][k]
                if worst is None or step < worst[0]:
                    worst = (step, rid, k, a, b)
                break
        else:
            if len(got) != len(want):
                raise Mismatch(
                    f"request {rid}: {len(got)} tokens generated, transformers gave {len(want)}"
                )
    if worst is not None:
        step, rid, k, a, b = worst
        raise Mismatch(
            f"request {rid} diverges at generated token {k} (step {step}): "
            f"bufc executor gave {a}, transformers.generate gave {b}"
        )


def assert_row_logits(
    steps: list,
    want: Callable[[int, int], torch.Tensor],
    tol: float = 1e-9,
    label: Callable[[object], str] = lambda s: s.kind,
) -> float:
    """Every logit row of every step (records with `step`, `rids`, `positions` and `logits`,
    row i request ``rids[i]``'s logits at ``positions[i]``) against ``want(rid, position)``,
    the reference's. Raises Mismatch on the earliest step with a row off by more than `tol`
    (the step named with ``label(step)``); returns the largest difference otherwise."""
    worst = 0.0
    for s in steps:
        for row, (rid, pos) in enumerate(zip(s.rids, s.positions)):
            diff = float((s.logits[row] - want(rid, pos)).abs().max())
            if not diff <= tol:
                raise Mismatch(
                    f"step {s.step} ({label(s)}), row {row}: request {rid} at position {pos}: "
                    f"logits differ from transformers by {diff:.3g} (tolerance {tol:g})"
                )
            worst = max(worst, diff)
    return worst
