# Whole on purpose: one Gluon kernel, its pipeline helpers, its launch and its builds read together.
"""Unit-tree GEMM for Hopper in Gluon: the bits of `unit_gemm.unit_mm_kernel`, one pipeline across units.

Reference: h3lab.triton.unit_gemm.unit_mm_kernel (Triton, runs in the interpreter too), and behind
it h3lab.ops.unit_gemm.unit_mm. Launcher: h3lab.triton.unit_gemm.unit_mm, when the
pinned config says "IMPL": "gluon" and the operands allow TMA (see `supports`).

Why a second kernel. The Triton kernel computes each unit's chain in its own software-pipelined
loop, so at each of the 8 unit boundaries its loads drain and restart. Triton's pipeliner gives up
on one loop over all chunks (the tree insert reads the accumulator, so every wgmma is waited for and
no load runs ahead). Here the pipeline is written out: a producer cursor issues the TMA loads
STAGES-1 chunks ahead of the wgmma that consumes them, through unit and tile boundaries; only the
accumulator waits at a unit's end. The cursors move by increments, never by dividing a flat index
(its divisions cost about as many issue cycles per chunk as its wgmma). Tried and left out: the tree
under a branch inside one loop over all chunks, and two accumulators per unit pair (register
pressure); `python -m h3lab.bench.gemm_bench` measures the kernels against cuBLAS.

Same bits, by construction: per unit the same chain (acc = +0, then wgmma m64nBNk16 over 64-wide
chunks, pieces in order, chunks ascending; BLOCK_K 64 = 4 k16 steps, as Triton lowers tl.dot), the
same tree ((u0+u1)+(u2+u3))+((u4+u5)+(u6+u7)) with the same IEEE FP32 adds, and the same FP32
output. Where a pending sibling waits (registers, shared memory, L2) moves no bit. Checked byte for
byte against the Triton kernel on the GPU (tests/test_kernels_gemm.py, h3lab.bench.gemm_bench) and
through the golden digests of the whole block.

Pending left siblings: level 0 in registers, level 1 in shared memory (its slot also stages the
tile's FP32 output for the TMA store), level 2 in shared memory (LVL2_SMEM, STAGES <= 3: 3 x 32 KiB
+ 2 x 64 KiB = 224 KiB of the H200's 227) or in a per-program L2 slab written and read back by the
same threads (4 stages). The binary counter over units is that of unit_gemm._tree_insert.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from h3lab.triton import configs
from h3lab.triton.gemm import tile_coords  # a scalar-only @triton.jit, callable from Gluon
from h3lab.triton.gemm_host import a_mode, b_mode
from h3lab.triton.variant import Variant

# Triton 3.6 (torch 2.11's) names the TMA copies async_copy_global_to_shared / _shared_to_global
# and the CTA barrier thread_barrier; 3.9 renamed them async_load / async_store (the old names
# raise) and barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.6: thread_barrier; 3.9: barrier

BLOCK_K = 64  # the K chunk: the contract's chain order, the Triton kernel's pinned BLOCK_K
BK = gl.constexpr(BLOCK_K)  # the same, as the kernels see it


@gluon.jit
def _issue(prod, chunks, kps, descs, smem, PIECES: gl.constexpr, B_KN: gl.constexpr):
    """TMA loads of the producer cursor's chunk, chunk q of unit u (pieces in order) of the tile at
    (m0, n0), into its stage s. chunks: (CH0, CH1, CHU) per unit; kps: the pieces' unit widths."""
    s, q, u, _, m0, n0 = prod
    CH0, CH1, _ = chunks
    KP0, KP1, KP2 = kps
    ad0, bd0, ad1, bd1, ad2, bd2 = descs
    a_bufs, b_bufs, bars = smem
    bar = bars.index(s)
    mbarrier.expect(bar, ad0.block_type.nbytes + bd0.block_type.nbytes)
    a_s = a_bufs.index(s)
    b_s = b_bufs.index(s)
    if q < CH0:
        _load_piece(ad0, bd0, u * KP0 + q * BK, m0, n0, bar, a_s, b_s, B_KN)
    if PIECES > 1:  # noqa: SIM102  (constexpr, then a runtime branch)
        if (q >= CH0) & (q < CH0 + CH1):
            _load_piece(ad1, bd1, u * KP1 + (q - CH0) * BK, m0, n0, bar, a_s, b_s, B_KN)
    if PIECES > 2:  # noqa: SIM102
        if q >= CH0 + CH1:
            _load_piece(ad2, bd2, u * KP2 + (q - CH0 - CH1) * BK, m0, n0, bar, a_s, b_s, B_KN)


