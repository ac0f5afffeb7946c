# Whole on purpose: one kernel, its jit helpers, its launcher and its builds read together.
"""Unit-tree GEMM: per-unit FP32 chains, then the contract's balanced tree, inside one kernel.

Reference: h3lab.ops.unit_gemm.unit_mm (chain_mm per unit, then h3lab.ops.fixed.unit_tree).
Launcher: `unit_mm`. Serves the row-parallel forwards (to_out, ff.net.2) and the column-parallel dX
(q,k,v; hidden,gate); d temb has its own few-row kernel (h3lab.triton.few_rows).

`pieces` = [(a [M, U*Kp], b [U*Kp, N]), ...] (1 to 3). Unit i is column block i of every piece's
a and row block i of its b. Its partial is ONE FP32 chain: pieces in order, within a piece chunks
of BLOCK_K ascending from the unit's first column; a unit's last chunk of a piece is masked at the
unit's end (Kp need not be a multiple of BLOCK_K: tiny has Kp = 32 and 432; real H3 has 896,
1792, 12096, multiples of 64). So unit i's partial is exactly `mm(a[:, unit i], b[unit i])` when
pieces = 1 and the tile configs match. Partials then meet in the tree, lower subtree first:
((u0+u1)+(u2+u3))+((u4+u5)+(u6+u7)) for 8. A TP rank holding units [j, j+n) calls this with its
slices and n units and gets exactly its subtree; the collective adds the rest in the same shape.

The tree is kept with a binary counter over the units (at most log2(U) pending left siblings):
level 0's pending sibling stays in registers (PENDING_IN_REGS; two accumulator tiles live), higher
levels go to a per-program FP32 scratch slot (BLOCK_M x BLOCK_N, L2-resident: 132 programs x 2
levels x 64 KB = 17 MB at 128x128) and come back for the add. The slot moves through TMA
(SCRATCH_TMA): with plain pointers Triton converts the MMA-layout accumulator through a second
register copy and spills at 128x128 (each build's registers and spills: reports/h200/gemm.json,
"resources", from python -m h3lab.bench.gemm_bench). All live tiles being FP32 and every add
IEEE, where a sibling waits cannot change a bit. U is a runtime argument:
one binary serves TP1 (8 units) down to TP8 (1 unit), so the subtree a rank computes is the same code.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from h3lab.triton import configs
from h3lab.triton.gemm import load_a, load_b, mac, store_tile, tile_coords
from h3lab.triton.gemm_host import (
    check_config,
    check_device,
    check_operand,
    grid_size,
    kernel_config,
    operand_a,
    operand_b,
    output_desc,
)
from h3lab.triton.variant import Variant, options

IMPLS = ("triton", "gluon")  # the same bits; gluon (unit_gemm_sm90) pipelines across unit boundaries
UNIT_COUNTS = (1, 2, 4, 8)  # subtrees of the 8-unit tree (TP 8, 4, 2, 1)
MAX_PIECES = 3  # q, k, v
LEVELS = 3  # log2(8): tree levels that can hold a pending left sibling
MAX_LEVELS = tl.constexpr(LEVELS)


@triton.jit
def _unit_chain(
    acc,
    piece,
    m0,
    n0,
    u,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_MODE: tl.constexpr,
    B_MODE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Continue `acc` over unit u's column block of one piece (a, a's descriptor, b, b's descriptor, the
    unit width KP, the (row, column) strides of a and b): chunks from the unit start, ascending."""
    a_ptr, a_desc, b_ptr, b_desc, KP, strides = piece
    a_strides, b_strides = strides
    k_lo = u * KP
    for kc in range(0, tl.cdiv(KP, BLOCK_K)):
        k0 = k_lo + kc * BLOCK_K
        a = load_a(a_ptr, a_desc, m0, k0, k_lo + KP, M, a_strides, BLOCK_M, BLOCK_K, A_MODE)
        b = load_b(b_ptr, b_desc, k0, n0, k_lo + KP, N, b_strides, BLOCK_K, BLOCK_N, B_MODE)
        acc = mac(a, b, acc, IEEE)
    return acc


