"""The correctly rounded FP32 fused multiply-add, and the FMA chain of Triton's IEEE tl.dot.

`fma_f32(x, y, z)` is round-to-nearest-even of x * y + z with one rounding, as PTX fma.rn.f32 (no
FTZ: subnormals kept); `fma_f32_ftz` is fma.rn.ftz.f32 (subnormal inputs and results flushed to
zeros of their sign), as libdevice's polynomials use it. Computed in float64: the product of two
FP32 values is exact there; the sum is rounded to odd (TwoSum's exact error decides the last bit),
and a value rounded to odd with 53 bits rounds correctly to FP32's 24 (53 >= 24 + 2). Every step is
one IEEE float64 operation in a torch op of its own, so the bits are the same on any device.

`fma_dot` is what Triton 3.6 lowers tl.dot(..., input_precision="ieee") of FP32 operands to on sm90
(FMADotUtility: acc = fma(a[k], b[k], acc) for k ascending, from the incoming accumulator); the
kernels' fp32 GEMM entries and the few-row AdaLN kernel use it (h3lab.bench.ptx_audit counts their
fma.rn.f32 at the tl.dot sites). `mma_probe` checks it on the GPU.

Dimension legend: M rows, K reduced, N columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

F64 = torch.float64


def fma_f32(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    """FP32 round-to-nearest-even of x * y + z, one rounding (elementwise, broadcasting; FP32 inputs)."""
    for name, t in (("x", x), ("y", y), ("z", z)):
        if t.dtype != torch.float32:
            raise ValueError(f"fma_f32: {name} has dtype {t.dtype}; allowed: torch.float32")
    p = x.to(F64) * y.to(F64)  # exact: 48 significant bits, exponents far inside float64's range
    c = z.to(F64)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # TwoSum: s + err == p + c exactly
    even = (s.view(torch.int64) & 1) == 0
    nudge = (err != 0) & even & torch.isfinite(s)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where(nudge, torch.nextafter(s, toward), s)  # round to odd
    return s.to(torch.float32)


def fma_dot(a_MK: Tensor, b_KN: Tensor, c_MN: Tensor | None = None) -> Tensor:
    """FP32 [..., M, N]: the chain acc = fma(a[..., m, k], b[..., k, n], acc), k ascending, from c (or +0).

    a, b: FP32, or bf16/fp16 (converted to FP32 exactly first, as the kernels' `.to(tl.float32)`).
    """
    if a_MK.dim() < 2 or b_KN.dim() < 2 or a_MK.shape[-1] != b_KN.shape[-2]:
        raise ValueError(f"fma_dot: {tuple(a_MK.shape)} @ {tuple(b_KN.shape)}; allowed: [..., M, K] @ [..., K, N]")
    a, b = a_MK.to(torch.float32), b_KN.to(torch.float32)
    shape = (*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    acc = c_MN if c_MN is not None else torch.zeros(shape, dtype=torch.float32, device=a.device)
    for k in range(a.shape[-1]):
        acc = fma_f32(a[..., :, k : k + 1], b[..., k : k + 1, :], acc)
    return acc


def flush_f32(x: Tensor) -> Tensor:
    """FP32 x with subnormals replaced by zeros of their sign (PTX .ftz on an input or a result)."""
    return torch.where((x != 0) & (x.abs() < 2.0**-126), x * 0.0, x)


def fma_f32_ftz(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    """PTX fma.rn.ftz.f32: fma_f32 of the flushed inputs, its result flushed."""
    return flush_f32(fma_f32(flush_f32(x), flush_f32(y), flush_f32(z)))
