"""Pipeline and tensor parallelism for the example Llama over torch.distributed.

Ranks are laid out stage-major: global rank = pp_rank * tp_size + tp_rank. The ranks of one
pipeline stage form a tensor-parallel group (all-reduce after the row-parallel linears, all-gather
of the vocabulary-sharded logits); stage s sends its hidden states to the same tensor-parallel
rank of stage s + 1 through the buffers' ``hidden_states_output`` / ``hidden_states_input``. The
last stage samples, and its tokens reach every rank by a broadcast, so every rank's scheduler
takes the same next step.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Parallel:
    """This process's place in a tp_size x pp_size world (one process, one rank, by default)."""

    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    tp_group: Any = None  # the torch.distributed group of this stage's tensor-parallel ranks

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(t, group=self.tp_group)
        return t

    def gather_vocab(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        """`out[:, tp_rank * n : (tp_rank + 1) * n] = shard` of every tensor-parallel rank."""
        if self.tp_size == 1:
            out.copy_(shard)
            return
        parts = [torch.empty_like(shard) for _ in range(self.tp_size)]
        dist.all_gather(parts, shard.contiguous(), group=self.tp_group)
        torch.cat(parts, dim=1, out=out)

    def recv_hidden(self, t: torch.Tensor) -> None:
        dist.recv(t, src=self.rank - self.tp_size)

    def send_hidden(self, t: torch.Tensor) -> None:
        dist.send(t.contiguous(), dst=self.rank + self.tp_size)

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last stage's sampled tokens, on every rank."""
        if self.distributed:
            dist.broadcast(tokens, src=(self.pp_size - 1) * self.tp_size)
        return tokens


def init(tp_size: int, pp_size: int, rank: int, backend: str, init_method: str) -> Parallel:
    """Join the world and build the tensor-parallel groups (every rank creates every group, in
    the same order, as torch.distributed requires)."""
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=tp_size * pp_size
    )
    mine = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if rank in ranks:
            mine = group
    return Parallel(tp_size, pp_size, rank, mine)


def _rows(linear: torch.nn.Linear, start: int, stop: int) -> torch.nn.Linear:
    out = torch.nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None)
    out = out.to(linear.weight.dtype).to(linear.weight.device)
    out.weight.data.copy_(linear.weight.data[start:stop])
    if linear.bias is not None:
        out.bias.data.copy_(linear.bias.data[start:stop])
    return out


def _cols(linear: torch.nn.Linear, start: int, stop: int, keep_bias: bool) -> torch.nn.Linear:
    out = torch.nn.Linear(
        stop - start, linear.out_features, bias=linear.bias is not None and keep_bias
    )
    out = out.to(linear.weight.dtype).to(linear.weight.device)
    out.weight.data.copy_(linear.weight.data[:, start:stop])
    if linear.bias is not None and keep_bias:
        out.bias.data.copy_(linear.bias.data)
    return out


def shard_layer(layer: torch.nn.Module, heads: int, kv_heads: int, head_dim: int, par: Parallel):
    """A copy of one decoder layer holding this rank's share: q/k/v and gate/up split by output
    (column-parallel), o and down split by input (row-parallel; the bias stays on rank 0), so
    the partial outputs add up under an all-reduce."""
    layer = copy.deepcopy(layer)
    r, n = par.tp_rank, par.tp_size
    attn, mlp = layer.self_attn, layer.mlp
    q, kv = heads // n * head_dim, kv_heads // n * head_dim
    attn.q_proj = _rows(attn.q_proj, r * q, (r + 1) * q)
    attn.k_proj = _rows(attn.k_proj, r * kv, (r + 1) * kv)
    attn.v_proj = _rows(attn.v_proj, r * kv, (r + 1) * kv)
    attn.o_proj = _cols(attn.o_proj, r * q, (r + 1) * q, keep_bias=r == 0)
    inter = mlp.gate_proj.out_features // n
    mlp.gate_proj = _rows(mlp.gate_proj, r * inter, (r + 1) * inter)
    mlp.up_proj = _rows(mlp.up_proj, r * inter, (r + 1) * inter)
    mlp.down_proj = _cols(mlp.down_proj, r * inter, (r + 1) * inter, keep_bias=r == 0)
    return layer


def vocab_shard(lm_head: torch.nn.Linear, padded: int, par: Parallel) -> torch.Tensor:
    """This rank's rows of the output projection over the padded vocabulary (padding rows are
    zero; the sampler never picks them)."""
    w = lm_head.weight.data
    full = torch.zeros(padded, w.shape[1], dtype=w.dtype, device=w.device)
    full[: w.shape[0]] = w
    n = padded // par.tp_size
    return full[par.tp_rank * n : (par.tp_rank + 1) * n].clone()
