"""SwiGLU activation and the gated residual: forward and backward in FP32, fixed operation order."""

from __future__ import annotations

import torch
from torch import Tensor

from h3lab.ops.fixed import sigmoid


def swiglu_fwd(hidden: Tensor, gate: Tensor) -> Tensor:
    """hidden * silu(gate), silu(g) = g * sigmoid(g)."""
    g = gate.to(torch.float32)
    return hidden.to(torch.float32) * (g * sigmoid(g))


def swiglu_bwd(da: Tensor, hidden: Tensor, gate: Tensor) -> tuple[Tensor, Tensor]:
    """(d hidden, d gate): silu'(g) = s * (1 + g * (1 - s)), s = sigmoid(g)."""
    g, h, da = gate.to(torch.float32), hidden.to(torch.float32), da.to(torch.float32)
    s = sigmoid(g)
    return da * (g * s), (da * h) * (s * (1.0 + g * (1.0 - s)))


def silu(x: Tensor) -> Tensor:
    x = x.to(torch.float32)
    return x * sigmoid(x)


def silu_bwd(dy: Tensor, x: Tensor) -> Tensor:
    x = x.to(torch.float32)
    s = sigmoid(x)
    return dy.to(torch.float32) * (s * (1.0 + x * (1.0 - s)))


def gated_residual(x: Tensor, gate: Tensor, y: Tensor) -> Tensor:
    """x + gate * y in FP32."""
    return x.to(torch.float32) + gate.to(torch.float32) * y.to(torch.float32)
