"""The RoPE cos/sin tables as one Triton kernel.

Reference: h3lab.ops.rope.rope_tables with h3lab.ops.fixed.cos_sin, bit for bit: the angle is the
same float32 product position x inv_freq, then the same float64 steps in the same order (three-part
pi/2 range reduction, degree-19/18 Taylor polynomials by Horner, quadrant select), one rounding to
float32. In torch ops the tables cost dozens of launches and a host sync per block, idle GPU time
(python -m h3lab.bench.block_profile); here one launch. Launched with `enable_fp_fusion=False`: the
reference's separate torch ops never fuse a multiply-add.

The reference raises for angles of 1e6 rad or more (the range reduction is exact for |n| < 2^20).
inv_freq[0] is 1.0 and every other entry is below it, so the largest angle is the largest
|float32(position)| and the check reads the positions: one host sync, unless the block step's
plan (h3lab.rowplan) read them already.

Dimension legend: R rows, f rope_freq_dim (per axis), C = 6f columns ((t | h | w) twice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab import rowplan
from h3lab.config import H3Config
from h3lab.ops import fixed
from h3lab.ops.rope import _inv_freq
from h3lab.triton import configs
from h3lab.triton.fp64 import f64, horner, rint
from h3lab.triton.variant import Variant, options

F32 = torch.float32
_INV_PIO2 = tl.constexpr(fixed._INV_PIO2)
_PIO2_1, _PIO2_2, _PIO2_3 = (tl.constexpr(c) for c in (fixed._PIO2_1, fixed._PIO2_2, fixed._PIO2_3))
_S = [tl.constexpr(c) for c in fixed._SIN_TAYLOR]
_C = [tl.constexpr(c) for c in fixed._COS_TAYLOR]
assert len(_S) == len(_C) == 10, "the reference's sin/cos polynomials changed degree; port them again"
_S0, _S1, _S2, _S3, _S4, _S5, _S6, _S7, _S8, _S9 = _S
_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7, _C8, _C9 = _C


@triton.jit
def _poly10(
    r2,
    c0: tl.constexpr,
    c1: tl.constexpr,
    c2: tl.constexpr,
    c3: tl.constexpr,
    c4: tl.constexpr,
    c5: tl.constexpr,
    c6: tl.constexpr,
    c7: tl.constexpr,
    c8: tl.constexpr,
    c9: tl.constexpr,
):
    p = tl.full(r2.shape, c9, tl.float64)  # Horner from the highest coefficient, as fixed._poly
    p = horner(horner(horner(horner(p, r2, c8), r2, c7), r2, c6), r2, c5)
    return horner(horner(horner(horner(horner(p, r2, c4), r2, c3), r2, c2), r2, c1), r2, c0)


@triton.jit
def _rope_kernel(
    pos_ptr, inv_ptr, cos_ptr, sin_ptr, R, sp0, sp1, F: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    C: tl.constexpr = 6 * F
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    j = cols % (3 * F)  # (t | h | w) angles, then the same again
    axis, k = j // F, j % F
    p = tl.load(pos_ptr + rows[:, None].to(tl.int64) * sp0 + axis[None, :] * sp1, mask=mask, other=0)
    angle = p.to(tl.float32) * tl.load(inv_ptr + k, mask=cols < C, other=0.0)[None, :]
    x = angle.to(tl.float64)
    n = rint(x * f64(_INV_PIO2))  # its signed zero makes sin(-0) = -0, as the reference's
    r = ((x - n * f64(_PIO2_1)) - n * f64(_PIO2_2)) - n * f64(_PIO2_3)
    r2 = r * r
    s = r * _poly10(r2, _S0, _S1, _S2, _S3, _S4, _S5, _S6, _S7, _S8, _S9)
    c = _poly10(r2, _C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7, _C8, _C9)
    q = n.to(tl.int64) & 3  # quadrant: (c, s) -> (c, s), (-s, c), (-c, -s), (s, -c)
    cos = tl.where(q == 0, c, tl.where(q == 1, -s, tl.where(q == 2, -c, s)))
    sin = tl.where(q == 0, s, tl.where(q == 1, c, tl.where(q == 2, -s, -c)))
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    tl.store(cos_ptr + offs, cos.to(tl.float32), mask=mask)
    tl.store(sin_ptr + offs, sin.to(tl.float32), mask=mask)


def rope_tables(
    position_ids_R3: Tensor, rope_freq_dim: int, theta: float, *, node: str | None = None
) -> tuple[Tensor, Tensor]:
    """cos, sin [R, 6f] float32, the bits of h3lab.ops.rope.rope_tables."""
    pos = position_ids_R3
    if pos.dim() != 2 or pos.shape[1] != 3 or pos.dtype not in (torch.int64, torch.float64):
        raise ValueError(f"position_ids: {pos.dtype} {tuple(pos.shape)}; allowed: int64 or float64 [R, 3]")
    if rope_freq_dim < 1:
        raise ValueError(f"rope_freq_dim={rope_freq_dim}; allowed: >= 1")
    if pos.device.type != "cuda" and not configs.interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors, got {pos.device}; allowed: cuda (or TRITON_INTERPRET=1)")
    inv = _inv_freq(rope_freq_dim, theta, pos.device)
    rowplan.checked_max_abs_position(pos)  # a host sync unless the step's plan read it
    R, C = pos.shape[0], 6 * rope_freq_dim
    cos = torch.empty((R, C), dtype=F32, device=pos.device)
    sin = torch.empty((R, C), dtype=F32, device=pos.device)
    if R:
        cfg = configs.pinned("rope", node if node is not None else configs.node_of(pos.device))
        block_c = triton.next_power_of_2(C)
        block_r = max(1, cfg["elements"] // block_c)
        _rope_kernel[(configs.cdiv(R, block_r),)](
            pos,
            inv,
            cos,
            sin,
            R,
            pos.stride(0),
            pos.stride(1),
            F=rope_freq_dim,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=cfg["num_warps"],
            enable_fp_fusion=False,
        )
    return cos, sin


def variants(node: str) -> list[Variant]:
    """The tables at the real rope_freq_dim."""
    F = H3Config.real().rope_freq_dim
    cfg = configs.pinned("rope", node)
    block_c = triton.next_power_of_2(6 * F)
    types = {"pos_ptr": "*i64", "inv_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    const = {"F": F, "BLOCK_R": max(1, cfg["elements"] // block_c), "BLOCK_C": block_c}
    return [Variant("rope", "rope_tables", _rope_kernel, types, const, options(cfg, stages=False))]
