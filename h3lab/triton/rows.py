"""Cross-row reductions in logical-key order as Triton kernels: row_sum, segment_sum, row_mm.

Reference: h3lab.ops.rows. `order` holds the int64 indices of the active rows in canonical key
order (h3lab.ops.rows.key_order). row_sum and segment_sum are one left-to-right FP32 chain per
column, acc = ((0 + x[o0]) + x[o1]) + ..., a program per (segment, column block) walking its rows
in order: plain FP32 adds in the reference's order, so the bits are the reference's on any device
and depend on neither the column block nor the unroll (rows past the end add +0, which never
changes a chain that starts at +0: such a chain is never -0). row_mm gathers the rows into key order
and hands the reduction to the GEMM (K = rows, ascending), whose bits are its own. The index checks
and segment layouts the launchers need come from the step's row plan (h3lab.rowplan).

Dimension legend: R rows (any order, padding included), N/K columns, G segments (AdaLN table rows).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab import rowplan
from h3lab.triton import configs, gemm
from h3lab.triton.variant import Variant

F32 = torch.float32
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


MAX_CHAINS = 6  # chain sets one launch takes: the block's largest group (3 row sums + 3 segment sums)


@triton.jit
def _chain(chain_set, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr):
    # chain g (this program's) runs over rows[starts[g] : starts[g + 1]] in that order
    x_ptr, rows_ptr, starts_ptr, out_ptr, N, sx, G = chain_set
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if g < G and tl.program_id(1) * BLOCK_N < N:  # the grid covers the largest set of the launch
        start = tl.load(starts_ptr + g)
        end = tl.load(starts_ptr + g + 1)
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for i0 in range(start, end, UNROLL):
            for j in tl.static_range(UNROLL):  # UNROLL independent loads in flight; the adds stay in order
                r = tl.load(rows_ptr + tl.minimum(i0 + j, end - 1))  # past the end: a valid row, fully masked
                width = tl.where(i0 + j < end, N, 0)
                acc += tl.load(x_ptr + r * sx + cols, mask=cols < width, other=0.0).to(tl.float32)
        tl.store(out_ptr + g.to(tl.int64) * N + cols, acc, mask=cols < N)


@triton.jit
def _row_chain_kernel(sets, NUM: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr):
    # MAX_CHAINS chain sets (x, rows, starts, out, N, row stride, G), NUM of them independent in one
    # launch, program_id(2) picking the set: a chain is serial over rows, so one set keeps few loads in
    # flight (latency-bound: python -m h3lab.bench.rows_bench); sets side by side add theirs up
    w = tl.program_id(2)
    for i in tl.static_range(NUM):  # sets past NUM are not compiled
        if w == i:
            _chain(sets[i], BLOCK_N, UNROLL)


def _check(x: Tensor, order: Tensor, *extra: Tensor) -> None:
    if x.dim() < 1:
        raise ValueError(f"x: shape {tuple(x.shape)}; allowed: [R, ...] with at least one dim")
    if order.dim() != 1 or order.dtype != torch.int64:
        raise ValueError(f"order: {order.dtype} {tuple(order.shape)}; allowed: 1-D torch.int64 row indices")
    devices = {t.device for t in (x, order, *extra)}
    if len(devices) != 1:
        raise ValueError(f"operands on {sorted(map(str, devices))}; allowed: one device")
    device = x.device
    if device.type != "cuda" and not configs.interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors, got {device}; allowed: cuda (or TRITON_INTERPRET=1)")


def _chains(x: Tensor, rows: Tensor, starts: Tensor, node: str | None) -> Tensor:
    """FP32 [G, N]: chain g over x[rows[starts[g]:starts[g+1]]] per column, x viewed as [R, N]."""
    return _chain_sets([(x, rows, starts)], node)[0]


def _chain_sets(sets: list[tuple[Tensor, Tensor, Tensor]], node: str | None) -> list[Tensor]:
    """`_chains` of each (x, rows, starts), MAX_CHAINS sets per launch: the bits of one launch each."""
    outs, args = [], []
    for x, rows, starts in sets:
        if x.dtype not in IN_DTYPES:
            raise ValueError(f"x: dtype {x.dtype} not supported; allowed: {list(IN_DTYPES)}")
        x2 = x.reshape(x.shape[0], math.prod(x.shape[1:]))  # not -1: R may be 0
        x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
        G, N = starts.numel() - 1, x2.shape[1]
        out = torch.empty((G, N), dtype=F32, device=x.device)
        outs.append(out)
        if G and N:
            args.append((x2, rows, starts, out, N, x2.stride(0), G))
    if args:
        device = args[0][0].device
        cfg = configs.pinned("rows", node if node is not None else configs.node_of(device))
        for i in range(0, len(args), MAX_CHAINS):
            batch = args[i : i + MAX_CHAINS]
            grid = (max(a[6] for a in batch), max(configs.cdiv(a[4], cfg["block_n"]) for a in batch), len(batch))
            sets = tuple(batch + [batch[0]] * (MAX_CHAINS - len(batch)))  # unused sets: never read
            _row_chain_kernel[grid](
                sets, NUM=len(batch), BLOCK_N=cfg["block_n"], UNROLL=cfg["unroll"], num_warps=cfg["num_warps"]
            )
    return outs


def row_sum(x_RN: Tensor, order: Tensor, *, node: str | None = None) -> Tensor:
    """Sum over the rows in `order` of x[r], one FP32 chain per column: [N...] float32."""
    _check(x_RN, order)
    rowplan.check_bounds("order", order, x_RN.shape[0])
    # [0, n] made on the device: torch.tensor(list, device=cuda) would copy from pageable memory, a host sync
    starts = torch.arange(2, dtype=torch.int64, device=x_RN.device) * order.numel()  # one kernel build
    return _chains(x_RN, order, starts, node).reshape(x_RN.shape[1:])


def segment_sum(
    x_RN: Tensor, segment_R: Tensor, num_segments: int, order: Tensor, *, node: str | None = None
) -> Tensor:
    """Per segment g, the chain over its rows in `order`: [G, N...] float32 (empty segments are 0)."""
    _check(x_RN, order, segment_R)
    rows, starts = rowplan.segment_layout(segment_R, num_segments, order, x_RN.shape[0])
    return _chains(x_RN, rows, starts, node).reshape(num_segments, *x_RN.shape[1:])


def chain_sums(
    row_xs: list[Tensor],
    segment_xs: list[Tensor],
    segment_R: Tensor,
    num_segments: int,
    order: Tensor,
    *,
    node: str | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """`row_sum` of each of row_xs and `segment_sum` of each of segment_xs (one segment_R for all), up to
    MAX_CHAINS sets per launch: each chain the same adds in the same order as alone, so the same bits;
    side by side the sets keep more loads in flight than one alone, which is latency-bound
    (python -m h3lab.bench.rows_bench)."""
    for x in (*row_xs, *segment_xs):
        _check(x, order, segment_R)
        rowplan.check_bounds("order", order, x.shape[0])
    sets = []
    if row_xs:
        starts = torch.arange(2, dtype=torch.int64, device=order.device) * order.numel()
        sets += [(x, order, starts) for x in row_xs]
    if segment_xs:
        R = segment_xs[0].shape[0]
        if any(x.shape[0] != R for x in segment_xs):
            raise ValueError(f"segment_xs: rows {[x.shape[0] for x in segment_xs]}; allowed: all {R} (one segment_R)")
        seg_rows, seg_starts = rowplan.segment_layout(segment_R, num_segments, order, R)
        sets += [(x, seg_rows, seg_starts) for x in segment_xs]
    outs = _chain_sets(sets, node)
    sums = [o.reshape(x.shape[1:]) for o, x in zip(outs, row_xs, strict=False)]
    segs = [o.reshape(num_segments, *x.shape[1:]) for o, x in zip(outs[len(row_xs) :], segment_xs, strict=True)]
    return sums, segs


def _take(x: Tensor, order: Tensor) -> Tensor:
    # rows already in canonical order are used in place (no gather), as the reference does
    if rowplan.reads_in_place(order.numel(), x.shape[0], lambda: rowplan.index_facts(order)):
        return x
    return x.index_select(0, order)


def row_mm(
    a_RN: Tensor, b_RK: Tensor, order: Tensor, out_dtype: torch.dtype = F32, *, node: str | None = None
) -> Tensor:
    """sum over rows r in `order` of a[r]^T b[r]: [N, K], by the GEMM over the rows in key order; the
    GEMM's epilogue rounds once to `out_dtype` (the same bits as rounding its FP32 result afterwards)."""
    _check(a_RN, order, b_RK)
    if a_RN.dim() != 2 or b_RK.dim() != 2 or a_RN.shape[0] != b_RK.shape[0]:
        raise ValueError(f"row_mm: shapes {tuple(a_RN.shape)}, {tuple(b_RK.shape)}; allowed: [R, N], [R, K]")
    rowplan.check_bounds("order", order, a_RN.shape[0])
    if order.numel() == 0:  # no active row: the empty sum (the GEMM is not asked for K = 0)
        return torch.zeros((a_RN.shape[1], b_RK.shape[1]), dtype=out_dtype, device=a_RN.device)
    return gemm.mm(_take(a_RN, order).t(), _take(b_RK, order), out_dtype, node=node)


def variants(node: str) -> list[Variant]:
    """One chain set, and the largest group the block hands to chain_sums (MAX_CHAINS)."""
    cfg = configs.pinned("rows", node)
    out = []
    chain_set = ("*bf16", "*i64", "*i64", "*fp32", "i32", "i32", "i32")  # x, rows, starts, out, N, stride, G
    for num in (1, MAX_CHAINS):
        types = {"sets": (chain_set,) * MAX_CHAINS}
        const = {"NUM": num, "BLOCK_N": cfg["block_n"], "UNROLL": cfg["unroll"]}
        what = f"{num} chain set{'s' if num > 1 else ''}"
        out.append(Variant("rows", what, _row_chain_kernel, types, const, {"num_warps": cfg["num_warps"]}))
    return out
