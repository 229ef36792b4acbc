"""Qwen2-VL's rotary tables for ``examples/qwen2_vl.py``: the plain cos/sin table, the M-RoPE
sections and the per-request M-RoPE cos/sin tables bufc's ``mrope_rotary_cos_sin`` copies."""

from __future__ import annotations

import torch


def text_config(model: torch.nn.Module):
    return model.config.text_config


# --------------------------------------------------------------------------- rotary tables
def rotary_cos_sin(model: torch.nn.Module, max_positions: int) -> torch.Tensor:
    """The engine's rotary table, float32 [max_positions, rotary_dim / 2, 2]: (cos, sin) of
    inv_freq[j] * p, computed in float32 as the Hugging Face rotary embedding computes it."""
    inv_freq = model.model.language_model.rotary_emb.inv_freq.float()
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    return torch.stack((freqs.cos(), freqs.sin()), dim=-1)


def mrope_sections(model: torch.nn.Module) -> torch.Tensor:
    """The M-RoPE section (0 temporal, 1 height, 2 width) of each of the rotary_dim / 2
    frequencies."""
    section = text_config(model).rope_parameters["mrope_section"]
    return torch.repeat_interleave(torch.arange(3), torch.tensor(section))


def mrope_rotary_cos_sin(
    table: torch.Tensor, positions: torch.Tensor, sections: torch.Tensor
) -> torch.Tensor:
    """A context request's M-RoPE table, float32 [max_positions * rotary_dim], laid out
    [max_positions, rotary_dim / 2, 2]: row p holds (cos, sin) of frequency j at the prompt
    token's position in section sections[j]; rows past the prompt hold position 0 (TensorRT-LLM
    pads the positions with zeros)."""
    max_positions, half, _ = table.shape
    if positions.shape[1] > max_positions:
        raise ValueError(f"a prompt of {positions.shape[1]} tokens, max_positions {max_positions}")
    padded = torch.zeros(3, max_positions, dtype=torch.long)
    padded[:, : positions.shape[1]] = positions
    per_freq = padded[sections]  # [half, max_positions]: the position each frequency reads
    out = table[per_freq.T, torch.arange(half)[None, :]]  # [max_positions, half, 2]
    return out.reshape(-1).contiguous()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
