"""A real Mamba driven by the generated ``mamba`` buffers: a packed-input engine and an
in-flight driver, checked against Hugging Face ``MambaForCausalLM``.

The engine (`PackedMamba`) reads only the engine inputs of a prepared step: ``input_ids``,
``host_request_types`` (0 context, 1 generation), ``host_context_lengths``, ``last_token_ids``
and ``slot_mapping``, plus the static ``conv_state_ptr_<l>`` / ``rnn_state_ptr_<l>`` it was
bound with once (``buffers.static_inputs``). It writes ``step.outputs["logits"]``. Each layer's
convolution and SSM states live in per-layer pools of ``max_batch_size`` rows that the driver
allocates (`StatePools`); the engine finds a pool by the address it is given (a map from
``data_ptr()`` to tensor, as a device allocator would) and refuses an unknown address. A
sequence's state is its pool row ``slot_mapping[i]``; a context row starts it from zero with the
whole prompt (as TensorRT-LLM's Mamba plugin does), a generation row advances it by one token.

The mixer is the torch "slow path" of ``transformers``' ``MambaMixer`` (causal depthwise conv1d,
then the selective scan), written over packed sequences with an explicit initial state, with the
same arithmetic: HF's scan rounds ``A``, ``B``, the scan input and ``D`` to float32 even in a
float64 model, and so does this one, so the float64 logits agree with HF's to ~1e-15.

The driver (`MambaDriver`) serves requests that arrive over time, each with its own
``max_new_tokens``, under the family's contract: whole prompts in one context step (no
chunking), context and generation requests in separate steps, beam width 1. A step is either a
context step (waiting requests admitted in arrival order while slots are free and their whole
prompts fit ``max_num_tokens``) or a generation step (every running request, one token each),
alternating while requests wait; steady generation steps (the same requests as the last step)
use ``buffers.advance``. A request that has its tokens frees its slot for a later arrival.

``python -m bufc.examples.mamba`` runs a workload and checks every token against
``model.generate`` and every logit row against HF's forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from bufc.generated import mamba
from bufc.runtime import Request

from .compare import (
    assert_row_logits,
    assert_same_tokens,
    float64_model,
    random_jobs,
    reference_tokens,
    threads_option,
    torch_threads,
)
from .executor import Job, admit_whole_prompts, whole_prompt_queue

CONTEXT, GENERATION = 0, 1


def tiny_mamba(
    seed: int = 0,
    *,
    vocab_size: int = 256,
    hidden_size: int = 48,
    num_layers: int = 2,
    init_scale: float = 0.3,
) -> torch.nn.Module:
    """A small random ``MambaForCausalLM`` in float64 (nothing downloaded). eos is disabled so
    that ``generate`` gives exactly ``max_new_tokens`` tokens, as the driver does."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        state_size=8,
        num_hidden_layers=num_layers,
        conv_kernel=4,
        expand=2,
        initializer_range=init_scale,
    )
    return float64_model(MambaForCausalLM, config, seed)


# ------------------------------------------------------------------------------ state pools
class StatePools:
    """Per-layer state pools, ``max_batch_size`` rows each: convolution state
    ``[rows, intermediate, conv_kernel - 1]`` and SSM state ``[rows, intermediate, state_size]``.
    ``memory`` maps each pool's address to the pool (what the engine resolves pointers with)."""

    def __init__(
        self,
        hf_config,
        rows: int,
        dtype: torch.dtype = torch.float64,
        device: str | torch.device = "cpu",
    ) -> None:
        inner, kernel = hf_config.intermediate_size, hf_config.conv_kernel
        layers = hf_config.num_hidden_layers
        self.conv = [
            torch.zeros(rows, inner, kernel - 1, dtype=dtype, device=device) for _ in range(layers)
        ]
        self.ssm = [
            torch.zeros(rows, inner, hf_config.state_size, dtype=dtype, device=device)
            for _ in range(layers)
        ]
        self.memory: dict[int, torch.Tensor] = {t.data_ptr(): t for t in (*self.conv, *self.ssm)}

    def static_inputs(self) -> dict[str, list[list[int]]]:
        """The values of the family's static pointer tensors ([num_local_layers, 1] each)."""
        return {
            "host_conv_state_pointers": [[t.data_ptr()] for t in self.conv],
            "host_rnn_state_pointers": [[t.data_ptr()] for t in self.ssm],
        }