@triton.jit
def _bulk_store_fence(x, ENABLED: tl.constexpr):
    """Make this program's earlier TMA stores visible to its later TMA loads.

    Triton waits for a bulk store only until shared memory has been read (`wait_group.read`), which
    frees the staging buffer but says nothing about the global write. Before reading a scratch slot
    back: wait for every bulk store to complete, meet at a CTA barrier, fence generic -> async proxy.
    The slot was written one unit's K loop earlier (>= 14 chunks), so the wait costs ~nothing.
    """
    if ENABLED:
        tl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
        )
        tl.debug_barrier()
        tl.inline_asm_elementwise(
            "fence.proxy.async.global;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _tree_insert(
    acc,
    pending,
    u,
    LOG2U,
    s_ptr,
    s_desc,
    slot0,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PENDING_IN_REGS: tl.constexpr,
    SCRATCH_TMA: tl.constexpr,
    FENCE: tl.constexpr,
):
    """Unit u's partial is in acc: place it in the tree (binary counter over the units).

    Unit u completes the level-l node u >> l when its low l bits are all ones; an even node waits as a
    left sibling, an odd one is added to its left sibling (left + right) and climbs. After the last
    unit the root (level LOG2U) is in acc. Level 0 waits in registers (PENDING_IN_REGS) or scratch.
    """
    FIRST: tl.constexpr = 1 if PENDING_IN_REGS else 0
    if PENDING_IN_REGS:  # noqa: SIM102  (constexpr, then a runtime branch)
        if LOG2U > 0:
            if (u & 1) == 0:
                pending = acc
            else:
                acc = pending + acc
    for lvl in tl.static_range(FIRST, MAX_LEVELS):
        low = (1 << lvl) - 1
        if ((u & low) == low) & (lvl < LOG2U):
            row = slot0 + (lvl - FIRST) * BLOCK_M
            if SCRATCH_TMA:  # through shared memory: no per-element addresses in registers
                if ((u >> lvl) & 1) == 0:
                    s_desc.store([row, 0], acc)
                else:
                    _bulk_store_fence(u, FENCE)
                    acc = s_desc.load([row, 0]) + acc
            else:  # pointers: Triton converts the MMA layout through registers (spills at 128x128)
                ptrs = s_ptr + (row + tl.arange(0, BLOCK_M))[:, None].to(tl.int64) * BLOCK_N
                ptrs += tl.arange(0, BLOCK_N)[None, :]
                tl.debug_barrier()  # written and read back by different threads of this program
                if ((u >> lvl) & 1) == 0:
                    tl.store(ptrs, acc)
                else:
                    acc = tl.load(ptrs) + acc
    return acc, pending


