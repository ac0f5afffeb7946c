# Whole on purpose: one kernel, its three partitions sharing one shared-memory plan and barrier protocol, and
# the launchers that build the descriptors its layouts assume.
"""A fused attention backward for Hopper in Gluon, dq added in key-block order by its own warp.

Pinned (kernels/sm90.json, attention_bwd_q at Dh 128, "IMPL": "gluon"): h3lab.triton.attention's
`attention_bwd` runs it over every query and key (the block without CP), `attention_bwd_q` runs it
without dk and dv (`DKV` false) for a CP rank's queries over every key: one kernel, so one set of
dq bytes under every layout. Timed against the Triton split backward by
h3lab.bench.attention_fused_bwd (`--gluon`; reports/h200/attention-fused-bwd.json).
- dk, dv: the pinned dk/dv kernel's bits (attention_bwd, BLOCK_M 64 query rows, BLOCK_N 128 keys):
  per key block, over query blocks ascending, S^T = K Q^T, P^T = exp2(S^T * qk_scale - lse2),
  dP^T = V dO^T, dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q, as one wgmma chain each;
- dq: h3lab.triton.attention_fused's ("ordered"): a query row's dq = ((0 + P_0) + P_1) + ... over key
  blocks j, P_j = dS_j K_j an FP32 [64, 128] tile, then times scale on the host; here by TMA
  reduce-adds (cp.reduce.async.bulk .add.f32), there by atomics: they round alike (its GPU test).

As FlashAttention-3's deterministic backward does (hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp,
`store_dq`), one program per (head, key block) runs
- a producer warp: K_j and V_j once, then Q_i, dO_i and their rows' lse and delta (1-D TMA blocks,
  as FA3 bulk-copies LSE and dPsum) of every query block into a STAGES-deep ring;
- the compute partition (8 warps, two warpgroups over the 128 keys): the five GEMMs per query block,
  the statistics read from shared memory (read from global memory in the softmax, their latency
  showed as the compute warps' largest stall), dQ issued first and P_i^j written into one of
  DQ_SLOTS shared-memory slots while dV and dK run;
- a dQ warp: waits until turn[h, i] == j (key blocks 0..j-1 have added), bulk-adds the slot, hands
  it back once the add has read it (`cp.async.bulk.wait_group.read`), and releases turn i only once
  the add's global writes are done (`wait_group` without `.read`: FlashAttention issue #2244's dq
  varied run to run when released after `.read`), after issuing add i + 1: two adds in flight.
Key block j spins until j - 1 has added, so j - 1 must be resident or done: CUDA dispatches a grid's
blocks in launch order in practice (not promised; FA3 and the Triton candidate rely on it). Launch
order keys_first (the default: grid axis 0, CUDA's fastest, is the key block) runs one head's key
blocks at once, which read the same Q, dO tiles and add into the same dq rows, within L2;
heads_first spreads them over every head's rows, past L2 (the record times both). STAGES 2,
DS_SLOTS 1, DQ_SLOTS 2 fit sm90's 232,448 bytes of shared memory (the compile test asserts it).

Launcher: `attention_bwd_fused_sm90`. Dimension legend: Q query rows, K keys, H heads, Dh head dim.
"""

from __future__ import annotations

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

from h3lab.triton.attention_args import DQ_MODES, LOG2E, bwd_operands, check_modes
from h3lab.triton.attention_fwd_sm90 import MAXNREG, _desc, _smem_layout
from h3lab.triton.configs import cdiv, interpreting
from h3lab.triton.sm90_order import bulk_wait, st_release, tma_reduce_add, wait_turn
from h3lab.triton.variant import ATTENTION_FP_FUSION, Variant

F32 = torch.float32
BLOCK_M, BLOCK_N, HEAD_DIM = 64, 128, 128  # query rows, keys, head dim: the pinned dk/dv kernel's tile
STAGES, DS_SLOTS, DQ_SLOTS = 2, 1, 2  # what fits 232,448 bytes of shared memory (module docstring)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # 3.9 renamed it


@gluon.jit
def _head_and_key_block(KEYS_FIRST: gl.constexpr):
    # grid axis 0, CUDA's fastest: the key block (keys_first) or the head (heads_first)
    if KEYS_FIRST:
        return gl.program_id(1), gl.program_id(0)
    else:
        return gl.program_id(0), gl.program_id(1)


