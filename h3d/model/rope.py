"""Rotary position embeddings with the scaling types of Hugging Face configs.

The frequencies are computed exactly as `transformers` computes them (fp32, same formulas), since
the logits must match its implementation to 1e-4.
"""

from __future__ import annotations

import math

import torch

from h3d.model.config import RopeConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)  # [dim/2]


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig, max_pos: int) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or max_pos
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: each frequency between its original (extrapolated) and its interpolated (/ factor)
    value by a linear ramp over the dimensions whose wavelengths fit between `beta_fast` and
    `beta_slow` rotations in the original context; and the cos/sin scale. -> (inv_freq, scale)."""
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position_embeddings or max_pos
    scale = rope.attention_factor
    if scale is None:
        if rope.mscale and rope.mscale_all_dim:
            scale = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            scale = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(scale)


class RotaryEmbedding:
    """cos/sin tables for positions, per the config's rope type.

    `dynamic` (NTK) scaling enlarges the base once a sequence reaches past
    `max_position_embeddings`; as in transformers, the base follows the sequence's current length
    (`seq_ends`: for each token, its sequence's length after this forward pass), so a growing
    sequence sees the same frequencies it would see there, and each sequence of a batch its own.
    `yarn` also scales cos and sin (`attention_scaling`, in fp32 before the cast, as transformers).
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_pos: int, device: torch.device) -> None:
        self.rope = rope
        self.head_dim = head_dim
        self.max_pos = max_pos
        self.attention_scaling = 1.0
        # Computed on the CPU whatever device a caller's `with torch.device(...)` names: a model
        # built on the meta device (`h3d.model.loader`) would otherwise compute them through
        # torch's Python references, whose first call imports torch._dynamo (seconds of a start).
        with torch.device("cpu"):
            inv_freq = _base_inv_freq(rope.theta, head_dim)
            if rope.rope_type == "linear":
                inv_freq = inv_freq / rope.factor
            elif rope.rope_type == "llama3":
                inv_freq = _llama3(inv_freq, rope, max_pos)
            elif rope.rope_type == "yarn":
                inv_freq, self.attention_scaling = _yarn(rope, head_dim, max_pos)
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        self.inv_freq = inv_freq.to(device)  # [D/2] fp32
        self._exponents = exponents.to(device)  # [D/2]

    def _dynamic_inv_freq(self, seq_ends: torch.Tensor) -> torch.Tensor:
        """seq_ends: [N] -> per-token inverse frequencies [N, D/2]."""
        dim, factor = self.head_dim, self.rope.factor
        seq_len = torch.clamp(seq_ends, min=self.max_pos).to(torch.float32)  # [N]
        base = self.rope.theta * ((factor * seq_len / self.max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base[:, None] ** self._exponents[None, :])

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_ends: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N] int64 -> cos, sin: [N, D] in `dtype`."""
        pos = positions.to(torch.float32)[:, None]  # [N, 1]
        if self.rope.rope_type == "dynamic" and seq_ends is not None:
            freqs = pos * self._dynamic_inv_freq(seq_ends)  # [N, D/2]
        else:
            freqs = pos * self.inv_freq[None, :]  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        if self.attention_scaling != 1.0:
            return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D]; cos, sin: [N, D] -> x rotated (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
