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

# Operands of a unit-tree GEMM: pieces (a [M, U*Kp], b [U*Kp, N]); unit i is column block i of
# every piece's a and row block i of its b. Each unit is one chain over its blocks, pieces in order
# (q,k,v / hidden,gate), then the balanced tree over the U units.
Pieces = Sequence[tuple[Tensor, Tensor]]

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


ROW_BLOCK = 1024  # elements per row block of `sum_of_squares`; a power of two: a block's tree needs no padding
_SQUARES_CHUNK = 4096  # row blocks squared at once: 16 MiB of FP32 temporaries whatever the tensor's size


def sum_of_squares(g: Tensor) -> Tensor:
    """The sum of squares of every element (0-d float32), a fixed function of the elements alone.

    FP32 squares of the elements in row-major order (a strided view is read in that order), in row
    blocks of ROW_BLOCK elements (the last padded with +0), each block summed by `pair_sum`, then the
    blocks' sums by `pair_sum`. h3lab.triton.squares computes the block sums as one kernel.
    """
    flat = g.reshape(-1)
    num_blocks = max(1, -(-flat.numel() // ROW_BLOCK))
    block_sums = []
    for b0 in range(0, num_blocks, _SQUARES_CHUNK):
        x = flat[b0 * ROW_BLOCK : (b0 + _SQUARES_CHUNK) * ROW_BLOCK].to(torch.float32)
        sq = x * x
        pad = -sq.numel() % ROW_BLOCK
        if pad or not sq.numel():
            sq = torch.cat([sq, sq.new_zeros(pad or ROW_BLOCK)])
        block_sums.append(pair_sum(sq.view(-1, ROW_BLOCK)))  # each row's tree depends on that row alone
    return pair_sum(torch.cat(block_sums))


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


# Columns per step of the chain on CPU: a [264, 2048] fp32 accumulator (2.1 MB) stays in L2;
# measured 34 GFLOP/s at M=264, K=5376 on 2 cores against 11 GFLOP/s with 256-wide tiles.
_CPU_TILE_N = 2048


def chain_mm(a_MK: Tensor, b_KN: Tensor, acc_MN: Tensor | None = None) -> Tensor:
    """a @ b in float32 as one left-to-right chain over k: acc = acc + a[:, k] * b[k, :].

    Row m of the result depends only on a[m] and b (never on M), column n only on b[:, n]; the
    order over k is ascending. bf16 (and fp16) products are exact in fp32 unless they fall below its
    normal range (|a b| < 2^-126), so fusing the multiply and add changes no bit above it; fp32
    operands take a separate multiply and add. `acc_MN`
    continues an earlier chain (the q,k,v and hidden,gate pieces of one canonical unit).
    """
    M, K = a_MK.shape
    K2, N = b_KN.shape
    assert K == K2, (a_MK.shape, b_KN.shape)
    exact_products = a_MK.dtype in (torch.bfloat16, torch.float16) and b_KN.dtype in (torch.bfloat16, torch.float16)
    a_KM = a_MK.to(torch.float32).t().contiguous()
    b_KN = b_KN.to(torch.float32).contiguous()
    out = torch.zeros(M, N, dtype=torch.float32, device=a_MK.device) if acc_MN is None else acc_MN
    tile = _CPU_TILE_N if a_MK.device.type == "cpu" else N
    for n0 in range(0, N, max(tile, 1)):
        acc = out[:, n0 : n0 + tile]
        acc = acc.contiguous() if not acc.is_contiguous() else acc
        b_tile = b_KN[:, n0 : n0 + tile]
        for k in range(K):
            if exact_products:
                acc.addcmul_(a_KM[k].unsqueeze(1), b_tile[k].unsqueeze(0))
            else:
                acc.add_(a_KM[k].unsqueeze(1) * b_tile[k].unsqueeze(0))
        if acc.data_ptr() != out[:, n0 : n0 + tile].data_ptr():
            out[:, n0 : n0 + tile] = acc
    return out


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


def cos_sin(angle: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, sin) of float32 angles with |angle| < 1e6, in float64 internally, rounded to fp32."""
    x = angle.to(torch.float64)
    if x.numel() and float(x.abs().max()) >= 1e6:
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


def chain_bmm(a_BMK: Tensor, b_BKN: Tensor) -> Tensor:
    """Batched `chain_mm`: for every b, a[b] @ b[b] as one FP32 chain over k ascending."""
    B, M, K = a_BMK.shape
    assert b_BKN.shape[:2] == (B, K), (a_BMK.shape, b_BKN.shape)
    exact_products = a_BMK.dtype in (torch.bfloat16, torch.float16) and b_BKN.dtype in (torch.bfloat16, torch.float16)
    a_KBM = a_BMK.to(torch.float32).permute(2, 0, 1).contiguous()
    b_KBN = b_BKN.to(torch.float32).permute(1, 0, 2).contiguous()
    acc = torch.zeros(B, M, b_BKN.shape[2], dtype=torch.float32, device=a_BMK.device)
    for k in range(K):
        if exact_products:
            acc.addcmul_(a_KBM[k].unsqueeze(2), b_KBN[k].unsqueeze(1))
        else:
            acc.add_(a_KBM[k].unsqueeze(2) * b_KBN[k].unsqueeze(1))
    return acc