# One function on purpose: a jit kernel; its accumulators and tree state live across the persistent loop,
# and its signature is fixed (top-level descriptors and do_not_specialize arguments).
@triton.jit(do_not_specialize=["M", "N", "U", "LOG2U", "num_programs"])
def unit_mm_kernel(
    a0,
    ad0,
    b0,
    bd0,
    a1,
    ad1,
    b1,
    bd1,
    a2,
    ad2,
    b2,
    bd2,
    c_ptr,
    c_desc,
    s_ptr,
    s_desc,
    M,
    N,
    U,
    LOG2U,
    KP,
    num_programs,
    strides,
    c_strides,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PIECES: tl.constexpr,
    PENDING_IN_REGS: tl.constexpr,
    SCRATCH_TMA: tl.constexpr,
    FENCE: tl.constexpr,
    IEEE: tl.constexpr,
    OUT_TMA: tl.constexpr,
    SPLIT: tl.constexpr,
    MODES: tl.constexpr,
):
    # Piece i (i < PIECES) is a{i}, its descriptor ad{i}, b{i}, bd{i} (TensorDescriptors are top-level
    # arguments: Triton 3.6's launcher expands them nowhere else), unit width KP[i], (row, column)
    # strides of a and b strides[i] and load modes MODES[i] (A_MODE, B_MODE of gemm.load_a/load_b).
    # One function on purpose: the tile loop's per-unit accumulator, the tree's pending partials and
    # the pointer cursors of up to three pieces live across the whole persistent loop (a Triton
    # helper is inlined anyway).
    pieces = (
        (a0, ad0, b0, bd0, KP[0], strides[0]),
        (a1, ad1, b1, bd1, KP[1], strides[1]),
        (a2, ad2, b2, bd2, KP[2], strides[2]),
    )
    FIRST: tl.constexpr = 1 if PENDING_IN_REGS else 0  # lowest tree level kept in scratch
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    slot0 = pid * ((MAX_LEVELS - FIRST) * BLOCK_M)  # this program's scratch rows: one BLOCK_M slab per level
    for tile in range(pid, num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        pending = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # level-0 left sibling (registers)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Each piece's chunks of a unit are one software-pipelined loop; unit and piece boundaries
        # restart it (a hand-fused loop over all chunks measured worse in the sm90 IR: the chain's
        # reset at a unit start forces a full wgmma wait every chunk).
        for u in range(0, U):
            # unit u's partial: one chain over its column block of every piece, pieces in order
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(PIECES):
                acc = _unit_chain(
                    acc, pieces[i], m0, n0, u, M, N, BLOCK_M, BLOCK_N, BLOCK_K, MODES[i][0], MODES[i][1], IEEE
                )
            acc, pending = _tree_insert(
                acc, pending, u, LOG2U, s_ptr, s_desc, slot0, BLOCK_M, BLOCK_N, PENDING_IN_REGS, SCRATCH_TMA, FENCE
            )
        store_tile(c_ptr, c_desc, acc, m0, n0, M, N, c_strides, BLOCK_M, BLOCK_N, OUT_TMA, SPLIT)


def runs_gluon(
    pieces: Sequence[tuple[Tensor, Tensor]], num_units: int, cfg: dict[str, Any], device: torch.device
) -> bool:
    """Whether the Gluon kernel takes this call: "IMPL": "gluon", a compiled run (not the interpreter)
    and a call it supports (bf16, TMA-aligned, unit widths a multiple of 64); the rest run the Triton
    kernel, which gives the same bits. A call it takes must come with a config it can honour:
    unit_gemm_sm90.check_config raises otherwise (the config is checked only where it is used, so
    the pinned fp32 entry, which the Gluon kernel never runs, needs no Gluon tiles)."""
    if cfg.get("IMPL", "triton") != "gluon" or configs.interpreting():
        return False
    from h3lab.triton import unit_gemm_sm90  # Gluon (Hopper only): imported where it runs

    if unit_gemm_sm90.supports(pieces, num_units) is not None:
        return False
    unit_gemm_sm90.check_config(cfg, _capability(device))
    return True


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)  # once per device, not per call (runs_gluon is per GEMM)


def unit_mm(
    pieces: Sequence[tuple[Tensor, Tensor]],
    num_units: int,
    *,
    node: str | None = None,
    config: dict[str, Any] | None = None,
) -> Tensor:
    """FP32 [M, N]: per unit one chain over its blocks (pieces in order), then the balanced tree.

    Args:
        pieces: 1 to 3 pairs (a [M, U*Kp], b [U*Kp, N]), bf16 or fp32, any strides; Kp may differ
            between pieces. An fp32 operand anywhere makes every product IEEE FP32.
        num_units: U, one of 1, 2, 4, 8.
        node: node type whose pinned "unit_gemm" config runs (default: the operands' CUDA device's).
        config: an explicit configuration instead of the pinned one (benchmarks and tests only).

    With "IMPL": "gluon" (sm90) every call the Hopper kernel can take (bf16, TMA-aligned, unit widths
    a multiple of 64: h3lab.triton.unit_gemm_sm90.supports) runs there, the rest here; both give
    the same bits (tests/test_kernels_gemm.py compares them byte for byte on the GPU).

    Raises:
        ValueError: wrong unit count, piece count, rank, dtype, device or shapes; a node without
            a pinned "unit_gemm" entry; an unknown IMPL, or "gluon" on a device or with tiles it
            cannot run (unit_gemm_sm90.check_config).
    """
    pieces, M, N = _checked_pieces(pieces, num_units)
    device = check_device("unit_mm", *(t for p in pieces for t in p))
    ieee = any(t.dtype == torch.float32 for p in pieces for t in p)
    cfg = _unit_config(config, node, device, ieee)
    out_MN = torch.empty((M, N), dtype=torch.float32, device=device)
    if M == 0 or N == 0:
        return out_MN
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if runs_gluon(pieces, num_units, cfg, device):
        from h3lab.triton import unit_gemm_sm90

        grid = grid_size(device, configs.cdiv(M, BM) * configs.cdiv(N, BN))
        unit_gemm_sm90.launch(pieces, num_units, out_MN, grid, cfg)
        return out_MN
    _launch_triton(pieces, num_units, out_MN, cfg, ieee)
    return out_MN


