"""Sums of squares for the clip's global norm: the row-block sums of many tensors in one Triton launch.

Reference: h3lab.ops.squares.sum_of_squares, bit for bit. A tensor's elements in row-major order
(2-D views with any strides are read in that order), squared in FP32, in row blocks of ROW_BLOCK
elements (masked elements square to +0, the reference's padding); each block's sum is the
reference's `pair_sum` tree, built from exact halvings of the tile (h3lab.triton.norm._pair_sum),
never `tl.sum`'s own tree. A block's sum depends on its elements alone, so which program computes
it changes no bit: one launch per dtype covers every tensor (a table of their addresses, sizes and
strides; each program finds its tensor by a binary search over the programs' starts), where one
launch per tensor cost a model's clip hundreds of launches. The block sums of many tensors then
meet in `pair_sum` (torch, IEEE adds): tensors whose block counts pad to the same power of two are
summed together, each padded with +0 as `pair_sum` pads it alone.

Launcher: `sums_of_squares`. Dimension legend: R rows, C columns of a tensor viewed as 2-D.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.host import to_device
from h3lab.ops.fixed import pair_sum
from h3lab.ops.squares import ROW_BLOCK
from h3lab.triton import configs
from h3lab.triton.gemm_host import check_device
from h3lab.triton.norm import _pair_sum
from h3lab.triton.tables import program_tensor, search_steps
from h3lab.triton.variant import Variant, options

F32 = torch.float32
IN_DTYPES = (torch.bfloat16, torch.float32)
_LOG2_ROW_BLOCK = ROW_BLOCK.bit_length() - 1
assert 1 << _LOG2_ROW_BLOCK == ROW_BLOCK, "ROW_BLOCK must be a power of two"


TABLE = ("address", "n", "C", "s_r", "s_c", "NB", "out")  # one int64 row per tensor


@triton.jit
def block_squares_kernel(
    table_ptr,
    starts_ptr,
    out_ptr,
    T,
    DTYPE: tl.constexpr,
    SEARCH: tl.constexpr,
    BPP: tl.constexpr,
    RB: tl.constexpr,
    LOG2_RB: tl.constexpr,
):
    # tensor t's programs are [starts[t], starts[t + 1]); its table row (TABLE) says where it is and
    # where its NB block sums go: out[row.out + b] = pair_sum of the squares of its elements
    # [b * RB, (b + 1) * RB) in row-major order
    lo, q = program_tensor(starts_ptr, T, SEARCH)
    row = table_ptr + lo * 7
    x_ptr = tl.load(row).to(tl.pointer_type(DTYPE))
    n, C, s_r, s_c = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
    NB, out = tl.load(row + 5), tl.load(row + 6)
    b = q * BPP + tl.arange(0, BPP)
    i = b[:, None] * RB + tl.arange(0, RB)[None, :]
    if (s_c == 1) & (s_r == C):  # rows back to back: element i at offset i, no integer division
        x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + (i // C) * s_r + (i % C) * s_c, mask=i < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + out + b, _pair_sum(x * x, BPP, RB, LOG2_RB), mask=b < NB)


def _num_blocks(x: Tensor) -> int:
    return max(1, -(-x.numel() // ROW_BLOCK))


def _block_sums(xs: list[Tensor], offsets: list[int], out: Tensor, cfg: dict) -> None:
    """out[offsets[k] : offsets[k] + num_blocks(xs[k])] = the row-block sums of xs[k]'s squares, for
    tensors of one dtype, in one launch."""
    views = [x if x.dim() == 2 else x.reshape(1, -1) for x in xs]  # row-major order; a copy only where needed
    bpp, rows, starts = cfg["blocks_per_program"], [], [0]
    for x2, off in zip(views, offsets, strict=True):
        nb = _num_blocks(x2)
        rows.append([x2.data_ptr(), x2.numel(), max(x2.shape[1], 1), x2.stride(0), x2.stride(1), nb, off])
        starts.append(starts[-1] + configs.cdiv(nb, bpp))
    table, programs = to_device(rows, torch.int64, out.device), to_device(starts, torch.int64, out.device)
    dtype = tl.bfloat16 if xs[0].dtype == torch.bfloat16 else tl.float32
    block_squares_kernel[(starts[-1],)](
        table,
        programs,
        out,
        len(views),
        DTYPE=dtype,
        SEARCH=search_steps(len(views)),
        BPP=bpp,
        RB=ROW_BLOCK,
        LOG2_RB=_LOG2_ROW_BLOCK,
        num_warps=cfg["num_warps"],
        enable_fp_fusion=False,
    )
    # `views` (copies of non-2-D tensors among them) lived until the launch was queued: stream order
    # keeps their memory from reuse until the kernel has read it


def sums_of_squares(xs: Sequence[Tensor], *, node: str | None = None) -> Tensor:
    """[len(xs)] float32: `h3lab.ops.squares.sum_of_squares` of each tensor, in order (module docstring).

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
    grids, order, offsets, base = [], [], {}, 0
    for width, ks in by_width.items():
        grids.append((base, len(ks), width))
        for j, k in enumerate(ks):
            offsets[k] = base + j * width
        base += len(ks) * width
        order += ks
    flat = torch.zeros(base, dtype=F32, device=device)  # +0 pads, as pair_sum pads
    for dtype in IN_DTYPES:
        ks = [k for k in range(len(xs)) if xs[k].dtype == dtype]
        if ks:
            _block_sums([xs[k] for k in ks], [offsets[k] for k in ks], flat, cfg)
    sums = [pair_sum(flat[b : b + n * w].view(n, w)) for b, n, w in grids]
    where = [0] * len(xs)
    for pos, k in enumerate(order):
        where[k] = pos
    return torch.cat(sums).index_select(0, to_device(where, torch.int64, device))


def variants(node: str) -> list[Variant]:
    """The clip's row-block squares of bf16 and of FP32 gradients (a model's ~500 pieces: SEARCH 9)."""
    cfg = configs.pinned("squares", node)
    types = {"table_ptr": "*i64", "starts_ptr": "*i64", "out_ptr": "*fp32"}
    const = {"BPP": cfg["blocks_per_program"], "RB": ROW_BLOCK, "LOG2_RB": ROW_BLOCK.bit_length() - 1, "SEARCH": 9}
    return [
        Variant(
            "squares", f"row blocks, {name}", block_squares_kernel, types, const | {"DTYPE": dt}, options(cfg, False)
        )
        for name, dt in (("bf16", tl.bfloat16), ("fp32", tl.float32))
    ]