@gluon.jit
def _producer(descs, bufs, bars, n_q, n_stat, STAGES: gl.constexpr, KEYS_FIRST: gl.constexpr):
    """One warp: K_j and V_j, then Q_i, dO_i and their rows' lse and delta (n_stat, a multiple of
    BLOCK_M, apart per head) of every query block i into ring slot i % STAGES."""
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc = descs
    q_bufs, do_bufs, k_smem, v_smem, lse_bufs, delta_bufs = bufs
    kv_bar, q_full, q_empty = bars
    BM: gl.constexpr = q_desc.block_type.shape[0]
    DH: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    h, j = _head_and_key_block(KEYS_FIRST)
    col = h * DH
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [j * BN, col], kv_bar, k_smem)
    _tma_load(v_desc, [j * BN, col], kv_bar, v_smem)
    for i in range(gl.cdiv(n_q, BM)):
        s = i % STAGES
        mbarrier.wait(q_empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
        mbarrier.expect(q_full.index(s), 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
        _tma_load(q_desc, [i * BM, col], q_full.index(s), q_bufs.index(s))
        _tma_load(do_desc, [i * BM, col], q_full.index(s), do_bufs.index(s))
        _tma_load(lse_desc, [h * n_stat + i * BM], q_full.index(s), lse_bufs.index(s))
        _tma_load(delta_desc, [h * n_stat + i * BM], q_full.index(s), delta_bufs.index(s))


@gluon.jit
def _dq_writer(dq_desc, dq_smem, bars, turn_ptr, n_q, DQ_MODE: gl.constexpr, KEYS_FIRST: gl.constexpr):
    """One warp: per query block i, wait for this key block's turn, bulk-add its dq tile, hand the slot
    back once the add has read it, and release turn i - 1 once add i - 1's writes are done (two adds
    in flight; the last released after its own). DQ_MODE 1 (unordered) adds without turns, 2 (skipped)
    only hands the slots back: diagnostics whose dq is not the kernel's."""
    dq_full, dq_empty = bars
    BM: gl.constexpr = dq_desc.block_type.shape[0]
    DH: gl.constexpr = dq_desc.block_type.shape[1]
    SLOTS: gl.constexpr = dq_smem.type.shape[0]
    h, j = _head_and_key_block(KEYS_FIRST)
    n_qb = gl.cdiv(n_q, BM)
    lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=lanes)
    nxt = gl.full([32], 1, gl.int32, lanes) * (j + 1)
    turns = turn_ptr + h * n_qb + lane * 0  # every lane reads the one counter
    for i in range(n_qb):
        slot = i % SLOTS
        if DQ_MODE == 0:
            wait_turn(turns + i, j)
        mbarrier.wait(dq_full.index(slot), (i // SLOTS) & 1)
        if DQ_MODE != 2:
            tma_reduce_add(dq_desc, [i * BM, h * DH], dq_smem.index(slot))
        bulk_wait(lane, 0, True)
        mbarrier.arrive(dq_empty.index(slot), count=1)
        if i > 0:
            bulk_wait(lane, 1, False)
            if DQ_MODE == 0:
                st_release(turns + i - 1, nxt)
    bulk_wait(lane, 0, False)
    if DQ_MODE == 0:
        st_release(turns + n_qb - 1, nxt)


# One function on purpose: a query block's five GEMMs and the softmax between them are one pipeline
# of wgmma issues and waits; split, its tokens and accumulators would cross function boundaries.
@gluon.jit
def _hand_dq(part, dq_smem, dq_full, dq_empty, i):
    """Query block i's dq tile into its slot, once the dQ warp has handed the slot back."""
    slot = i % dq_smem.type.shape[0]
    mbarrier.wait(dq_empty.index(slot), ((i // dq_smem.type.shape[0]) & 1) ^ 1)
    dq_smem.index(slot).store(part)
    fence_async_shared()
    mbarrier.arrive(dq_full.index(slot), count=1)


@gluon.jit
def _compute(bufs, bars, io, STAGES: gl.constexpr, KEYS_FIRST: gl.constexpr, DKV: gl.constexpr):
    """The default partition (8 warps): dk, dv over every query block (DKV; else none: dq alone); each
    block's dq tile to the dQ warp."""
    q_bufs, do_bufs, k_smem, v_smem, lse_bufs, delta_bufs, ds_smem, dq_smem = bufs
    kv_bar, q_full, q_empty, dq_full, dq_empty = bars
    dk_ptr, dv_ptr, n_q, n_k, qk_scale, scale, stride_gm, stride_gh = io
    BM: gl.constexpr = q_bufs.type.shape[1]
    DH: gl.constexpr = q_bufs.type.shape[2]
    BN: gl.constexpr = k_smem.type.shape[0]
    mma_kq: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [8, 1], [16, BM, 16])
    mma_kd: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [8, 1], [16, DH, 16])
    mma_qd: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 2], [16, DH // 2, 16])
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_kd, k_width=2)
    h, j = _head_and_key_block(KEYS_FIRST)
    zero_s = gl.zeros([BN, BM], gl.float32, mma_kq)
    zero_q = gl.zeros([BM, DH], gl.float32, mma_qd)
    dk = gl.zeros([BN, DH], gl.float32, mma_kd)
    dv = gl.zeros([BN, DH], gl.float32, mma_kd)
    cols = gl.arange(0, BM, layout=gl.SliceLayout(0, mma_kq))
    key_ok = (j * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_kq))) < n_k
    mbarrier.wait(kv_bar, 0)
    for i in range(gl.cdiv(n_q, BM)):
        s = i % STAGES
        rows = i * BM + cols
        row_ok = rows < n_q
        mbarrier.wait(q_full.index(s), (i // STAGES) & 1)
        q_s, do_s = q_bufs.index(s), do_bufs.index(s)
        s_tok = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, is_async=True)
        dp_tok = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, is_async=True)
        lse = lse_bufs.index(s).load(gl.SliceLayout(0, mma_kq))  # rows past Q: padding, masked
        st = warpgroup_mma_wait(1, deps=(s_tok,))
        delta = delta_bufs.index(s).load(gl.SliceLayout(0, mma_kq))
        p = gl.where(row_ok[None, :], gl.exp2(st * qk_scale - lse[None, :]), 0.0)
        if DKV:
            p_op = gl.convert_layout(p.to(gl.bfloat16), operand)
        dpt = warpgroup_mma_wait(0, deps=(dp_tok,))
        ds = gl.where(key_ok[:, None], p * (dpt - delta[None, :]), 0.0).to(gl.bfloat16)  # padded keys add nothing
        ds_slot = ds_smem.index(i % ds_smem.type.shape[0])
        ds_slot.store(ds)
        fence_async_shared()
        # dV issued after dS (issued right after P it spills inside the loop); dQ first, so that its
        # tile is handed over while dV and dK run
        dq_tok = warpgroup_mma(ds_slot.permute((1, 0)), k_smem, zero_q, is_async=True)
        if DKV:
            ds_op = gl.convert_layout(ds, operand)
            dv_tok = warpgroup_mma(p_op, do_s, dv, is_async=True)
            dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
            part = warpgroup_mma_wait(2, deps=(dq_tok,))
            _hand_dq(part, dq_smem, dq_full, dq_empty, i)
            dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
        else:
            part = warpgroup_mma_wait(0, deps=(dq_tok,))
            _hand_dq(part, dq_smem, dq_full, dq_empty, i)
        mbarrier.arrive(q_empty.index(s), count=1)
    if DKV:
        r = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_kd))
        c = gl.arange(0, DH, layout=gl.SliceLayout(0, mma_kd))
        off = h.to(gl.int64) * stride_gh + r.to(gl.int64)[:, None] * stride_gm + c[None, :]
        gl.store(dk_ptr + off, dk * scale, mask=(r < n_k)[:, None])
        gl.store(dv_ptr + off, dv, mask=(r < n_k)[:, None])