# ----------------------------------------------------------------------------------- engine
class PackedMamba:
    """A packed-input Mamba forward over bufc's step tensors, with Hugging Face weights."""

    def __init__(self, hf_model: torch.nn.Module, memory: dict[int, torch.Tensor]) -> None:
        cfg = hf_model.config
        self.hf = hf_model
        self.backbone = hf_model.backbone
        self.layers = list(self.backbone.layers)
        self.memory = memory
        self.inner = cfg.intermediate_size
        self.kernel = cfg.conv_kernel
        self.state_size = cfg.state_size
        self.rank = int(cfg.time_step_rank)
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.vocab_size = cfg.vocab_size
        self.static: dict[str, torch.Tensor] | None = None

    def bind(self, static_inputs: dict[str, torch.Tensor]) -> None:
        """Bind the static engine inputs once (``buffers.static_inputs``)."""
        missing = [
            f"{kind}_state_ptr_{layer}"
            for layer in range(len(self.layers))
            for kind in ("conv", "rnn")
            if f"{kind}_state_ptr_{layer}" not in static_inputs
        ]
        if missing:
            raise ValueError(f"static inputs lack {', '.join(missing)}")
        self.static = dict(static_inputs)

    def _pool(self, kind: str, layer: int, shape: tuple[int, ...]) -> torch.Tensor:
        """The pool at the address bound as ``<kind>_state_ptr_<layer>``."""
        assert self.static is not None, "bind(buffers.static_inputs) first"
        address = int(self.static[f"{kind}_state_ptr_{layer}"].reshape(-1)[0])
        pool = self.memory.get(address)
        if pool is None:
            raise ValueError(
                f"{kind}_state_ptr_{layer} = {address:#x} is not the address of a state pool"
            )
        if tuple(pool.shape[1:]) != shape:
            raise ValueError(
                f"{kind}_state_ptr_{layer} points at a pool of shape {tuple(pool.shape)}, "
                f"expected [rows, {', '.join(map(str, shape))}]"
            )
        return pool

    @torch.no_grad()
    def forward(self, step) -> None:
        inp = step.inputs
        types = inp["host_request_types"].tolist()
        lengths = inp["host_context_lengths"].tolist()
        tokens = step.sizes.num_tokens
        if any(t not in (CONTEXT, GENERATION) for t in types):
            raise ValueError(f"request types must be 0 or 1, got {types}")
        # tokens of each sequence: the whole prompt for a context row, one for a generation row
        new = [n if t == CONTEXT else 1 for t, n in zip(types, lengths)]
        if sum(new) != tokens:
            raise ValueError(f"context lengths cover {sum(new)} tokens, the step packs {tokens}")
        starts = [0]
        for n in new:
            starts.append(starts[-1] + n)
        slots = inp["slot_mapping"].long()
        slot_list = slots.tolist()
        if len(set(slot_list)) != len(slot_list):
            raise ValueError(f"slot_mapping repeats a slot: {slot_list}")
        ctx = [i for i, t in enumerate(types) if t == CONTEXT]
        gen = [i for i, t in enumerate(types) if t == GENERATION]

        x = self.backbone.embeddings(inp["input_ids"].long())
        for layer_idx, layer in enumerate(self.layers):
            conv_pool = self._pool("conv", layer_idx, (self.inner, self.kernel - 1))
            ssm_pool = self._pool("rnn", layer_idx, (self.inner, self.state_size))
            if slot_list and max(slot_list) >= min(conv_pool.shape[0], ssm_pool.shape[0]):
                raise ValueError(f"slot_mapping {slot_list} is beyond the state pools' rows")
            residual = x
            h = layer.norm(x.to(dtype=layer.norm.weight.dtype))
            if self.residual_in_fp32:
                residual = residual.to(torch.float32)  # as HF's MambaBlock
            h = self._mixer(layer.mixer, h, starts, ctx, gen, slots, conv_pool, ssm_pool)
            x = residual + h
        x = self.backbone.norm_f(x)
        last = inp["last_token_ids"].long() - 1  # 1-based index of each logit row's last token
        logits = step.outputs["logits"]
        logits[:, : self.vocab_size].copy_(self.hf.lm_head(x[last]))

    def _mixer(self, mixer, h, starts, ctx, gen, slots, conv_pool, ssm_pool) -> torch.Tensor:
        """MambaMixer over packed tokens [tokens, hidden]: each context row from a zero state,
        the generation rows (one token each) batched from their pool rows."""
        xz = mixer.in_proj(h)  # [tokens, 2 * inner]
        out = torch.empty(h.shape[0], self.inner, dtype=h.dtype, device=h.device)
        for i in ctx:  # a whole prompt: its state starts from zero
            a, b = starts[i], starts[i + 1]
            if a == b:
                continue
            conv0 = conv_pool.new_zeros(1, self.inner, self.kernel - 1)
            ssm0 = ssm_pool.new_zeros(1, self.inner, self.state_size)
            y, conv, ssm = self._sequences(mixer, xz[None, a:b], conv0, ssm0)
            out[a:b] = y[0]
            conv_pool[slots[i]] = conv[0]
            ssm_pool[slots[i]] = ssm[0]
        if gen:
            rows = torch.tensor([starts[i] for i in gen], device=h.device)
            seq_slots = slots[gen]
            y, conv, ssm = self._sequences(
                mixer, xz[rows][:, None], conv_pool[seq_slots], ssm_pool[seq_slots]
            )
            out[rows] = y[:, 0]
            conv_pool[seq_slots] = conv
            ssm_pool[seq_slots] = ssm
        return mixer.out_proj(out)

    def _sequences(self, mixer, xz, conv_state, ssm_state):
        """S sequences of n tokens each: xz [S, n, 2 * inner], conv_state [S, inner, K - 1],
        ssm_state [S, inner, N]. Returns the gated scan output [S, n, inner] (before out_proj)
        and the new states. The arithmetic is HF's mamba_selective_scan, dtype casts included."""
        n = xz.shape[1]
        u, gate = xz.transpose(1, 2).chunk(2, dim=1)  # [S, inner, n] each
        # causal depthwise conv1d over the last K - 1 inputs followed by the new ones
        window = torch.cat([conv_state, u.to(conv_state.dtype)], dim=-1)  # [S, inner, K - 1 + n]
        conv = mixer.conv1d
        u = F.conv1d(window.to(conv.weight.dtype), conv.weight, conv.bias, groups=self.inner)
        u = mixer.act(u).to(xz.dtype)  # [S, inner, n]
        new_conv = window[:, :, window.shape[-1] - (self.kernel - 1) :]

        dt, B, C = torch.split(
            mixer.x_proj(u.transpose(1, 2)), [self.rank, self.state_size, self.state_size], dim=-1
        )  # [S, n, R], [S, n, N], [S, n, N]
        dt = mixer.dt_proj.weight @ dt.transpose(1, 2)  # [S, inner, n]
        dt = F.softplus(dt + mixer.dt_proj.bias.float()[..., None])
        A = -torch.exp(mixer.A_log.float())  # [inner, N]
        dA = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # [S, inner, n, N]
        dBu = dt[:, :, :, None] * B[:, None, :, :].float() * u[:, :, :, None].float()
        state = ssm_state.to(u.dtype)
        ys = []
        for t in range(n):
            state = dA[:, :, t] * state + dBu[:, :, t]
            ys.append(torch.matmul(state.to(u.dtype), C[:, t, :, None])[:, :, 0])
        y = torch.stack(ys, dim=-1)  # [S, inner, n]
        y = y + u * mixer.D.float()[None, :, None]
        y = y * F.silu(gate)
        return y.transpose(1, 2), new_conv, state.to(ssm_state.dtype)


