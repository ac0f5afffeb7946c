"""RMSNorm with AdaLN modulation, per-head q/k RMSNorm and partial 3-axis RoPE: forward and backward.

Dimension legend: R rows, D hidden, H heads (local), Dh head_dim, C rotated channels (6*rope_freq_dim).
All arithmetic is FP32 with a fixed operation order; the caller rounds each op's output once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from h3lab.ops.fixed import pair_sum, sqrt_f32


def _mean(x: Tensor) -> Tensor:
    # sum by a balanced tree, then times 1/n rounded to fp32: CUDA turns a division by a Python
    # scalar into this multiplication anyway, and CPU divides; an explicit multiply is the same on both
    return pair_sum(x, -1) * (1.0 / x.shape[-1])


def _rstd(x: Tensor, eps: float) -> Tensor:
    # the correctly rounded root (torch's fp32 sqrt on CPU is not: h3lab.ops.fixed.sqrt_f32); the divide is IEEE
    ms = _mean(x * x) + eps
    return 1.0 / sqrt_f32(ms)


def rms_modulate_fwd(x_RD: Tensor, w_D: Tensor, scale_RD: Tensor, shift_RD: Tensor, eps: float) -> Tensor:
    """rmsnorm(x) * w * (1 + scale) + shift, FP32 [R, D] (scale/shift are the rows' AdaLN table rows)."""
    x = x_RD.to(torch.float32)
    xhat = x * _rstd(x, eps).unsqueeze(-1)
    return (xhat * w_D.to(torch.float32)) * (1.0 + scale_RD.to(torch.float32)) + shift_RD.to(torch.float32)


def rms_modulate_bwd(
    dm_RD: Tensor, x_RD: Tensor, w_D: Tensor, scale_RD: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of `rms_modulate_fwd` given d out. Returns FP32 (dx, dw per row, dscale, dshift)."""
    x = x_RD.to(torch.float32)
    rstd = _rstd(x, eps).unsqueeze(-1)
    xhat = x * rstd
    w = w_D.to(torch.float32)
    dm = dm_RD.to(torch.float32)
    dscale = dm * (xhat * w)
    dn = dm * (1.0 + scale_RD.to(torch.float32))
    dxhat = dn * w
    dx = rstd * (dxhat - xhat * _mean(dxhat * xhat).unsqueeze(-1))
    return dx, dn * xhat, dscale, dm


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rotate_half_t(y: Tensor) -> Tensor:  # transpose of _rotate_half
    y1, y2 = y.chunk(2, dim=-1)
    return torch.cat([y2, -y1], dim=-1)


def qk_norm_rope_fwd(q_RHD: Tensor, w_D: Tensor, cos_RC: Tensor, sin_RC: Tensor, eps: float) -> Tensor:
    """Per-head RMSNorm over head_dim, then RoPE on the first C channels. FP32 [R, H, Dh]."""
    q = q_RHD.to(torch.float32)
    qn = q * _rstd(q, eps).unsqueeze(-1) * w_D.to(torch.float32)
    C = cos_RC.shape[-1]
    cos, sin = cos_RC.unsqueeze(1), sin_RC.unsqueeze(1)
    rot = qn[..., :C] * cos + _rotate_half(qn[..., :C]) * sin
    return torch.cat([rot, qn[..., C:]], dim=-1)


def qk_norm_rope_bwd(
    dout_RHD: Tensor, q_RHD: Tensor, w_D: Tensor, cos_RC: Tensor, sin_RC: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Backward of `qk_norm_rope_fwd`. Returns FP32 (dq [R, H, Dh], dw per (row, head) [R, H, Dh])."""
    q = q_RHD.to(torch.float32)
    rstd = _rstd(q, eps).unsqueeze(-1)
    qhat = q * rstd
    dout = dout_RHD.to(torch.float32)
    C = cos_RC.shape[-1]
    cos, sin = cos_RC.unsqueeze(1), sin_RC.unsqueeze(1)
    dqn = torch.cat([dout[..., :C] * cos + _rotate_half_t(dout[..., :C] * sin), dout[..., C:]], dim=-1)
    dqhat = dqn * w_D.to(torch.float32)
    dq = rstd * (dqhat - qhat * _mean(dqhat * qhat).unsqueeze(-1))
    return dq, dqn * qhat
