"""Rotary position embedding for the MLA rope part (default and YaRN), DeepSeek's interleaved layout.

The rotated vectors keep the checkpoint's layout: with ``interleave`` the pairs are (x0, x1),
(x2, x3)… and stay interleaved after rotation, which is how vLLM's MLA cache stores ``k_pe``.
"""

from __future__ import annotations

import math

import torch

from engine.config import RopeConfig, yarn_mscale


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    if rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(rope.factor)
    return inv_freq, attention_factor


class RotaryEmbedding:
    """Precomputed cos/sin tables; ``apply`` rotates ``x[..., rope_dim]`` at the given positions."""

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int, device: torch.device) -> None:
        if rope.rope_type == "yarn":
            inv_freq, scale = _yarn_inv_freq(rope, dim)
        else:
            inv_freq, scale = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, dim/2]
        self.cos = (freqs.cos() * scale).to(device)
        self.sin = (freqs.sin() * scale).to(device)
        self.interleave = rope.interleave
        self.max_positions = max_positions

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, ..., dim], positions: [T] -> rotated x in x's dtype (math in fp32)."""
        cos = self.cos[positions]  # [T, dim/2]
        sin = self.sin[positions]
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        xf = x.float()
        if self.interleave:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            half = xf.shape[-1] // 2
            x1, x2 = xf[..., :half], xf[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)