def _checked_pieces(
    pieces: Sequence[tuple[Tensor, Tensor]], num_units: int
) -> tuple[list[tuple[Tensor, Tensor]], int, int]:
    """(the pieces as a list, M, N): U in UNIT_COUNTS, 1 to MAX_PIECES pieces, each operand checked,
    every a.shape[1] == b.shape[0] a multiple of U, one M and one N across the pieces."""
    if num_units not in UNIT_COUNTS:
        raise ValueError(f"unit_mm: num_units={num_units}; allowed: {list(UNIT_COUNTS)}")
    pieces = list(pieces)
    if not 1 <= len(pieces) <= MAX_PIECES:
        raise ValueError(f"unit_mm: {len(pieces)} pieces; allowed: 1 to {MAX_PIECES} (q, k, v)")
    for i, (a, b) in enumerate(pieces):
        check_operand("unit_mm", f"pieces[{i}].a", a)
        check_operand("unit_mm", f"pieces[{i}].b", b)
        if a.shape[1] != b.shape[0] or a.shape[1] % num_units:
            raise ValueError(
                f"unit_mm: pieces[{i}] a {tuple(a.shape)}, b {tuple(b.shape)}; allowed: a.shape[1] == b.shape[0], "
                f"a multiple of num_units={num_units}"
            )
    M, N = pieces[0][0].shape[0], pieces[0][1].shape[1]
    if any(a.shape[0] != M or b.shape[1] != N for a, b in pieces):
        shapes = [(tuple(a.shape), tuple(b.shape)) for a, b in pieces]
        raise ValueError(f"unit_mm: pieces {shapes}; allowed: every a with M={M} rows, every b with N={N} columns")
    return pieces, M, N


def _unit_config(config: dict[str, Any] | None, node: str | None, device: torch.device, ieee: bool) -> dict[str, Any]:
    """`config` checked, or the node's pinned "unit_gemm" entry; its IMPL one of IMPLS."""
    if config is not None:
        cfg = check_config("unit_mm", config, "unit_gemm")
    else:
        cfg = kernel_config("unit_gemm", node or configs.node_of(device), ieee)
    impl = cfg.get("IMPL", "triton")
    if impl not in IMPLS:
        raise ValueError(f"unit_mm config IMPL={impl!r}; allowed: {list(IMPLS)}")
    return cfg


def _piece_operands(
    pieces: list[tuple[Tensor, Tensor]], BM: int, BN: int, BK: int, tma: bool
) -> tuple[list[Any], list[tuple[tuple[int, int], tuple[int, int]]], list[tuple[int, int]]]:
    """unit_mm_kernel's per-piece arguments for MAX_PIECES slots: (a, a's descriptor, b, b's descriptor
    each), their (row, column) strides and load modes; an unused slot is None, zero strides, mode 0."""
    args: list[Any] = []
    strides: list[tuple[tuple[int, int], tuple[int, int]]] = []
    modes: list[tuple[int, int]] = []
    for i in range(MAX_PIECES):
        if i < len(pieces):
            a, b = pieces[i]
            (am, ad), (bm, bd) = operand_a(a, BM, BK, tma), operand_b(b, BK, BN, tma)
            args += [a, ad, b, bd]
            strides.append((a.stride(), b.stride()))
            modes.append((am, bm))
        else:
            args += [None, None, None, None]
            strides.append(((0, 0), (0, 0)))
            modes.append((0, 0))
    return args, strides, modes


def _scratch(
    grid: int, num_units: int, pending_in_regs: bool, cfg: dict[str, Any], device: torch.device
) -> tuple[Tensor, TensorDescriptor | None]:
    """The pending left siblings' FP32 scratch: one BM x BN slab per program and level kept there
    (one slab when U = 1), and its TMA descriptor when "SCRATCH_TMA" (the default)."""
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    levels = LEVELS - (1 if pending_in_regs else 0)
    scratch = torch.empty((grid * levels * BM if num_units > 1 else BM, BN), dtype=torch.float32, device=device)
    scratch_tma = bool(cfg.get("SCRATCH_TMA", True))
    s_desc = TensorDescriptor(scratch, list(scratch.shape), [BN, 1], [BM, BN]) if scratch_tma else None
    return scratch, s_desc