# One function on purpose: a Gluon kernel; its shared memory and barriers are allocated where
# warp_specialize hands them to the partitions, and its signature is the launcher's.
@gluon.jit(do_not_specialize=["n_q", "n_k", "n_stat"])
def attention_bwd_fused_sm90_kernel(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    dq_desc,
    lse_desc,
    delta_desc,
    dk_ptr,
    dv_ptr,
    turn_ptr,
    n_q,
    n_k,
    n_stat,
    qk_scale,
    scale,
    stride_gm,
    stride_gh,
    STAGES: gl.constexpr,
    DS_SLOTS: gl.constexpr,
    DQ_SLOTS: gl.constexpr,
    DQ_MODE: gl.constexpr,
    KEYS_FIRST: gl.constexpr,
    DKV: gl.constexpr,
    num_warps: gl.constexpr,
):
    """grid (n_kb, H) under KEYS_FIRST, else (H, n_kb): dk, dv [n_k, H, Dh] FP32 of one (head, key
    block); dq [n_q, H * Dh] FP32 (zeroed) += its tiles in key-block order; lse, delta [H * n_stat]
    FP32 (n_stat: n_q padded to a multiple of 64); turn [H, cdiv(n_q, 64)] int32 (zeroed). DQ_MODE:
    the index of attention_args.DQ_MODES (0, ordered: the kernel). DKV false: dq alone (dk, dv are
    neither computed nor written; dq's bits are the same)."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    DH: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BM, DH], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BM, DH], do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BN, DH], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BN, DH], v_desc.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM], lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM], delta_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], gl.bfloat16)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [DS_SLOTS, BN, BM], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_SLOTS, BM, DH], dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_SLOTS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_SLOTS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(DQ_SLOTS):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    io = (dk_ptr, dv_ptr, n_q, n_k, qk_scale, scale, stride_gm, stride_gh)
    ring = (q_bufs, do_bufs, k_smem, v_smem, lse_bufs, delta_bufs)
    bufs = (q_bufs, do_bufs, k_smem, v_smem, lse_bufs, delta_bufs, ds_smem, dq_smem)
    descs = (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc)
    gl.warp_specialize(
        [
            (_compute, (bufs, (kv_bar, q_full, q_empty, dq_full, dq_empty), io, STAGES, KEYS_FIRST, DKV)),
            (_producer, (descs, ring, (kv_bar, q_full, q_empty), n_q, n_stat, STAGES, KEYS_FIRST)),
            (_dq_writer, (dq_desc, dq_smem, (dq_full, dq_empty), turn_ptr, n_q, DQ_MODE, KEYS_FIRST)),
        ],
        [1, 1],
        [24, 24],
    )


# ---- host side -----------------------------------------------------------------------------------


def _dq_desc(dq: Tensor) -> TensorDescriptor:
    """dq [Q, H, Dh] FP32 as a [Q, H * Dh] descriptor of [BLOCK_M, Dh] blocks (TMA clips rows past Q)."""
    q, h, dh = dq.shape
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, dh], gl.float32)
    return TensorDescriptor(dq, [q, h * dh], [dq.stride(0), 1], [BLOCK_M, dh], layout)


def _stat_layout() -> Any:
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def _stat_desc(stat: Tensor) -> TensorDescriptor:
    """A FP32 [H, Q] statistic as one row of BLOCK_M blocks, each head's Q rows padded with zeros to
    a multiple of BLOCK_M (a copy only when Q is not one): every block starts 256-byte aligned inside
    its head, and no block reads past the row."""
    q = stat.shape[1]
    if q % BLOCK_M:
        stat = torch.nn.functional.pad(stat, (0, cdiv(q, BLOCK_M) * BLOCK_M - q))
    return TensorDescriptor(stat.view(-1), [stat.numel()], [1], [BLOCK_M], _stat_layout())


def _check_call(q: Tensor, k: Tensor, order: str, dq_mode: str) -> None:
    check_modes("attention_bwd_fused_sm90", order, dq_mode)
    if interpreting() or q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        raise ValueError(f"attention_bwd_fused_sm90 on {q.device}; allowed: a compiled run on an sm90 GPU")
    if q.dtype != torch.bfloat16 or q.shape[2] != HEAD_DIM or q.shape[0] == 0 or k.shape[0] == 0:
        raise ValueError(
            f"attention_bwd_fused_sm90: {q.dtype} q {tuple(q.shape)}, k {tuple(k.shape)}; allowed: torch.bfloat16, "
            f"Dh {HEAD_DIM}, Q > 0, K > 0"
        )


def attention_bwd_fused_sm90(
    q: Tensor,
    do: Tensor,
    stats: Sequence[Tensor],
    delta: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    order: str = "keys_first",
    dq_mode: str = "ordered",
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq [Q, H, Dh], dk, dv [K, H, Dh]) FP32 (module docstring): bf16 q, dO, k, v with Dh 128, on an
    sm90 GPU, compiled (not the interpreter); every query and every key, each in canonical order.
    `order`, one of attention_args.ORDERS, is the launch order (the same bytes under each);
    `dq_mode`, one of attention_args.DQ_MODES, "ordered" or a diagnostic whose dq is not the kernel's.

    Raises:
        ValueError: another dtype, head dim, layout or device, order or dq_mode.
    """
    q, do, k, v, lse, delta = bwd_operands(q, do, stats, delta, k, v, scale)
    _check_call(q, k, order, dq_mode)
    K, H, Dh = k.shape
    dk = torch.empty((K, H, Dh), dtype=F32, device=q.device)
    dv = torch.empty((K, H, Dh), dtype=F32, device=q.device)
    dq = _launch((q, do, lse, delta, k, v), (dk, dv), scale, order, dq_mode)
    return dq, dk, dv