@gluon.jit
def _load_piece(ad, bd, k, m0, n0, bar, a_s, b_s, B_KN: gl.constexpr):
    """One piece's chunk at column k: a [BM, BK] and b (as [BK, BN] rows or W's [BN, BK])."""
    _tma_load(ad, [m0, k], bar, a_s)
    if B_KN:
        _tma_load(bd, [k, n0], bar, b_s)
    else:
        _tma_load(bd, [n0, k], bar, b_s)


@gluon.jit
def _advance(prod, CHU, U, grid, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """The next chunk's producer cursor (stage, chunk in unit, unit, tile, tile origin), by increments
    only: the divisions of a flat index cost about as many issue cycles per chunk as the chunk's wgmma.
    grid: (program id, programs, tile rows, tile columns)."""
    s, q, u, t, m0, n0 = prod
    pid, num_programs, num_pid_m, num_pid_n = grid
    s += 1
    if s == STAGES:
        s = 0
    q += 1
    if q == CHU:
        q = 0
        u += 1
        if u == U:
            u = 0
            t += 1
            # past this program's last tile the origin is garbage (tile_coords of a tile beyond the
            # grid), never used: the caller issues no load past `total`
            pid_m, pid_n = tile_coords(pid + t * num_programs, num_pid_m, num_pid_n, GROUP_M)
            m0 = pid_m * BM
            n0 = pid_n * BN
    return s, q, u, t, m0, n0


@gluon.jit
def _slot(slab, BM: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    """Pointers to a BM x BN FP32 slot in the accumulator's layout (built where used: 128 registers live)."""
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    return slab + rows[:, None] * BN + cols[None, :]


@gluon.jit
def _step(
    acc,
    cons,
    prod,
    total,
    chunks,
    kps,
    U,
    grid,
    descs,
    smem,
    BM: gl.constexpr,
    BN: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    PIECES: gl.constexpr,
    B_KN: gl.constexpr,
):
    """One chunk: wait for its stage, acc += a @ b (async wgmma), then load STAGES-1 chunks ahead into the
    stage the previous wgmma has released, whatever unit or tile that chunk belongs to. wait(1) covers
    this warpgroup's wgmma only; the barrier after it makes the refill wait for both warpgroups (Triton's
    barrier pass puts one there anyway: the sm90 PTX has the same bar.sync count with it or without).
    cons: the consumer cursor (stage, its phase)."""
    cs, phase = cons
    a_bufs, b_bufs, bars = smem
    mbarrier.wait(bars.index(cs), phase)
    if B_KN:
        b = b_bufs.index(cs)
    else:
        b = b_bufs.index(cs).permute((1, 0))
    acc = warpgroup_mma(a_bufs.index(cs), b, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    _cta_barrier()
    _, pq, pu, pt, _, _ = prod
    if (pt * U + pu) * chunks[2] + pq < total:  # the producer has chunks left
        _issue(prod, chunks, kps, descs, smem, PIECES, B_KN)
        prod = _advance(prod, chunks[2], U, grid, BM, BN, GROUP_M, STAGES)
    cs += 1
    if cs == STAGES:
        cs = 0
        phase ^= 1
    return acc, (cs, phase), prod


@gluon.jit
def _tree_insert(
    acc,
    pending,
    u,
    t,
    U,
    LOG2U,
    grid,
    M,
    lvl_bufs,
    lvl2_slab,
    c_desc,
    mma: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    GROUP_M: gl.constexpr,
    LVL2_SMEM: gl.constexpr,
):
    """Unit u's finished partial (acc) takes its place in the tree: the binary counter of
    unit_gemm._tree_insert, level 0 pending in registers, level 1 in lvl_bufs[0], level 2 in lvl_bufs[1]
    or the L2 slab. The tile's last unit leaves the root in acc, stored (FP32) through lvl_bufs[0] by
    TMA. Returns the next chain's +0 start and the pending sibling. M (the row count, never negative)
    only feeds the +0 select below."""
    if LOG2U > 0:
        if (u & 1) == 0:
            pending = acc
        else:
            acc = pending + acc
            if LOG2U > 1:  # level 1: node u >> 1
                _cta_barrier()
                if ((u >> 1) & 1) == 0:
                    tma.store_wait(pendings=0)  # the previous root's TMA store may still read lvl_bufs[0]
                    _cta_barrier()
                    lvl_bufs.index(0).store(acc)
                else:
                    acc = lvl_bufs.index(0).load(mma) + acc
                    if LOG2U > 2:  # level 2: node u >> 2
                        if ((u >> 2) & 1) == 0:
                            if LVL2_SMEM:
                                lvl_bufs.index(1).store(acc)
                            else:
                                gl.store(_slot(lvl2_slab, BM, BN, mma), acc)  # read back by the same threads
                        else:
                            if LVL2_SMEM:
                                acc = lvl_bufs.index(1).load(mma) + acc
                            else:
                                acc = gl.load(_slot(lvl2_slab, BM, BN, mma)) + acc
    if u == U - 1:  # the root
        _store_root(acc, t, grid, lvl_bufs, c_desc, BM, BN, GROUP_M)
    # the next chain starts from +0, as tl.zeros in the Triton kernel. A select on a runtime-false
    # condition, not gl.zeros: a zeros constant stays live in registers across the loops and raises
    # the register count (the kernels' timings: reports/h200/gemm.json, python -m h3lab.bench.gemm_bench)
    return gl.where(M < 0, acc, 0.0), pending


@gluon.jit
def _store_root(acc, t, grid, lvl_bufs, c_desc, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """The tile's root, FP32, through lvl_bufs[0] and a TMA store (rows and columns past the end clipped)."""
    _, num_programs, num_pid_m, num_pid_n = grid
    pid_m, pid_n = tile_coords(gl.program_id(0) + t * num_programs, num_pid_m, num_pid_n, GROUP_M)
    tma.store_wait(pendings=0)
    _cta_barrier()
    lvl_bufs.index(0).store(acc)
    fence_async_shared()
    _cta_barrier()
    _tma_store(c_desc, [pid_m * BM, pid_n * BN], lvl_bufs.index(0))


# One function on purpose: a Gluon kernel; its pipeline cursors, barriers and accumulators live across the
# persistent loop, and its signature is fixed (top-level descriptors and do_not_specialize arguments).
@gluon.jit(do_not_specialize=["M", "N", "U", "LOG2U", "KP0", "KP1", "KP2", "num_programs"])
def unit_mm_sm90_kernel(
    ad0,
    bd0,
    ad1,
    bd1,
    ad2,
    bd2,
    c_desc,
    s_ptr,
    M,
    N,
    U,
    LOG2U,
    KP0,
    KP1,
    KP2,
    num_programs,
    GROUP_M: gl.constexpr,
    PIECES: gl.constexpr,
    B_KN: gl.constexpr,
    STAGES: gl.constexpr,
    LVL2_SMEM: gl.constexpr,
    num_warps: gl.constexpr,
):
    # One function on purpose: the pipeline's producer and consumer cursors, barriers and per-unit
    # accumulators live across the whole persistent loop (`_step` takes the one piece that stands
    # alone). The descriptors are separate arguments (Triton 3.6's launcher expands them nowhere
    # else) and so are the do_not_specialize ones (a tuple's elements are always specialised); the
    # helpers take them as tuples: descs, smem (the stages' buffers and barriers), chunks (CH0, CH1,
    # CHU: chunks per unit), kps (the pieces' unit widths), grid (program id, programs, tile rows,
    # tile columns) and the producer cursor prod (stage, chunk in unit, unit, tile, tile origin).
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    # wgmma m64nBNk16 per warpgroup, warpgroups stacked along M: Triton's choice for tl.dot here
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
    )
    a_bufs = gl.allocate_shared_memory(ad0.dtype, [STAGES] + ad0.block_type.shape, ad0.layout)  # noqa: RUF005
    b_bufs = gl.allocate_shared_memory(bd0.dtype, [STAGES] + bd0.block_type.shape, bd0.layout)  # noqa: RUF005
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    NLVL: gl.constexpr = 2 if LVL2_SMEM else 1
    lvl_bufs = gl.allocate_shared_memory(gl.float32, [NLVL, BM, BN], c_desc.layout)  # [0] also stages the output
    pid = gl.program_id(0)
    lvl2_slab = s_ptr + pid.to(gl.int64) * (BM * BN)  # this program's level-2 slot (unless LVL2_SMEM)

    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    my_tiles = (num_pid_m * num_pid_n - pid + num_programs - 1) // num_programs
    CH0 = KP0 // BK
    CH1 = KP1 // BK
    CHU = CH0 + CH1 + KP2 // BK  # chunks per unit, pieces in order
    total = my_tiles * U * CHU
    chunks, kps, grid = (CH0, CH1, CHU), (KP0, KP1, KP2), (pid, num_programs, num_pid_m, num_pid_n)
    descs, smem = (ad0, bd0, ad1, bd1, ad2, bd2), (a_bufs, b_bufs, bars)

    pid_m, pid_n = tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    prod = (0, 0, 0, 0, pid_m * BM, pid_n * BN)  # producer cursor: the next chunk to load
    for i in gl.static_range(STAGES - 1):  # prologue: the first STAGES-1 chunks in flight
        if i < total:
            _issue(prod, chunks, kps, descs, smem, PIECES, B_KN)
            prod = _advance(prod, CHU, U, grid, BM, BN, GROUP_M, STAGES)

    acc = gl.zeros((BM, BN), gl.float32, mma)
    pending = gl.zeros((BM, BN), gl.float32, mma)  # level-0 left sibling
    cons = (0, 0)  # consumer cursor: stage and its phase
    # A loop per unit that holds nothing but the chain, the tree between them (with the tree under a
    # branch inside one loop over all chunks, the chunk loop itself ran 8-13% slower on the H200, at
    # U = 1 too). The producer's cursor still loads across unit and tile boundaries.
    for t in range(my_tiles):
        for u in range(U):
            for _ in range(CHU):
                acc, cons, prod = _step(
                    acc, cons, prod, total, chunks, kps, U, grid, descs, smem, BM, BN, GROUP_M, STAGES, PIECES, B_KN
                )
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc, pending = _tree_insert(
                acc, pending, u, t, U, LOG2U, grid, M, lvl_bufs, lvl2_slab, c_desc, mma, BM, BN, GROUP_M, LVL2_SMEM
            )
    tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


# ---- host side -----------------------------------------------------------------------------------


def check_config(cfg: dict[str, Any], capability: tuple[int, int]) -> None:
    """Raises ValueError when an explicit "IMPL": "gluon" cannot be honoured: it never falls back.

    Allowed: what has run on the H200 (the GPU tests of tests/test_kernels_gemm.py): a Hopper device
    (capability 9.0: wgmma, TMA), BLOCK_K 64, 128x128 tiles on 8 warps (two warpgroups stacked along
    M; the FP32 accumulator and the level-0 sibling fill 128 of 255 registers per thread), 3 or 4
    stages (3 with LVL2_SMEM: 3 x 32 KiB + 2 x 64 KiB = 224 KiB of the 227 KiB of shared memory).
    """
    if tuple(capability) != (9, 0):
        raise ValueError(f"unit_mm IMPL gluon: device capability {capability}; allowed: (9, 0) (sm90)")
    allowed = {
        "BLOCK_K": [BLOCK_K],
        "BLOCK_M": [128],
        "BLOCK_N": [128],
        "num_warps": [8],
        "num_stages": [3] if cfg.get("LVL2_SMEM", False) else [3, 4],
    }
    for key, values in allowed.items():
        if cfg[key] not in values:
            raise ValueError(f"unit_mm IMPL gluon: {key}={cfg[key]}; allowed: {values}")


def supports(pieces: Sequence[tuple[Tensor, Tensor]], num_units: int) -> str | None:
    """None when this kernel can run the call, else why not (the caller then runs the Triton kernel,
    which gives the same bits: a performance choice, not a numerical one).

    Needs: bf16 operands, every unit width a multiple of 64 (TMA boxes end on unit ends), a [M, K]
    row-major (TMA-aligned), every b the same layout ([K, N] rows or a weight [N, K] seen as b = W.T),
    N a multiple of 4 (the FP32 output's rows 16-byte aligned for the TMA store).
    """
    if pieces[0][1].shape[1] % 4:
        return f"N = {pieces[0][1].shape[1]} not a multiple of 4"
    for a, b in pieces:
        if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
            return "an fp32 operand"
        if (a.shape[1] // num_units) % BLOCK_K:
            return f"unit width {a.shape[1] // num_units} not a multiple of {BLOCK_K}"
        if a_mode(a) != 1:
            return "a not row-major with 16-byte aligned rows"
    modes = {b_mode(b) for _, b in pieces}
    if 0 in modes:
        return "b neither [K, N] rows nor W.T with 16-byte aligned rows"
    if len(modes) != 1:
        return "b layouts mixed ([K, N] rows and W.T)"
    return None


@functools.cache
def _layouts(BM: int, BN: int, b_kn: bool) -> tuple[Any, Any, Any]:
    """Shared-memory layouts of a, b (as the descriptor walks it) and the FP32 output tile (cached: host time)."""
    b_block = [BLOCK_K, BN] if b_kn else [BN, BLOCK_K]
    return (
        gl.NVMMASharedLayout.get_default_for([BM, BLOCK_K], gl.bfloat16),
        gl.NVMMASharedLayout.get_default_for(b_block, gl.bfloat16),
        gl.NVMMASharedLayout.get_default_for([BM, BN], gl.float32),
    )


def launch(
    pieces: Sequence[tuple[Tensor, Tensor]], num_units: int, out_MN: Tensor, grid: int, cfg: dict[str, Any]
) -> None:
    """Run the kernel into out_MN (FP32 [M, N], TMA-aligned); `check_config` passed, `supports` said yes."""
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    lvl2_smem = bool(cfg.get("LVL2_SMEM", False))
    b_kn = b_mode(pieces[0][1]) == 2  # [K, N] rows; 1 is W.T
    b_block = [BLOCK_K, BN] if b_kn else [BN, BLOCK_K]
    a_layout, b_layout, c_layout = _layouts(BM, BN, b_kn)
    descs: list[Any] = []
    kps: list[int] = []
    for a, b in pieces:
        descs.append(TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [BM, BLOCK_K], a_layout))
        if b_kn:
            descs.append(TensorDescriptor(b, list(b.shape), [b.stride(0), 1], b_block, b_layout))
        else:  # b = W.T: the descriptor walks W [N, K]
            descs.append(TensorDescriptor(b.t(), [b.shape[1], b.shape[0]], [b.stride(1), 1], b_block, b_layout))
        kps.append(a.shape[1] // num_units)
    descs += [None, None] * (3 - len(pieces))
    kps += [0] * (3 - len(pieces))
    c_desc = TensorDescriptor(out_MN, list(out_MN.shape), [out_MN.stride(0), 1], [BM, BN], c_layout)
    # level 2's L2 slabs, one per program; without a level 2 in L2 the pointer is never dereferenced
    scratch = (
        out_MN
        if lvl2_smem or num_units < 8
        else torch.empty((grid, BM * BN), dtype=torch.float32, device=out_MN.device)
    )
    M, N = out_MN.shape
    unit_mm_sm90_kernel[(grid,)](
        *descs,
        c_desc,
        scratch,
        M,
        N,
        num_units,
        num_units.bit_length() - 1,
        *kps,
        grid,
        GROUP_M=cfg["GROUP_M"],
        PIECES=len(pieces),
        B_KN=b_kn,
        STAGES=cfg["num_stages"],
        LVL2_SMEM=lvl2_smem,
        num_warps=cfg["num_warps"],
        enable_fp_fusion=False,
    )


# ---- the builds compile_pinned compiles ----------------------------------------------------------

CALLS = ((1, False), (3, True), (2, True))  # (pieces, b as [K, N] rows): to_out and ff.net.2 | q,k,v dX | ff.net.0 dX


def variant(pieces: int, b_kn: bool, stages: int, lvl2_smem: bool, block: int = 128, num_warps: int = 8) -> Variant:
    """One build: `pieces` operand pairs, b as [K, N] rows or W.T, `stages` deep, level 2 in shared
    memory or L2; `block` x `block` tiles on `num_warps` warps (h3lab.bench.compile_sm90 tries others)."""
    if not 1 <= pieces <= 3:
        raise ValueError(f"unit_mm_sm90 variant: pieces={pieces}; allowed: 1, 2, 3")
    a_l, b_l, c_l = _layouts(block, block, b_kn)
    b_block = [BLOCK_K, block] if b_kn else [block, BLOCK_K]
    types: dict[str, Any] = {}
    for i in range(3):
        used = i < pieces
        types[f"ad{i}"] = f"tensordesc<bf16[{block},{BLOCK_K}],{a_l!r}>" if used else None
        types[f"bd{i}"] = f"tensordesc<bf16[{b_block[0]},{b_block[1]}],{b_l!r}>" if used else None
    types |= {"c_desc": f"tensordesc<fp32[{block},{block}],{c_l!r}>", "s_ptr": "*fp32"}
    const = {"GROUP_M": 8, "PIECES": pieces, "B_KN": b_kn, "STAGES": stages, "LVL2_SMEM": lvl2_smem}
    const["num_warps"] = num_warps
    what = f"gluon, {pieces} piece{'s' if pieces > 1 else ''}, b {'[K, N]' if b_kn else 'W.T'}"
    what += f", {stages} stages{', smem level 2' if lvl2_smem else ''}"
    opts = {"num_warps": num_warps, "num_stages": 1, "enable_fp_fusion": False}
    return Variant("unit_gemm", what, unit_mm_sm90_kernel, types, const, opts, align_pointers=False)


def variants(node: str) -> list[Variant]:
    """The real calls under the pinned "IMPL": "gluon" entry (none where the entry runs the Triton kernel)."""
    cfg = configs.pinned("unit_gemm", node)
    if cfg.get("IMPL") != "gluon":
        return []
    lvl2 = bool(cfg.get("LVL2_SMEM", False))
    return [variant(p, kn, cfg["num_stages"], lvl2, cfg["BLOCK_M"], cfg["num_warps"]) for p, kn in CALLS]