# ----------------------------------------------------------------------------------- driver
@dataclasses.dataclass
class StepRecord:
    step: int
    kind: str  # "context" or "generation"
    advanced: bool  # prepared by buffers.advance
    rids: list[int]  # the request of each logit row
    slots: list[int]
    prompt_lengths: list[int]
    reused_slot: list[bool]  # context rows: the slot held an earlier request's state
    waiting: int  # arrived requests still waiting after this step's admissions
    running: int  # requests in flight after this step (those that finished removed)
    positions: list[int]  # the position whose next-token logits each row holds
    logits: torch.Tensor  # [rows, vocab] float64, a copy
    prepare_s: float
    step_s: float


@dataclasses.dataclass
class MambaResult:
    tokens: dict[int, list[int]]
    token_steps: dict[int, list[int]]  # the step that produced each generated token
    prompts: dict[int, tuple[int, ...]]
    steps: list[StepRecord]
    slot_reuses: int  # admissions into a slot an earlier request had used


@dataclasses.dataclass(eq=False)
class _Running:
    job: Job
    request: Request


class MambaDriver:
    def __init__(
        self,
        hf_model: torch.nn.Module,
        *,
        max_batch_size: int = 4,
        max_num_tokens: int = 64,
        device: str | torch.device = "cpu",
    ) -> None:
        cfg = hf_model.config
        dtype = next(hf_model.parameters()).dtype
        self.config = mamba.Config(
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_hidden_layers,
            logits_dtype=dtype,
        )
        self.pools = StatePools(cfg, max_batch_size, dtype, device)
        self.buffers = mamba.RuntimeBuffers(
            self.config, device=device, static_inputs=self.pools.static_inputs()
        )
        self.engine = PackedMamba(hf_model, self.pools.memory)
        self.engine.bind(self.buffers.static_inputs)  # bound once, as an engine binds them

    def run(
        self, jobs: Iterable[Job], *, mutate: Callable[[int, object], None] | None = None
    ) -> MambaResult:
        """Serve `jobs` to completion. `mutate(step_index, step)` may alter a prepared step
        before the engine runs (the tests use it to prove the comparison can fail)."""
        c = self.config
        pending = whole_prompt_queue(jobs, c.max_num_tokens)
        result = MambaResult(
            tokens={j.rid: [] for j in pending},
            token_steps={j.rid: [] for j in pending},
            prompts={j.rid: j.prompt for j in pending},
            steps=[],
            slot_reuses=0,
        )
        waiting: deque[Job] = deque()
        running: list[_Running] = []
        free_slots = list(range(c.max_batch_size))
        used_slots: set[int] = set()
        last_kind: str | None = None
        last_generation: list[_Running] | None = None
        last_tokens: list[int] = []
        step_index = 0
        while pending or waiting or running:
            t0 = time.perf_counter()
            while pending and pending[0].arrival_step <= step_index:
                waiting.append(pending.popleft())
            context: list[_Running] = []
            reused: list[bool] = []
            if waiting and free_slots and (last_kind != "context" or not running):
                admitted = admit_whole_prompts(waiting, free_slots, used_slots, c.max_num_tokens)
                for job, slot, was_used in admitted:
                    reused.append(was_used)
                    req = Request(seq_slot=slot, prompt=list(job.prompt), generated=[[]])
                    context.append(_Running(job, req))
            generation = [] if context else list(running)
            if not context and not generation:
                last_kind, last_generation = None, None
                step_index += 1
                continue
            t1 = time.perf_counter()
            advanced = (
                bool(generation) and last_kind == "generation" and generation == last_generation
            )
            if advanced:  # the same requests, one token longer each
                step = self.buffers.advance(last_tokens)
            else:
                step = self.buffers.prepare_step(
                    [r.request for r in context], [r.request for r in generation]
                )
            t2 = time.perf_counter()
            if mutate is not None:
                mutate(step_index, step)
            self.engine.forward(step)
            logits = step.outputs["logits"][:, : c.vocab_size]
            sampled = logits.argmax(dim=-1).tolist()
            rows = context or generation
            record = StepRecord(
                step=step_index,
                kind="context" if context else "generation",
                advanced=advanced,
                rids=[r.job.rid for r in rows],
                slots=[r.request.seq_slot for r in rows],
                prompt_lengths=[len(r.job.prompt) for r in rows],
                reused_slot=reused,
                waiting=len(waiting),
                running=0,
                positions=[len(r.job.prompt) + len(r.request.generated[0]) - 1 for r in rows],
                logits=logits.detach().to("cpu", copy=True),
                prepare_s=t2 - t1,
                step_s=0.0,
            )
            result.slot_reuses += sum(reused)
            running.extend(context)
            for r, token in zip(rows, sampled):
                r.request.generated[0].append(token)
                result.tokens[r.job.rid].append(token)
                result.token_steps[r.job.rid].append(step_index)
                if len(r.request.generated[0]) == r.job.max_new_tokens:
                    running.remove(r)
                    free_slots.append(r.request.seq_slot)
            record.running = len(running)
            last_kind = record.kind
            last_generation = generation if generation else None
            last_tokens = sampled
            record.step_s = time.perf_counter() - t0
            result.steps.append(record)
            step_index += 1
        return result