def _launch_triton(
    pieces: list[tuple[Tensor, Tensor]], num_units: int, out_MN: Tensor, cfg: dict[str, Any], ieee: bool
) -> None:
    """unit_mm_kernel into out_MN [M, N] (M, N > 0): a persistent grid, operands through TMA where
    every unit end falls on a chunk boundary."""
    (M, N), device = out_MN.shape, out_MN.device
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    kps = [a.shape[1] // num_units for a, _ in pieces]
    # TMA zero-fills only at a tensor's end: unit ends must fall on chunk boundaries to use it
    tma = cfg["TMA"] and all(kp % BK == 0 for kp in kps)
    args, strides, modes = _piece_operands(pieces, BM, BN, BK, tma)
    pending_in_regs = bool(cfg.get("PENDING_IN_REGS", True))
    grid = grid_size(device, configs.cdiv(M, BM) * configs.cdiv(N, BN))
    scratch, s_desc = _scratch(grid, num_units, pending_in_regs, cfg, device)
    out_tma, split, c_desc = output_desc(out_MN, BM, BN, cfg)
    unit_mm_kernel[(grid,)](
        *args,
        out_MN,
        c_desc,
        scratch,
        s_desc,
        M,
        N,
        num_units,
        num_units.bit_length() - 1,
        tuple(kps + [0] * (MAX_PIECES - len(kps))),
        grid,
        tuple(strides),
        out_MN.stride(),
        BLOCK_M=BM,
        BLOCK_N=BN,
        BLOCK_K=BK,
        GROUP_M=cfg["GROUP_M"],
        PIECES=len(pieces),
        PENDING_IN_REGS=pending_in_regs,
        IEEE=ieee,
        OUT_TMA=out_tma,
        SPLIT=split,
        FENCE=not configs.interpreting(),
        SCRATCH_TMA=s_desc is not None,
        MODES=tuple(modes),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        enable_fp_fusion=False,
    )


def variants(node: str) -> list[Variant]:
    """unit_mm_kernel (the Triton kernel; on sm90 it takes the calls the Gluon kernel cannot): one piece
    (to_out, ff.net.2: b = W.T) and three (q, k, v dX: b = W), bf16 through TMA; the fp32 entry."""
    out = []
    for ieee, pieces, b_mode in ((False, 1, 1), (False, 3, 2), (True, 1, 0)):
        cfg = kernel_config("unit_gemm", node, ieee)
        BM, BN, BK, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.get("EPILOGUE_SPLIT", 1)
        dt, tma = ("fp32", False) if ieee else ("bf16", bool(cfg["TMA"]))
        out_tma = bool(cfg.get("TMA_STORE")) and not ieee
        scratch_tma = bool(cfg.get("SCRATCH_TMA", True))
        types: dict[str, Any] = {"c_ptr": "*fp32", "s_ptr": "*fp32", "KP": ("i32",) * MAX_PIECES}
        types |= {"strides": ((("i32", "i32"),) * 2,) * MAX_PIECES, "c_strides": ("i32", "i32")}
        const: dict[str, Any] = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
        const |= {"PIECES": pieces, "PENDING_IN_REGS": bool(cfg.get("PENDING_IN_REGS", True))}
        const |= {"SCRATCH_TMA": scratch_tma, "FENCE": True, "IEEE": ieee, "OUT_TMA": out_tma}
        const |= {"SPLIT": split if out_tma else 1}
        modes = []
        for i in range(MAX_PIECES):
            used = i < pieces
            am, bm = (1 if tma else 0, b_mode if tma else 0) if used else (0, 0)
            modes.append((am, bm))
            if not used:
                types |= {f"a{i}": None, f"ad{i}": None, f"b{i}": None, f"bd{i}": None}
                continue
            types |= {f"a{i}": f"*{dt}", f"b{i}": f"*{dt}"}
            if tma:
                b_block = [BN, BK] if bm == 1 else [BK, BN]
                types |= {
                    f"ad{i}": f"tensordesc<bf16[{BM}, {BK}]>",
                    f"bd{i}": f"tensordesc<bf16[{b_block[0]}, {b_block[1]}]>",
                }
            else:
                types |= {f"ad{i}": None, f"bd{i}": None}
        const["MODES"] = tuple(modes)
        types["c_desc"] = f"tensordesc<fp32[{BM}, {BN // split}]>" if out_tma else None
        types["s_desc"] = f"tensordesc<fp32[{BM}, {BN}]>" if scratch_tma else None
        what = f"{dt}, {pieces} piece{'s' if pieces > 1 else ''}"
        out.append(Variant("unit_gemm", what, unit_mm_kernel, types, const, options(cfg)))
    return out
