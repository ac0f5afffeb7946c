"""The AdaLN projection's two GEMMs that have a handful of rows (T timesteps) or of K (T again).

References: h3lab.ops.unit_gemm.unit_mm and h3lab.ops.gemm.mm (the torch chains, at any row count).
Launchers: `unit_mm_few_rows`, `mm_few_k`. The tiled GEMMs (h3lab.triton.gemm, unit_gemm) are
built for hundreds of rows; at real H3 shapes they spent a large share of the block's kernel time
on these two (`python -m h3lab.bench.block_profile` names each kernel's share), so each gets its own kernel:

- d temb = unit tree over units of d_table[:, unit] @ W[unit]: T = 2 rows, K = 96768 (8 units of
  12096), N = 2688, W 0.52 GB bf16. Memory-bound: the tiled kernel ran 42 programs (one per
  32x64 output tile, all 8 units each). Here a program computes one (unit, column block) partial,
  one FP32 chain over the unit's K in BLOCK_K chunks ascending (IEEE products, never TF32), so
  8 x 42 = 336 programs stream W; the U partials then meet in the contract's tree (torch adds,
  IEEE, h3lab.ops.fixed.unit_tree). A TP rank passes its units' slices and gets its subtree.
- dW adaln = d_table^T @ silu(temb): [96768, 2688] with K = T = 2. The tiled kernel padded K to a
  32-wide chunk; here each output element is the chain over k = 0..K-1 of the rounded product
  a[k, m] * b[k, n] (no FMA contraction: `enable_fp_fusion=False`), rounded once. Write-bound.

Both depend on no row count or column range: each output element's chain is fixed by its own
unit, column and k, whichever program computes it. Dimension legend: T rows (timesteps), K
reduced, N columns, M output rows of mm_few_k (= the AdaLN table's 18·D columns), U units.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.ops.fixed import unit_tree
from h3lab.triton import configs
from h3lab.triton.chain import chain_kernel, launch_chain
from h3lab.triton.gemm_host import OPERAND_DTYPES, OUT_DTYPES, check_device
from h3lab.triton.variant import Variant, options

UNIT_COUNTS = (1, 2, 4, 8)


@triton.jit
def _unit_partial_kernel(
    a_ptr,
    b_ptr,
    p_ptr,
    T,
    N,
    KP,
    s_at,
    s_ak,
    s_bk,
    s_bn,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # program (column block, unit u): partial[u] = a[:, unit u] @ b[unit u, cols], one chain over K
    u = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    k_start = u.to(tl.int64) * KP
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for k0 in range(0, KP, BLOCK_K):
        k = k_start + k0 + ks
        k_in = (k0 + ks) < KP
        a = tl.load(
            a_ptr + rows[:, None] * s_at + k[None, :] * s_ak, mask=(rows[:, None] < T) & k_in[None, :], other=0.0
        ).to(tl.float32)
        b = tl.load(
            b_ptr + k[:, None] * s_bk + cols[None, :] * s_bn, mask=k_in[:, None] & (cols[None, :] < N), other=0.0
        ).to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    out = p_ptr + (u.to(tl.int64) * T + rows[:, None]) * N + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < T) & (cols[None, :] < N))


def _config(node: str | None, device: torch.device) -> dict[str, Any]:
    return configs.pinned("few_rows", node or configs.node_of(device))


def _check(fn: str, **tensors: Tensor) -> torch.device:
    for name, t in tensors.items():
        if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype not in OPERAND_DTYPES:
            got = f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
            raise ValueError(f"{fn}: {name} is {got}; allowed: a 2-D tensor of {list(OPERAND_DTYPES)}")
    return check_device(fn, *tensors.values())


def unit_mm_few_rows(a_TK: Tensor, b_KN: Tensor, num_units: int, *, node: str | None = None) -> Tensor:
    """FP32 [T, N]: per unit one IEEE FP32 chain a[:, unit] @ b[unit], then the balanced unit tree.

    Args:
        a_TK: [T, U*Kp], T at most the pinned "max_rows" (16 on sm90); bf16 or fp32.
        b_KN: [U*Kp, N], any strides (a weight W [U*Kp, N] itself for d temb).
        num_units: U, one of 1, 2, 4, 8 (a TP rank's contiguous units).

    Raises:
        ValueError: shapes, dtypes, devices, too many rows, a node without a pinned "few_rows" entry.
    """
    device = _check("unit_mm_few_rows", a_TK=a_TK, b_KN=b_KN)
    cfg = _config(node, device)
    (T, K), N = a_TK.shape, b_KN.shape[1]
    if num_units not in UNIT_COUNTS:
        raise ValueError(f"unit_mm_few_rows: num_units={num_units}; allowed: {list(UNIT_COUNTS)}")
    if b_KN.shape[0] != K or K % num_units:
        raise ValueError(
            f"unit_mm_few_rows: a {tuple(a_TK.shape)}, b {tuple(b_KN.shape)}; allowed: a.shape[1] == "
            f"b.shape[0], a multiple of num_units={num_units}"
        )
    if cfg["max_rows"] < T:
        raise ValueError(
            f"unit_mm_few_rows: {T} rows; allowed: at most {cfg['max_rows']} (more: h3lab.triton.unit_gemm.unit_mm)"
        )
    partials = torch.empty((num_units, T, N), dtype=torch.float32, device=device)
    if T and N:
        if K == 0:
            partials.zero_()
        else:
            grid = (configs.cdiv(N, cfg["BLOCK_N"]), num_units)
            _unit_partial_kernel[grid](
                a_TK,
                b_KN,
                partials,
                T,
                N,
                K // num_units,
                a_TK.stride(0),
                a_TK.stride(1),
                b_KN.stride(0),
                b_KN.stride(1),
                BLOCK_T=max(16, triton.next_power_of_2(T)),
                BLOCK_N=cfg["BLOCK_N"],
                BLOCK_K=cfg["BLOCK_K"],
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
                enable_fp_fusion=False,
            )
    return unit_tree(list(partials.unbind(0)))


def mm_few_k(a_KM: Tensor, b_KN: Tensor, out_dtype: torch.dtype = torch.float32, *, node: str | None = None) -> Tensor:
    """a^T @ b for a few K: [M, N], per element the chain of rounded products over k ascending, one rounding.

    Args:
        a_KM: [K, M] with K at most the pinned "max_k" (16 on sm90); bf16 or fp32, any strides.
        b_KN: [K, N].
        out_dtype: torch.bfloat16 or torch.float32.
    """
    device = _check("mm_few_k", a_KM=a_KM, b_KN=b_KN)
    cfg = _config(node, device)
    (K, M), N = a_KM.shape, b_KN.shape[1]
    if b_KN.shape[0] != K:
        raise ValueError(f"mm_few_k: a_KM {tuple(a_KM.shape)}, b_KN {tuple(b_KN.shape)}; allowed: the same K")
    if cfg["max_k"] < K:
        raise ValueError(f"mm_few_k: K={K}; allowed: at most {cfg['max_k']} (more: h3lab.triton.gemm.mm)")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"mm_few_k: out_dtype {out_dtype}; allowed: {list(OUT_DTYPES)}")
    c = torch.empty((M, N), dtype=out_dtype, device=device)
    if M and N:
        tile = (cfg["outer_BLOCK_M"], cfg["outer_BLOCK_N"], 1)  # K <= max_k: one step of k at a time
        launch_chain(a_KM, b_KN, c, tile, cfg["outer_num_warps"])
    return c


def variants(node: str) -> list[Variant]:
    """The unit partials (bf16 operands, at most 16 timesteps) and mm_few_k's chain kernel (bf16 out)."""
    cfg = configs.pinned("few_rows", node)
    types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "p_ptr": "*fp32"}
    const = {"BLOCK_T": 16, "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"]}
    out = [Variant("few_rows", "unit_mm_few_rows", _unit_partial_kernel, types, const, options(cfg))]
    types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16"}
    const = {"BLOCK_M": cfg["outer_BLOCK_M"], "BLOCK_N": cfg["outer_BLOCK_N"], "UNROLL": 1}
    opts = {"num_warps": cfg["outer_num_warps"], "enable_fp_fusion": False}
    out.append(Variant("few_rows", "mm_few_k", chain_kernel, types, const, opts))
    return out