def attention_bwd_q_sm90(
    q: Tensor, do: Tensor, stats: Sequence[Tensor], delta: Tensor, k: Tensor, v: Tensor, scale: float
) -> Tensor:
    """dq [Q, H, Dh] FP32 of these queries over every key (canonical order): the fused kernel without
    dk and dv, so dq's bytes are `attention_bwd_fused_sm90`'s, whatever queries share the call.

    Raises:
        ValueError: another dtype, head dim, layout or device.
    """
    q, do, k, v, lse, delta = bwd_operands(q, do, stats, delta, k, v, scale)
    _check_call(q, k, "keys_first", "ordered")
    return _launch((q, do, lse, delta, k, v), None, scale, "keys_first", "ordered")


def _launch(
    operands: tuple[Tensor, ...], grads: tuple[Tensor, Tensor] | None, scale: float, order: str, dq_mode: str
) -> Tensor:
    """One launch on checked operands (q, dO, lse, delta, k, v) into grads (dk, dv; None: dq alone)."""
    q, do, lse, delta, k, v = operands
    (Q, H, Dh), K = q.shape, k.shape[0]
    dq = torch.zeros((Q, H, Dh), dtype=F32, device=q.device)
    dk, dv = grads if grads is not None else (dq, dq)  # not written without DKV
    turn = torch.zeros((H, cdiv(Q, BLOCK_M)), dtype=torch.int32, device=q.device)
    grid = (H, cdiv(K, BLOCK_N)) if order == "heads_first" else (cdiv(K, BLOCK_N), H)
    attention_bwd_fused_sm90_kernel[grid](
        _desc(q.contiguous(), BLOCK_M),
        _desc(do.contiguous(), BLOCK_M),
        _desc(k.contiguous(), BLOCK_N),
        _desc(v.contiguous(), BLOCK_N),
        _dq_desc(dq),
        _stat_desc(lse),
        _stat_desc(delta),
        dk,
        dv,
        turn,
        Q,
        K,
        cdiv(Q, BLOCK_M) * BLOCK_M,
        scale * LOG2E,
        scale,
        dk.stride(0),
        dk.stride(1),
        STAGES=STAGES,
        DS_SLOTS=DS_SLOTS,
        DQ_SLOTS=DQ_SLOTS,
        DQ_MODE=DQ_MODES.index(dq_mode),
        KEYS_FIRST=order == "keys_first",
        DKV=grads is not None,
        num_warps=8,
        maxnreg=MAXNREG,
        enable_fp_fusion=ATTENTION_FP_FUSION,
    )
    return dq.mul_(scale)


