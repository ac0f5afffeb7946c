"""The RoPE cos/sin tables of the block's partial 3-axis rotary embedding.

The reference of h3lab.triton.rope, bit for bit. Dimension legend: R rows, C rotated channels
(6 * rope_freq_dim).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from h3lab.ops.fixed import cos_sin


def rope_inv_freq(rope_freq_dim: int, theta: float) -> list[float]:
    """diffusers' `inv_freq` (1 / theta^(2k / 2f)), evaluated in double precision by Python, once."""
    return [1.0 / theta ** ((2 * k) / (2 * rope_freq_dim)) for k in range(rope_freq_dim)]


@functools.cache
def _inv_freq(rope_freq_dim: int, theta: float, device: torch.device) -> Tensor:
    # once per device: a copy from host memory would wait for the GPU's queue at every block
    return torch.tensor(rope_inv_freq(rope_freq_dim, theta), dtype=torch.float64).to(torch.float32).to(device)


def rope_tables(position_ids_R3: Tensor, rope_freq_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [R, 6f] float32: per-axis angles (t | h | w) concatenated, then duplicated (diffusers)."""
    inv_freq = _inv_freq(rope_freq_dim, theta, position_ids_R3.device)
    angles = position_ids_R3.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = angles.reshape(angles.shape[0], 3 * rope_freq_dim)
    return cos_sin(torch.cat([angles, angles], dim=-1))
