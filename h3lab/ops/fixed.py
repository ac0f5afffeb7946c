"""Reduction orders and transcendental functions that are ours by construction.

Every value here is produced by IEEE-754 add, sub, mul, div, sqrt, round and integer bit
operations only, each correctly rounded and applied elementwise; so a result depends on its
operands alone, never on the tensor's length, the element's position, the thread split or the
device. That rules out two CPU accidents measured on torch 2.13:
- BLAS matmul and `sum` pick kernels and split orders by shape;
- ATen's vectorised loops send the tail of a tensor (n % 8 elements, per thread chunk) through a
  scalar `std::exp`/`std::sin` that may differ by 1 ULP from the SLEEF vector path, so
  `exp(x)[i]` could change with the tensor's length.

Dimension legend: M rows, K reduced, N columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# ---- rounding to the storage dtype ------------------------------------------------------------


def round_to(x_f32: Tensor, dtype: torch.dtype) -> Tensor:
    """Round float32 to `dtype` (bf16 or fp32) to nearest-even, by integer arithmetic for bf16.

    torch's own float->bf16 cast may use VCVTNEPS2BF16 on the vector path, which flushes
    denormals, while the scalar tail does not; the integer rounding has no such seam. It runs in
    chunks of 2^22 elements: its int64 temporaries would otherwise need 8x the tensor (8 GB for
    the 1 GB AdaLN weight gradient of the real block).
    """
    if dtype == torch.float32:
        return x_f32.to(torch.float32)
    if dtype != torch.bfloat16:
        raise ValueError(f"round_to: dtype {dtype} not supported; allowed: torch.bfloat16, torch.float32")
    x = x_f32.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    flat_x, flat_out = x.view(-1), out.view(-1)
    for lo in range(0, flat_x.numel(), _ROUND_CHUNK):
        flat_out[lo : lo + _ROUND_CHUNK] = _round_bits(flat_x[lo : lo + _ROUND_CHUNK])
    return out.view(torch.bfloat16)


_ROUND_CHUNK = 1 << 22


def _round_bits(x: Tensor) -> Tensor:
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round half to even on the dropped 16 bits
    r = torch.where(torch.isnan(x), torch.full_like(r, 0x7FC0) | ((u >> 16) & 0x8000), r)
    return (r - ((r & 0x8000) << 1)).to(torch.int16)  # 16-bit two's complement, so the cast is exact


def sqrt_f32(x: Tensor) -> Tensor:
    """The correctly rounded FP32 square root of FP32 `x`: the FP64 root rounded once to FP32.

    torch's FP32 sqrt on CPU is not correctly rounded (1 ULP off for about one input in five, torch
    2.13 on an AVX-512 CPU), so its bits depend on the CPU; the FP64 root of an FP32 value rounded
    to FP32 is the correctly rounded FP32 root (53 >= 2 * 24 + 2 bits), as CUDA's sqrtf is.
    """
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


# ---- fixed-order sums ------------------------------------------------------------------------


def pair_sum(x: Tensor, dim: int = -1) -> Tensor:
    """Sum over `dim` by a balanced tree: pad to a power of two with +0, add halves (i, i+n/2).

    Adding +0 never changes a sum that starts from a nonzero or +0 value, so the padding is exact.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = torch.cat([x, x.new_zeros((*x.shape[:-1], width - n))], dim=-1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def balanced_tree(parts: Sequence[Tensor]) -> Tensor:
    """Sum `parts` (in order) by recursive halving, left half = the first ceil(n/2), lower half first.

    For a power of two this is the level-by-level pairwise tree; for 3 parts (p0+p1)+p2, for 5
    ((p0+p1)+p2)+(p3+p4). Deterministic collectives use it over ranks in group order.
    """
    if not parts:
        raise ValueError("balanced_tree needs at least one part")
    if len(parts) == 1:
        return parts[0]
    mid = (len(parts) + 1) // 2
    return balanced_tree(parts[:mid]) + balanced_tree(parts[mid:])


def unit_tree(partials: Sequence[Tensor]) -> Tensor:
    """The contract's balanced tree over 2^k partials, lower subtree first.

    For 8 units: ((u0+u1)+(u2+u3))+((u4+u5)+(u6+u7)). A rank holding units [j, j+n) computes its
    subtree with this same function; the collective applies it again over the ranks' roots.
    """
    if not partials or len(partials) & (len(partials) - 1):
        raise ValueError(f"unit_tree needs a power-of-two number of partials, got {len(partials)}")
    return balanced_tree(partials)


def chain_sum(x_KN: Tensor) -> Tensor:
    """Sum over dim 0 as a left-to-right chain (acc = acc + x[k]), float32."""
    acc = torch.zeros(x_KN.shape[1:], dtype=torch.float32, device=x_KN.device)
    for k in range(x_KN.shape[0]):
        acc.add_(x_KN[k])
    return acc


# ---- exp, sigmoid, sin/cos from basic operations ---------------------------------------------

_LN2_HI = 6.93147180369123816490e-01  # ln 2 split so n * _LN2_HI is exact for |n| < 2^20
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.4426950408889634
_EXP_TAYLOR = [1.0 / math.factorial(i) for i in range(14)]  # |r| <= ln2/2: r^14/14! < 5e-18


def _pow2(n_i64: Tensor) -> Tensor:
    """2^n in float64 for n in [-2044, 2046], exactly, built from exponent bits in two halves."""
    h1 = n_i64 // 2
    h2 = n_i64 - h1
    return ((h1 + 1023) << 52).view(torch.float64) * ((h2 + 1023) << 52).view(torch.float64)


def exp(x: Tensor) -> Tensor:
    """exp(x) for float32 x, evaluated in float64 (range reduction + degree-13 Taylor), rounded to fp32.

    Error below 0.5 ULP + 1e-16 relative before the final rounding, so it agrees with a correctly
    rounded exp except on exact fp32 ties.
    """
    x64 = x.to(torch.float64).clamp(-1000.0, 1000.0)  # exp(-1000) -> 0, exp(1000) -> inf in fp32
    n = torch.round(x64 * _INV_LN2)
    r = (x64 - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_TAYLOR[-1])
    for c in reversed(_EXP_TAYLOR[:-1]):
        p = p * r + c
    y = p * _pow2(n.to(torch.int64))
    return torch.where(torch.isnan(x), x.to(torch.float64), y).to(torch.float32)


def sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + exp(-x)) in float32 (IEEE divide)."""
    return 1.0 / (1.0 + exp(-x))


_PIO2_1 = 1.57079632673412561417e00  # pi/2 in three parts (fdlibm): n * _PIO2_1 exact for |n| < 2^20
_PIO2_2 = 6.07710050650619224932e-11
_PIO2_3 = 2.02226624879595063154e-21
_INV_PIO2 = 0.6366197723675814
_SIN_TAYLOR = [(-1) ** i / math.factorial(2 * i + 1) for i in range(10)]  # |r| <= pi/4
_COS_TAYLOR = [(-1) ** i / math.factorial(2 * i) for i in range(10)]


def _poly(r2: Tensor, coeffs: list[float]) -> Tensor:
    p = torch.full_like(r2, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * r2 + c
    return p


def cos_sin(angle: Tensor, max_abs: float | None = None) -> tuple[Tensor, Tensor]:
    """(cos, sin) of float32 angles with |angle| < 1e6, in float64 internally, rounded to fp32.
    `max_abs`: a bound on |angle| the caller has proven on the host (checked instead of the angles:
    reading their maximum back is a device sync); None reads it."""
    x = angle.to(torch.float64)
    if max_abs is not None and not max_abs < 1e6:
        raise ValueError(f"cos_sin: max_abs={max_abs}; allowed below 1e6 rad")
    if max_abs is None and x.numel() and float(x.abs().max()) >= 1e6:
        raise ValueError(f"cos_sin: |angle| up to {float(x.abs().max()):.3g}; allowed below 1e6 rad")
    n = torch.round(x * _INV_PIO2)
    r = ((x - n * _PIO2_1) - n * _PIO2_2) - n * _PIO2_3
    r2 = r * r
    s = r * _poly(r2, _SIN_TAYLOR)
    c = _poly(r2, _COS_TAYLOR)
    q = n.to(torch.int64) & 3  # quadrant: (c, s) -> (c, s), (-s, c), (-c, -s), (s, -c)
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    return cos.to(torch.float32), sin.to(torch.float32)