def variant(dkv: bool = True) -> Variant:
    """Its build at the real shapes' argument types, with dk and dv (`dkv`) or dq alone (the pinned
    dq kernel: h3lab.triton.attention_bwd.variants lists both)."""
    lq, lk = _smem_layout(BLOCK_M, HEAD_DIM, torch.bfloat16), _smem_layout(BLOCK_N, HEAD_DIM, torch.bfloat16)
    ldq = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float32)
    types = {f"{n}_desc": f"tensordesc<bf16[{BLOCK_M},{HEAD_DIM}],{lq!r}>" for n in ("q", "do")}
    types |= {f"{n}_desc": f"tensordesc<bf16[{BLOCK_N},{HEAD_DIM}],{lk!r}>" for n in ("k", "v")}
    types |= {"dq_desc": f"tensordesc<fp32[{BLOCK_M},{HEAD_DIM}],{ldq!r}>", "turn_ptr": "*i32"}
    types |= {f"{n}_desc": f"tensordesc<fp32[{BLOCK_M}],{_stat_layout()!r}>" for n in ("lse", "delta")}
    types |= {n: "*fp32" for n in ("dk_ptr", "dv_ptr")} | {"qk_scale": "fp32", "scale": "fp32"}
    const = {
        "STAGES": STAGES,
        "DS_SLOTS": DS_SLOTS,
        "DQ_SLOTS": DQ_SLOTS,
        "DQ_MODE": 0,
        "KEYS_FIRST": True,
        "DKV": dkv,
        "num_warps": 8,
    }
    opts = {"num_warps": 8, "num_stages": 1, "maxnreg": MAXNREG, "enable_fp_fusion": ATTENTION_FP_FUSION}
    what = "gluon fused backward, head_dim 128, dq by its own warp" + ("" if dkv else ", dq alone")
    return Variant(
        "attention_fused" if dkv else "attention_bwd_q",
        what,
        attention_bwd_fused_sm90_kernel,
        types,
        const,
        opts,
        align_pointers=False,
    )