# ------------------------------------------------------------------------------- reference
def mamba_workload(n: int = 16, *, seed: int = 0, vocab_size: int = 256, max_prompt: int = 40):
    """`n` requests arriving over the first steps, prompts of 1 to `max_prompt` tokens (the
    first ones 1, 2 and 3 tokens: shorter than the convolution window), each stopping after its
    own number of tokens; the last one, a 1-token prompt, arrives once slots have been freed."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, max_prompt] + [rng.randint(1, max_prompt) for _ in range(n - 5)] + [1]
    jobs = random_jobs(rng, lengths, vocab_size=vocab_size, new_tokens=(1, 10), last_arrival=n)
    jobs[-1] = dataclasses.replace(jobs[-1], arrival_step=4 * n)
    return jobs


@torch.no_grad()
def reference_logits(model: torch.nn.Module, result: MambaResult) -> dict[int, torch.Tensor]:
    """Each request's float64 logits at every position of its sequence so far (prompt plus the
    tokens it was given, all but the last), by one full HF forward. HF's own forward returns
    its logits cast to float32; we take its float64 hidden states through its lm_head."""
    out = {}
    for rid, prompt in result.prompts.items():
        ids = torch.tensor([[*prompt, *result.tokens[rid][:-1]]], device=model.device)
        hidden = model.backbone(ids, use_cache=False).last_hidden_state
        out[rid] = model.lm_head(hidden)[0].to("cpu")
    return out


def assert_same_logits(
    result: MambaResult, reference: dict[int, torch.Tensor], tol: float = 1e-9
) -> float:
    """Every logit row of every step against HF's logits for that request's sequence so far.
    Raises Mismatch on the earliest step with a row off by more than `tol`; returns the
    largest difference otherwise."""
    return assert_row_logits(
        result.steps,
        lambda rid, pos: reference[rid][pos],
        tol,
        lambda s: f"{s.kind}{', advance' if s.advanced else ''}",
    )


def check(
    model: torch.nn.Module, result: MambaResult, tokens: dict[int, list[int]], tol: float = 1e-9
) -> float:
    """Logits (earliest failing step first), then tokens against `tokens` (generate's)."""
    worst = assert_same_logits(result, reference_logits(model, result), tol)
    assert_same_tokens(result, tokens)  # type: ignore[arg-type]  # tokens, token_steps
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    threads_option(p)
    args = p.parse_args(argv)
    with torch_threads(args.threads):
        return _main(args.threads)


def _main(threads: int) -> int:
    model = tiny_mamba(0)
    jobs = mamba_workload(16, seed=1, vocab_size=model.config.vocab_size)
    t = time.perf_counter()
    result = MambaDriver(model, max_batch_size=4, max_num_tokens=64).run(jobs)
    served = time.perf_counter() - t
    worst = check(model, result, reference_tokens(model, jobs))
    steps = result.steps
    print(
        f"{len(jobs)} requests, {len(steps)} steps "
        f"({sum(s.kind == 'context' for s in steps)} context, "
        f"{sum(s.kind == 'generation' for s in steps)} generation, "
        f"{sum(s.advanced for s in steps)} by advance), "
        f"{sum(map(len, result.tokens.values()))} tokens in {served:.2f} s, "
        f"{result.slot_reuses} slot reuses; torch intra-op threads {threads}"
    )
    print(f"all {len(jobs)} requests match transformers.generate; max logit diff {worst:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
