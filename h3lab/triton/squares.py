"""Sums of squares for the clip's global norm: the row-block sums as one Triton kernel per tensor.

Reference: h3lab.ops.fixed.sum_of_squares, bit for bit. A tensor's elements in row-major order
(2-D views with any strides are read in that order), squared in FP32, in row blocks of ROW_BLOCK
elements (masked elements square to +0, the reference's padding); each block's sum is the
reference's `pair_sum` tree, built from exact halvings of the tile (h3lab.triton.norm._pair_sum),
never `tl.sum`'s own tree. The block sums of many tensors then meet in `pair_sum` (torch, IEEE
adds): tensors whose block counts pad to the same power of two are summed together, each padded
with +0 as `pair_sum` pads it alone, so the launches per norm are one per tensor plus a few per
width, not one per tree level and tensor.

Launcher: `sums_of_squares`. Dimension legend: R rows, C columns of a tensor viewed as 2-D.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.ops.fixed import ROW_BLOCK, pair_sum
from h3lab.triton import configs
from h3lab.triton.gemm import check_device
from h3lab.triton.norm import _pair_sum
from h3lab.triton.variant import Variant, options

F32 = torch.float32
IN_DTYPES = (torch.bfloat16, torch.float32)
_LOG2_ROW_BLOCK = ROW_BLOCK.bit_length() - 1
assert 1 << _LOG2_ROW_BLOCK == ROW_BLOCK, "ROW_BLOCK must be a power of two"


@triton.jit
def block_squares_kernel(
    x_ptr, out_ptr, n, C, s_r, s_c, NB, BPP: tl.constexpr, RB: tl.constexpr, LOG2_RB: tl.constexpr
):
    # out[b] = pair_sum of the squares of elements [b * RB, (b + 1) * RB) in row-major order
    b = tl.program_id(0).to(tl.int64) * BPP + tl.arange(0, BPP)
    i = b[:, None] * RB + tl.arange(0, RB)[None, :]
    mask = i < n
    x = tl.load(x_ptr + (i // C) * s_r + (i % C) * s_c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + b, _pair_sum(x * x, BPP, RB, LOG2_RB), mask=b < NB)


def _num_blocks(x: Tensor) -> int:
    return max(1, -(-x.numel() // ROW_BLOCK))


def _block_sums(x: Tensor, out: Tensor, cfg: dict) -> None:
    """out[:num_blocks(x)] = the row-block sums of x's squares (float32)."""
    x2 = x if x.dim() == 2 else x.reshape(1, -1)  # row-major order kept; a copy only where a view cannot
    nb, bpp = _num_blocks(x), cfg["blocks_per_program"]
    block_squares_kernel[(configs.cdiv(nb, bpp),)](
        x2,
        out,
        x2.numel(),
        max(x2.shape[1], 1),
        x2.stride(0),
        x2.stride(1),
        nb,
        BPP=bpp,
        RB=ROW_BLOCK,
        LOG2_RB=_LOG2_ROW_BLOCK,
        num_warps=cfg["num_warps"],
        enable_fp_fusion=False,
    )


def sums_of_squares(xs: Sequence[Tensor], *, node: str | None = None) -> Tensor:
    """[len(xs)] float32: `h3lab.ops.fixed.sum_of_squares` of each tensor, in order (module docstring).

    Raises:
        ValueError: no tensors, dtypes other than bf16 / fp32, tensors on several devices.
    """
    if not xs:
        raise ValueError("sums_of_squares: no tensors; allowed: one or more")
    for k, x in enumerate(xs):
        if not isinstance(x, Tensor) or x.dtype not in IN_DTYPES:
            got = getattr(x, "dtype", type(x).__name__)
            raise ValueError(f"sums_of_squares: tensor {k} is {got}; allowed: {list(IN_DTYPES)}")
    device = check_device("sums_of_squares", *xs)
    cfg = configs.pinned("squares", node or configs.node_of(device))
    by_width: dict[int, list[int]] = {}  # tensors whose block counts pad to the same power of two
    for k, x in enumerate(xs):
        by_width.setdefault(1 << (_num_blocks(x) - 1).bit_length(), []).append(k)
    sums, order = [], []
    for width, ks in by_width.items():
        grid = torch.zeros((len(ks), width), dtype=F32, device=device)  # +0 pads, as pair_sum pads
        for j, k in enumerate(ks):
            _block_sums(xs[k], grid[j], cfg)
        sums.append(pair_sum(grid))
        order += ks
    where = [0] * len(xs)
    for pos, k in enumerate(order):
        where[k] = pos
    return torch.cat(sums).index_select(0, torch.tensor(where, device=device))


def variants(node: str) -> list[Variant]:
    """The clip's row-block squares of a bf16 gradient."""
    cfg = configs.pinned("squares", node)
    types = {"x_ptr": "*bf16", "out_ptr": "*fp32"}
    const = {"BPP": cfg["blocks_per_program"], "RB": ROW_BLOCK, "LOG2_RB": ROW_BLOCK.bit_length() - 1}
    return [Variant("squares", "row blocks", block_squares_kernel, types, const, options(cfg, False))]
