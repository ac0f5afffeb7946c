"""Deterministic references for the special-function probes, and the residual code tables use.

A probe of an approximate instruction (ex2.approx, rcp.approx, div.full, libdevice's log2) stores
its outputs y as residuals r = ordered(y) - ordered(ref(x)): small integers that compress well. A
reference here is no model of the hardware and need not be correctly rounded; it must give the
same bits on any device, so each is made of IEEE float64 operations in torch ops of their own (no
library exp or log: their bits are the library's). The CPU rebuilds y = from_ordered(ordered(ref(x))
+ r) exactly and checks the rebuild against the sha256 the GPU took of the raw outputs.

`ordered` maps FP32 bit patterns to integers monotonically (-0 just below +0, NaNs past the
infinities), so a residual counts ULPs for finite values and stays invertible for every pattern.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from h3lab.emulate.floats import bits, fp32_from_bits

F64 = torch.float64
_LN2 = math.log(2.0)
_INV_LN2 = 1.0 / _LN2
_EXP_TAYLOR = [1.0 / math.factorial(k) for k in range(18)]  # e^t for |t| <= ln2 / 2: 2^-80 truncation
_ATANH_ODD = [1.0 / (2 * k + 1) for k in range(14)]  # 2 atanh(s), |s| <= 0.172: s^29 ~ 2^-74


def ordered(x_f32: Tensor) -> Tensor:
    """int64: FP32 bit patterns as integers in the order of the values (module docstring)."""
    b = bits(x_f32)
    return torch.where(b >= 1 << 31, -1 - (b & 0x7FFFFFFF), b)


def from_ordered(o: Tensor) -> Tensor:
    """The FP32 values whose `ordered` integers are o (inverse of `ordered`)."""
    return fp32_from_bits(torch.where(o < 0, (-1 - o) | (1 << 31), o))


def _horner(t: Tensor, coefficients: list[float]) -> Tensor:
    p = torch.full_like(t, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        p = p * t
        p = p + c
    return p


def exp2_ref(x_f32: Tensor) -> Tensor:
    """FP32 2^x from float64 steps: x = n + r (n nearest integer), e^(r ln 2) by Taylor, times 2^n."""
    x = x_f32.to(F64).clamp(-400.0, 400.0)
    n = torch.round(torch.nan_to_num(x, nan=0.0))
    t = (x - n) * _LN2
    pow2 = ((n.to(torch.int64) + 1023) << 52).view(F64)  # exact for |n| <= 1022
    y = (_horner(t, _EXP_TAYLOR) * pow2).to(torch.float32)
    return torch.where(torch.isnan(x_f32), x_f32, y)


def log2_ref(x_f32: Tensor) -> Tensor:
    """FP32 log2(x) from float64 steps: x = m 2^e with m in [sqrt(1/2), sqrt(2)), then e + 2 atanh(s) / ln 2
    with s = (m - 1) / (m + 1); log2(0) = -inf, log2(x < 0) = NaN, log2(inf) = inf."""
    x = x_f32.to(F64)
    m, e = torch.frexp(torch.where(x > 0, x, 1.0).nan_to_num(posinf=1.0))
    m, e = m * 2.0, (e - 1).to(F64)
    high = m > math.sqrt(2.0)
    m, e = torch.where(high, m * 0.5, m), torch.where(high, e + 1.0, e)
    s = (m - 1.0) / (m + 1.0)
    y = (e + (_horner(s * s, _ATANH_ODD) * s * 2.0) * _INV_LN2).to(torch.float32)
    y = torch.where(x == 0, -math.inf, torch.where(x < 0, math.nan, y))
    return torch.where(torch.isnan(x) | torch.isinf(x), x_f32, y)


def rcp_ref(x_f32: Tensor) -> Tensor:
    """FP32 of the float64 quotient 1 / x (one IEEE division, then one rounding)."""
    return (1.0 / x_f32.to(F64)).to(torch.float32)


def div_ref(a_f32: Tensor, b_f32: Tensor) -> Tensor:
    """FP32 of the float64 quotient a / b."""
    return (a_f32.to(F64) / b_f32.to(F64)).to(torch.float32)
