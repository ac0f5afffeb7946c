"""Fixed-order GEMM: c = a @ b, FP32 accumulation over K in BLOCK_K chunks, ascending, one rounding.

Reference: h3lab.ops.gemm.mm (the torch backend's chains). Launcher: `mm`.

Why a row's bits never depend on M and a column's never on N: every output element is the chain
acc = dot(a[m, k0:k0+BK], b[k0:k0+BK, n]) + acc over k0 = 0, BK, 2*BK, ... with one pinned config
per node type (kernels/<node>.json): same BLOCK_K, same tensor-core instruction, no split-K, no
stream-K, no autotuning. M and N are not specialised (`do_not_specialize`), so one binary serves
every M and N. Rows past M and columns past N only ever feed their own (discarded) outputs; the
K tail is read as zeros, and a zero product added to a chain leaves it unchanged. Persistence (a
grid of one program per SM walking tiles in grouped order) only decides which SM computes a tile.

A row tail (the last M % BLOCK_M rows, a few) can ride on the full row tiles instead of taking row
tiles of its own (h3lab.triton.gemm_host.tail_operands, config keys TAIL_M/TAIL_N): the same chunks
in the same order, so the same bits; at M = 264 it turns two rounds of tiles into one for q, k, v,
hidden and gate.

Operands come through TMA tensor descriptors where their layout allows (16-byte aligned base and
strides, one unit stride) and through masked pointer loads otherwise; both feed the same dot with
the same values. bf16 x bf16 runs on the tensor cores (wgmma on sm90); an fp32 operand makes the
product an IEEE FP32 one (`input_precision="ieee"`, never TF32), with its own pinned tile shape.
The device helpers here (tile order, operand loads, the multiply-accumulate) are shared with the
unit-tree GEMM (h3lab.triton.unit_gemm); the host side (configurations, operand checks, TMA modes
and descriptors, grids) is h3lab.triton.gemm_host.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.triton import configs
from h3lab.triton.gemm_host import (
    OUT_DTYPES,
    check_config,
    check_device,
    check_operand,
    grid_size,
    kernel_config,
    operand_a,
    operand_b,
    output_desc,
    programs,
    tail_operands,
)
from h3lab.triton.variant import Variant, options

# ---- device helpers (shared with unit_gemm) ------------------------------------------------------


@triton.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row-tiles share a column-tile's b in L2 before moving on."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def load_a(
    a_ptr, a_desc, m0, k0, k_end, M, a_strides, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr
):
    """a[m0:m0+BM, k0:k0+BK]. MODE 1: TMA over [M, K]; 2: TMA over [K, M] (a^T rows); 0: pointers with
    a_strides (row, column).

    Pointer mode reads columns >= k_end as 0 (the K tail, or a unit's end in unit_gemm) and clamps
    rows past M to row 0 (valid memory; those rows only feed outputs that are never stored). TMA
    zero-fills past the tensor's end, which is the K tail; the launchers use TMA only where every
    chunk boundary they need is the tensor's end or a multiple of BLOCK_K.
    """
    if MODE == 1:
        tile = a_desc.load([m0, k0])
    elif MODE == 2:
        tile = a_desc.load([k0, m0]).T
    else:
        s_am, s_ak = a_strides
        rm = m0 + tl.arange(0, BLOCK_M)
        rm = tl.where(rm < M, rm, 0).to(tl.int64)
        rk = k0 + tl.arange(0, BLOCK_K)
        ptrs = a_ptr + rm[:, None] * s_am + rk[None, :].to(tl.int64) * s_ak
        tile = tl.load(ptrs, mask=rk[None, :] < k_end, other=0.0)
    return tile


@triton.jit
def load_b(
    b_ptr, b_desc, k0, n0, k_end, N, b_strides, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr
):
    """b[k0:k0+BK, n0:n0+BN]. MODE 1: TMA over [N, K] (a weight W with b = W.T); 2: TMA over [K, N]; 0:
    pointers with b_strides (row, column)."""
    if MODE == 1:
        tile = b_desc.load([n0, k0]).T
    elif MODE == 2:
        tile = b_desc.load([k0, n0])
    else:
        s_bk, s_bn = b_strides
        rn = n0 + tl.arange(0, BLOCK_N)
        rn = tl.where(rn < N, rn, 0).to(tl.int64)
        rk = k0 + tl.arange(0, BLOCK_K)
        ptrs = b_ptr + rk[:, None].to(tl.int64) * s_bk + rn[None, :] * s_bn
        tile = tl.load(ptrs, mask=rk[:, None] < k_end, other=0.0)
    return tile


@triton.jit
def mac(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b in FP32: tensor cores for bf16 x bf16; IEEE FP32 products when an operand is fp32."""
    if IEEE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def store_tile(
    c_ptr,
    c_desc,
    acc,
    m0,
    n0,
    M,
    N,
    c_strides,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUT_TMA: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The one rounding: FP32 accumulator -> c's dtype (round to nearest even), rows < M, columns < N.

    OUT_TMA: a bulk tensor store through shared memory in SPLIT column slices (the staging buffer of
    a 128x256 FP32 tile would be 128 KiB); TMA clips rows and columns past the end. Otherwise
    masked pointer stores straight from the accumulator's registers.
    """
    if OUT_TMA:
        if SPLIT == 2:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([m0, n0], left.to(c_ptr.dtype.element_ty))
            c_desc.store([m0, n0 + BLOCK_N // 2], right.to(c_ptr.dtype.element_ty))
        else:
            c_desc.store([m0, n0], acc.to(c_ptr.dtype.element_ty))
    else:
        s_cm, s_cn = c_strides
        rm = m0 + tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, BLOCK_N)
        ptrs = c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :].to(tl.int64) * s_cn
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


# ---- the kernel ----------------------------------------------------------------------------------


@triton.jit
def tail_chain(acc_t, a_tail_desc, w_tail_desc, m_tail, n_t, k0, IEEE: tl.constexpr):
    """acc_t [TAIL_N, TAIL_M] += W[n_t:+TAIL_N, k0:+BK] @ a[m_tail:+TAIL_M, k0:+BK]^T: the tail rows' chunk k0.

    Swapped (c^T = W a^T) so that the few tail rows are the tensor cores' N side (wgmma's M side is
    64, its N side may be 16) and the product stays an async wgmma beside the main one. The same
    products of the same chunk summed in the same order as the row tile's: the same bits (the tail's
    GPU test in tests/test_kernels_gemm.py compares them with rows of a 4111-row call). An unswapped
    16-row mma.sync tail would be synchronous, so slower.
    """
    a_sub = a_tail_desc.load([m_tail, k0])
    w_sub = w_tail_desc.load([n_t, k0])
    return mac(w_sub, a_sub.T, acc_t, IEEE)


# One function on purpose: a jit kernel; one tile loop holds both K chains and the epilogue's own tile counter,
# and its signature is fixed (top-level descriptors and do_not_specialize arguments).
@triton.jit(do_not_specialize=["M", "N", "num_programs"])
def mm_kernel(
    a_ptr,
    a_desc,
    b_ptr,
    b_desc,
    c_ptr,
    c_desc,
    a_tail_desc,
    w_tail_desc,
    M,
    N,
    K,
    strides,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_MODE: tl.constexpr,
    B_MODE: tl.constexpr,
    IEEE: tl.constexpr,
    OUT_TMA: tl.constexpr,
    SPLIT: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    TAIL: tl.constexpr,
    TAIL_M: tl.constexpr,
    TAIL_N: tl.constexpr,
):
    # TAIL: the last M % BLOCK_M (<= TAIL_M) rows get no row tile of their own; for each column tile,
    # the row tiles pid_m < BLOCK_N // TAIL_N each compute the tail rows of one TAIL_N-wide slice
    # of it (the host checks there are that many row tiles). At M = 264 on 64x256 tiles: 112 tiles
    # in one round instead of 140 in two, each 1/16 more products (python -m h3lab.bench.gemm_bench).
    # strides: (row, column) of a, b and c
    a_strides, b_strides, c_strides = strides
    if TAIL:
        num_pid_m = M // BLOCK_M
    else:
        num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_chunks = tl.cdiv(K, BLOCK_K)
    # the epilogue keeps its own tile counter so a flattened loop's prologue and epilogue share no value
    tile_c = tl.program_id(0) - num_programs
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if TAIL and pid_m < BLOCK_N // TAIL_N:  # this tile also carries a slice of the tail rows
            m_tail = num_pid_m * BLOCK_M
            n_t = n0 + pid_m * TAIL_N
            acc_t = tl.zeros((TAIL_N, TAIL_M), dtype=tl.float32)
            for kc in tl.range(0, k_chunks):  # ascending K, never split: both chains
                k0 = kc * BLOCK_K
                a = load_a(a_ptr, a_desc, m0, k0, K, M, a_strides, BLOCK_M, BLOCK_K, A_MODE)
                b = load_b(b_ptr, b_desc, k0, n0, K, N, b_strides, BLOCK_K, BLOCK_N, B_MODE)
                acc = mac(a, b, acc, IEEE)
                acc_t = tail_chain(acc_t, a_tail_desc, w_tail_desc, m_tail, n_t, k0, IEEE)
            rn = n_t + tl.arange(0, TAIL_N)
            rt = m_tail + tl.arange(0, TAIL_M)
            s_cm, s_cn = c_strides
            ptrs = c_ptr + rn[:, None].to(tl.int64) * s_cn + rt[None, :].to(tl.int64) * s_cm  # acc_t is c^T
            tl.store(ptrs, acc_t.to(c_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rt[None, :] < M))
        else:
            for kc in tl.range(0, k_chunks, warp_specialize=WARP_SPECIALIZE):  # ascending K, never split
                k0 = kc * BLOCK_K
                a = load_a(a_ptr, a_desc, m0, k0, K, M, a_strides, BLOCK_M, BLOCK_K, A_MODE)
                b = load_b(b_ptr, b_desc, k0, n0, K, N, b_strides, BLOCK_K, BLOCK_N, B_MODE)
                acc = mac(a, b, acc, IEEE)
        tile_c += num_programs
        pid_m, pid_n = tile_coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        store_tile(c_ptr, c_desc, acc, m0, n0, M, N, c_strides, BLOCK_M, BLOCK_N, OUT_TMA, SPLIT)


# ---- the launcher --------------------------------------------------------------------------------


def mm(
    a_MK: Tensor,
    b_KN: Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    node: str | None = None,
    config: dict[str, Any] | None = None,
) -> Tensor:
    """a @ b: FP32 chains over K in BLOCK_K chunks, ascending, rounded once to `out_dtype`.

    Args:
        a_MK, b_KN: bf16 or fp32, any strides (b is usually a weight's transposed view W.T).
        out_dtype: torch.bfloat16 or torch.float32.
        node: node type whose pinned config runs (default: that of the operands' CUDA device).
        config: an explicit configuration instead of the pinned one (benchmarks and tests only).

    Raises:
        ValueError: wrong rank, dtype, device or shapes; a node without a pinned "gemm" entry.
    """
    device = _check_mm(a_MK, b_KN, out_dtype)
    ieee = torch.float32 in (a_MK.dtype, b_KN.dtype)
    if config is not None:
        cfg = check_config("mm", config, "gemm")
    else:
        cfg = kernel_config("gemm", node or configs.node_of(device), ieee, rows=a_MK.shape[0])
    (M, K), N = a_MK.shape, b_KN.shape[1]
    c_MN = torch.empty((M, N), dtype=out_dtype, device=device)
    if M == 0 or N == 0:
        return c_MN
    if K == 0:
        return c_MN.zero_()  # the empty chain
    _launch(a_MK, b_KN, c_MN, cfg, ieee)
    return c_MN


def _check_mm(a_MK: Tensor, b_KN: Tensor, out_dtype: torch.dtype) -> torch.device:
    """The operands' one device, after checking their rank and dtype, a.shape[1] == b.shape[0] and
    out_dtype in OUT_DTYPES."""
    check_operand("mm", "a_MK", a_MK)
    check_operand("mm", "b_KN", b_KN)
    device = check_device("mm", a_MK, b_KN)
    if a_MK.shape[1] != b_KN.shape[0]:
        raise ValueError(
            f"mm: a_MK {tuple(a_MK.shape)} and b_KN {tuple(b_KN.shape)}; allowed: a.shape[1] == b.shape[0]"
        )
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"mm: out_dtype {out_dtype}; allowed: {list(OUT_DTYPES)}")
    return device


def _launch(a_MK: Tensor, b_KN: Tensor, c_MN: Tensor, cfg: dict[str, Any], ieee: bool) -> None:
    """mm_kernel into c_MN (M, N, K > 0): a persistent grid over the row tiles (the full ones only
    when a row tail rides on them) and the column tiles."""
    (M, K), N, device = a_MK.shape, b_KN.shape[1], c_MN.device
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_mode, a_desc = operand_a(a_MK, BM, BK, cfg["TMA"])
    b_mode, b_desc = operand_b(b_KN, BK, BN, cfg["TMA"])
    out_tma, split, c_desc = output_desc(c_MN, BM, BN, cfg)
    tail_m, tail_n, a_tail, w_tail = tail_operands(a_MK, b_KN, a_mode, b_mode, cfg, programs(device), c_MN.dtype)
    grid = grid_size(device, (M // BM if a_tail is not None else configs.cdiv(M, BM)) * configs.cdiv(N, BN))
    mm_kernel[(grid,)](
        a_MK,
        a_desc,
        b_KN,
        b_desc,
        c_MN,
        c_desc,
        a_tail,
        w_tail,
        M,
        N,
        K,
        (a_MK.stride(), b_KN.stride(), c_MN.stride()),
        grid,
        BLOCK_M=BM,
        BLOCK_N=BN,
        BLOCK_K=BK,
        GROUP_M=cfg["GROUP_M"],
        A_MODE=a_mode,
        B_MODE=b_mode,
        IEEE=ieee,
        OUT_TMA=out_tma,
        SPLIT=split,
        FLATTEN=cfg.get("FLATTEN", False),
        WARP_SPECIALIZE=cfg.get("WARP_SPECIALIZE", False),
        TAIL=a_tail is not None,
        TAIL_M=tail_m,
        TAIL_N=tail_n,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        enable_fp_fusion=False,
    )


# ---- the builds compile_pinned compiles ----------------------------------------------------------

STRIDES = (("i32", "i32"),) * 3  # mm_kernel's strides: (row, column) of a, b, c


def variants(node: str) -> list[Variant]:
    """mm_kernel: every row bucket at its bf16 TMA form (a [M, K], b = W.T, bf16 out), and the fp32 entry."""
    buckets = configs.pinned("gemm", node).get("by_rows", [{"max_rows": None}])
    out = []
    for bucket in buckets:
        rows = bucket["max_rows"] or 4096
        cfg = kernel_config("gemm", node, False, rows=rows)
        BM, BN, BK, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.get("EPILOGUE_SPLIT", 1)
        types: dict[str, Any] = {f"{x}_ptr": "*bf16" for x in "abc"} | {"strides": STRIDES}
        types |= {
            "a_desc": f"tensordesc<bf16[{BM}, {BK}]>",
            "b_desc": f"tensordesc<bf16[{BN}, {BK}]>",
            "c_desc": f"tensordesc<bf16[{BM}, {BN // split}]>",
        }
        const = _mm_const(cfg, a_mode=1, b_mode=1, ieee=False, out_tma=bool(cfg.get("TMA_STORE")), split=split)
        if "TAIL_M" in cfg:
            types |= {
                "a_tail_desc": f"tensordesc<bf16[{cfg['TAIL_M']}, {BK}]>",
                "w_tail_desc": f"tensordesc<bf16[{cfg['TAIL_N']}, {BK}]>",
            }
            const |= {"TAIL": True, "TAIL_M": cfg["TAIL_M"], "TAIL_N": cfg["TAIL_N"]}
        else:
            types |= {"a_tail_desc": None, "w_tail_desc": None}
        out.append(Variant("gemm", f"bf16, rows <= {bucket['max_rows']}", mm_kernel, types, const, options(cfg)))
    cfg = kernel_config("gemm", node, True)
    const = _mm_const(cfg, a_mode=0, b_mode=0, ieee=True, out_tma=False, split=1)
    types = {f"{x}_ptr": "*fp32" for x in "abc"} | {"strides": STRIDES}
    types |= dict.fromkeys(("a_desc", "b_desc", "c_desc", "a_tail_desc", "w_tail_desc"), None)
    out.append(Variant("gemm", "fp32", mm_kernel, types, const, options(cfg)))
    return out


def _mm_const(cfg: dict[str, Any], *, a_mode: int, b_mode: int, ieee: bool, out_tma: bool, split: int) -> dict:
    tiles = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
    flags = {"FLATTEN": cfg.get("FLATTEN", False), "WARP_SPECIALIZE": cfg.get("WARP_SPECIALIZE", False)}
    modes = {"A_MODE": a_mode, "B_MODE": b_mode, "IEEE": ieee, "OUT_TMA": out_tma, "SPLIT": split}
    return tiles | flags | modes | {"TAIL": False, "TAIL_M": 1, "TAIL_N": 1}
