"""Attention forward for Hopper in Gluon: the bits of `attention_fwd.attention_fwd_tma_kernel`, warp-specialised.

Reference: h3lab.triton.attention_fwd.attention_fwd_tma_kernel (Triton; behind it
h3lab.ops.attention.attention_fwd). Launcher: `attention_fwd_sm90` below, chosen by
h3lab.triton.attention when the pinned config says "IMPL": "gluon".

Why a second kernel. In the Triton kernel every warp waits for its own loads and tensor-core work:
the softmax of key block j and the GEMMs never overlap. Here, as in FlashAttention-3's forward:
- one producer warp issues the TMA loads of K and V into two rings of STAGES shared-memory slots
  (`k_full` / `v_full` mbarriers); the consumers release a K slot as soon as its QK^T is done and a
  V slot once its PV is (`k_empty` / `v_empty`), so the next loads start an iteration early;
- a consumer issues QK^T of block j together with PV of block j - 1 and runs the softmax of block j
  while PV is still on the tensor cores (intra-warpgroup overlap: two wgmma groups in flight,
  completing in issue order);
- with PINGPONG the two consumer warpgroups run as two partitions of 64 query rows each and take
  turns issuing their GEMMs through two mbarriers, so one's softmax overlaps the other's GEMMs.

Same bits, by construction: every query row sees the Triton kernel's operations in its order. Per
key block j (ascending, the ragged last block masked to -inf): s = Q K_j^T as one wgmma chain over
head_dim from +0; m_j = max(m_{j-1}, rowmax(s) * qk_scale); alpha = exp2(m_{j-1} - m_j);
p = exp2(s * qk_scale - m_j); l_j = l_{j-1} * alpha + rowsum(p); O_j = (O_{j-1} * alpha) + P_j V_j
as one wgmma chain over the block's keys with O_{j-1} * alpha as the accumulator, P rounded to the
input dtype. Then o = O / l, lse2 = m + log2(l). Which wgmma is in flight when, and which warp
issued a load, moves no bit. The row reductions run over the wgmma accumulator layout
(instr_shape [16, BLOCK_N, 16], 16 rows per warp), as Triton lowers tl.max / tl.sum for the Triton
kernel's layout, so each row's reduction tree is that kernel's. Checked byte for byte against the
Triton kernel on the GPU (tests/test_kernels_attention_sm90.py, h3lab.bench.attention_long).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from h3lab.triton import configs
from h3lab.triton.variant import ATTENTION_FP_FUSION, Variant

# Triton 3.6 names the TMA load async_copy_global_to_shared; 3.9 renamed it async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

F32 = torch.float32
# registers per thread at launch: 3 warpgroups (two consumers, or one of 8 warps, and the producer's)
# x 168 = 504 per lane of the register file's 512; setmaxnreg then moves them to 240 per consumer
# warpgroup and 24 for the producer's
MAXNREG = 168


@gluon.jit
def _load(desc, bufs, full, empty, j, col, STAGES: gl.constexpr):
    """Key block j's K (or V) into ring slot j % STAGES once the consumers have released it."""
    s = j % STAGES
    mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
    mbarrier.expect(full.index(s), desc.block_type.nbytes)
    _tma_load(desc, [j * desc.block_type.shape[0], col], full.index(s), bufs.index(s))


@gluon.jit
def _producer(descs, q_tiles, kv, bars, n_k, STAGES: gl.constexpr):
    """One warp: the query tile (one or two [rows, Dh] tiles), then K and V of every key block in the
    order the consumers use them: K_0, then K_{j+1} before V_j (QK^T of block j+1 is issued with PV
    of block j)."""
    q_desc, k_desc, v_desc = descs
    k_bufs, v_bufs = kv
    q_bar, k_full, v_full, k_empty, v_empty = bars
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    TILES: gl.constexpr = len(q_tiles)
    col = gl.program_id(1) * HEAD_DIM
    row0 = gl.program_id(0) * (ROWS * TILES)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes * TILES)
    for i in gl.static_range(TILES):
        _tma_load(q_desc, [row0 + i * ROWS, col], q_bar, q_tiles[i])
    n_blocks = gl.cdiv(n_k, k_desc.block_type.shape[0])
    _load(k_desc, k_bufs, k_full, k_empty, 0, col, STAGES)
    for j in range(n_blocks - 1):
        _load(k_desc, k_bufs, k_full, k_empty, j + 1, col, STAGES)
        _load(v_desc, v_bufs, v_full, v_empty, j, col, STAGES)
    _load(v_desc, v_bufs, v_full, v_empty, n_blocks - 1, col, STAGES)


@gluon.jit
def _softmax(qk, m_i, l_i, j, n_k, qk_scale, col_l: gl.constexpr, v_dtype: gl.constexpr, MASK: gl.constexpr):
    """Key block j's online-softmax step on its scores qk [rows, BLOCK_N] FP32: the Triton kernel's
    `_fwd_step` arithmetic; MASK (the ragged last block) sets the scores of keys >= n_k to -inf."""
    if MASK:
        BLOCK_N: gl.constexpr = qk.type.shape[1]
        key_ok = (j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)) < n_k
        qk = gl.where(key_ok[None, :], qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p.to(v_dtype), m_new, l_i, alpha


@gluon.jit
def _take_turn(turns, t, FIRST: gl.constexpr):
    """Ping-pong: wait until the other consumer has issued its GEMMs of turn t - 1 (the first consumer
    goes first: a fresh mbarrier passes phase 1)."""
    if turns is not None:
        mbarrier.wait(turns[0], (t & 1) ^ FIRST)


@gluon.jit
def _pass_turn(turns):
    if turns is not None:
        mbarrier.arrive(turns[1], count=1)


@gluon.jit
def _pv(acc, p, alpha, v_bufs, v_full, j, STAGES: gl.constexpr, mma_o: gl.constexpr):
    """O * alpha, P as the wgmma's register operand, once block j's V has landed."""
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
    p_op = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2))
    mbarrier.wait(v_full.index(j % STAGES), (j // STAGES) & 1)
    return acc, p_op


@gluon.jit
def _block(state, j, ops, zero_s, STAGES: gl.constexpr, mma_o: gl.constexpr, FIRST: gl.constexpr, MASK: gl.constexpr):
    """One turn: QK^T of block j and PV of block j - 1 in flight together; the softmax of block j
    while PV runs; K_j released once QK^T is done, V_{j-1} once PV is. `ops` = (q_smem, kv, bars,
    turns, n_k, qk_scale), the loop's invariant operands."""
    acc, p, m_i, l_i, alpha = state
    q_smem, kv, bars, turns, n_k, qk_scale = ops
    k_bufs, v_bufs = kv
    _, k_full, v_full, k_empty, v_empty = bars
    s = j % STAGES
    acc, p_op = _pv(acc, p, alpha, v_bufs, v_full, j - 1, STAGES, mma_o)
    mbarrier.wait(k_full.index(s), (j // STAGES) & 1)
    _take_turn(turns, j, FIRST)
    s_tok = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero_s, is_async=True)
    o_tok = warpgroup_mma(p_op, v_bufs.index((j - 1) % STAGES), acc, is_async=True)
    _pass_turn(turns)
    qk = warpgroup_mma_wait(1, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(s), count=1)
    p, m_i, l_i, alpha = _softmax(
        qk, m_i, l_i, j, n_k, qk_scale, gl.SliceLayout(0, zero_s.type.layout), v_bufs.dtype, MASK
    )
    acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
    mbarrier.arrive(v_empty.index((j - 1) % STAGES), count=1)
    return acc, p, m_i, l_i, alpha


@gluon.jit
def _attend(ops, STAGES: gl.constexpr, mma_s: gl.constexpr, mma_o: gl.constexpr, FIRST: gl.constexpr):
    """(O before the division, l, m) of this consumer's query rows over every key block.

    Two wgmma groups in flight at once, completing in issue order: QK^T of block j, then PV of
    block j - 1. With `turns` = (mine, theirs) two consumers alternate at the tensor cores, one turn
    per issue of GEMMs. The first block's softmax masks (it may be the ragged one), full blocks do
    not, the ragged last block does. `ops` = (q_smem, kv, bars, turns, n_k, qk_scale); mma_s, mma_o:
    the wgmma accumulator layouts of S and O."""
    q_smem, kv, bars, turns, n_k, qk_scale = ops
    k_bufs, v_bufs = kv
    q_bar, k_full, v_full, k_empty, v_empty = bars
    ROWS: gl.constexpr = q_smem.type.shape[0]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, mma_s)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, mma_s))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, mma_s))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, mma_o)
    n_full = n_k // BLOCK_N
    n_blocks = gl.cdiv(n_k, BLOCK_N)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_full.index(0), 0)
    _take_turn(turns, 0, FIRST)
    s_tok = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero_s, is_async=True)
    _pass_turn(turns)
    qk = warpgroup_mma_wait(0, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, 0, n_k, qk_scale, gl.SliceLayout(0, mma_s), v_bufs.dtype, True)
    state = (acc, p, m_i, l_i, alpha)
    for j in range(1, n_full):
        state = _block(state, j, ops, zero_s, STAGES, mma_o, FIRST, False)
    if (n_full < n_blocks) & (n_full > 0):  # the ragged last block, unless it was the first
        state = _block(state, n_full, ops, zero_s, STAGES, mma_o, FIRST, True)
    acc, p, m_i, l_i, alpha = state
    last = n_blocks - 1
    acc, p_op = _pv(acc, p, alpha, v_bufs, v_full, last, STAGES, mma_o)
    _take_turn(turns, n_blocks, FIRST)
    o_tok = warpgroup_mma(p_op, v_bufs.index(last % STAGES), acc, is_async=True)
    _pass_turn(turns)
    acc = warpgroup_mma_wait(0, deps=(o_tok, p_op))[0]
    mbarrier.arrive(v_empty.index(last % STAGES), count=1)
    return acc, l_i, m_i


@gluon.jit
def _store(acc, l_i, m_i, out, row0, n_q, mma_o: gl.constexpr, WRITE_REF: gl.constexpr):
    """o = acc / l (out dtype and, with WRITE_REF, FP32) and lse2 = m + log2(l) for rows row0.. of
    this head; rows >= n_q are not written."""
    o_ptr, oref_ptr, lse_ptr, stride_om, stride_oh, stride_rm, stride_rh = out
    ROWS: gl.constexpr = acc.type.shape[0]
    HEAD_DIM: gl.constexpr = acc.type.shape[1]
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, mma_o))[:, None]
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_o))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma_o))
    row_ok = (rows < n_q)[:, None]
    h = gl.program_id(1).to(gl.int64)
    r64 = rows.to(gl.int64)[:, None]
    gl.store(o_ptr + h * stride_oh + r64 * stride_om + cols[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok)
    if WRITE_REF:
        gl.store(oref_ptr + h * stride_rh + r64 * stride_rm + cols[None, :], o, mask=row_ok)
    lse_rows = row0 + gl.arange(0, ROWS, layout=l_i.type.layout)
    gl.store(lse_ptr + h * n_q + lse_rows, m_i + gl.log2(l_i), mask=lse_rows < n_q)


@gluon.jit
def _consumer(
    q_smem, turns, io, STAGES: gl.constexpr, WRITE_REF: gl.constexpr, WARPS: gl.constexpr, FIRST: gl.constexpr
):
    """One consumer: WARPS warps (warpgroups stacked along M) over the query rows of q_smem, which are
    the tile's first rows (FIRST) or the rows after them. `io` = (kv, bars, out, n_q, n_k, qk_scale)."""
    kv, bars, out, n_q, n_k, qk_scale = io
    ROWS: gl.constexpr = q_smem.type.shape[0]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = kv[0].type.shape[1]
    mma_s: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [WARPS, 1], [16, BLOCK_N, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [WARPS, 1], [16, HEAD_DIM, 16])
    acc, l_i, m_i = _attend((q_smem, kv, bars, turns, n_k, qk_scale), STAGES, mma_s, mma_o, FIRST)
    tiles: gl.constexpr = 1 if turns is None else 2
    row0 = gl.program_id(0) * (ROWS * tiles) + (0 if FIRST else ROWS)
    _store(acc, l_i, m_i, out, row0, n_q, mma_o, WRITE_REF)


@gluon.jit
def _second_consumer(q_smem, turns, io, STAGES: gl.constexpr, WRITE_REF: gl.constexpr):
    """The ping-pong's second consumer, a worker partition of one warpgroup: the tile's last rows."""
    _consumer(q_smem, (turns[1], turns[0]), io, STAGES, WRITE_REF, 4, False)


# One function on purpose: a Gluon kernel that allocates the rings and barriers its warp-specialised
# partitions share, with a fixed signature (top-level descriptors and do_not_specialize arguments).
@gluon.jit(do_not_specialize=["n_q", "n_k"])
def attention_fwd_ws_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_ptr,
    oref_ptr,
    lse_ptr,
    n_q,
    n_k,
    qk_scale,
    stride_om,
    stride_oh,
    stride_rm,
    stride_rh,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
    WRITE_REF: gl.constexpr,
    num_warps: gl.constexpr,
):
    """q/k/v descriptors over [rows, H * Dh] with [rows, Dh] blocks at column h * Dh -> o [n_q, H, Dh],
    lse2 [H, n_q]. Grid (cdiv(n_q, BLOCK_M), H).

    Without PINGPONG: num_warps consumer warps (the default partition) over q_desc's BLOCK_M rows,
    and one producer warp. With PINGPONG: num_warps = 4, q_desc's blocks are half the tile
    (BLOCK_M = 2 x its rows): the default partition and a worker warpgroup each take one half, and
    one producer warp loads both."""
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    TILES: gl.constexpr = 2 if PINGPONG else 1
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [TILES, ROWS, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=TILES)  # every consumer releases a slot
        mbarrier.init(v_empty.index(i), count=TILES)
    kv = (k_bufs, v_bufs)
    bars = (q_bar, k_full, v_full, k_empty, v_empty)
    out = (o_ptr, oref_ptr, lse_ptr, stride_om, stride_oh, stride_rm, stride_rh)
    descs = (q_desc, k_desc, v_desc)
    io = (kv, bars, out, n_q, n_k, qk_scale)
    if PINGPONG:
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(turns.index(0), count=1)
        mbarrier.init(turns.index(1), count=1)
        mine = (turns.index(0), turns.index(1))
        gl.warp_specialize(
            [
                (_consumer, (q_smem.index(0), mine, io, STAGES, WRITE_REF, 4, True)),
                (_second_consumer, (q_smem.index(1), mine, io, STAGES, WRITE_REF)),
                (_producer, (descs, (q_smem.index(0), q_smem.index(1)), kv, bars, n_k, STAGES)),
            ],
            [4, 1],
            [240, 24],
        )
    else:  # a literal list: Gluon takes the partitions only as one
        gl.warp_specialize(
            [
                (_consumer, (q_smem.index(0), None, io, STAGES, WRITE_REF, num_warps, True)),
                (_producer, (descs, (q_smem.index(0),), kv, bars, n_k, STAGES)),
            ],
            [1],
            [24],
        )


# ---- host side -----------------------------------------------------------------------------------


@functools.cache
def _smem_layout(rows: int, head_dim: int, dtype: torch.dtype) -> Any:
    return gl.NVMMASharedLayout.get_default_for(
        [rows, head_dim], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    )


def _desc(t: Tensor, rows: int) -> TensorDescriptor:
    """t [R, H, Dh] (heads side by side, 16-byte aligned rows) as a [R, H * Dh] descriptor of [rows, Dh] blocks."""
    r, h, dh = t.shape
    return TensorDescriptor(t, [r, h * dh], [t.stride(0), 1], [rows, dh], _smem_layout(rows, dh, t.dtype))


def attention_fwd_sm90(
    q: Tensor, k: Tensor, v: Tensor, scale_log2: float, out_dtype: torch.dtype, cfg: dict[str, Any]
) -> tuple[Tensor, Tensor, tuple[Tensor]]:
    """(o, o_ref, (lse2,)) as h3lab.triton.attention.attention_fwd returns them; the caller has checked
    the operands (bf16/fp16 [R, H, Dh], heads side by side) and passes qk_scale = scale * log2(e)."""
    (Q, H, Dh), K = q.shape, k.shape[0]
    o = torch.empty((Q, H, Dh), dtype=out_dtype, device=q.device)
    o_ref = o if out_dtype == F32 else torch.empty((Q, H, Dh), dtype=F32, device=q.device)
    lse = torch.empty((H, Q), dtype=F32, device=q.device)
    if Q == 0:
        return o, o_ref, (lse,)
    BM, BN, pingpong = cfg["BLOCK_M"], cfg["BLOCK_N"], bool(cfg.get("PINGPONG", False))
    grid = (-(-Q // BM), H)
    attention_fwd_ws_kernel[grid](
        _desc(q, BM // 2 if pingpong else BM),
        _desc(k, BN),
        _desc(v, BN),
        o,
        o_ref,
        lse,
        Q,
        K,
        scale_log2,
        o.stride(0),
        o.stride(1),
        o_ref.stride(0),
        o_ref.stride(1),
        STAGES=cfg.get("GLUON_STAGES", 2),
        PINGPONG=pingpong,
        WRITE_REF=o_ref is not o,
        num_warps=4 if pingpong else 8,
        maxnreg=MAXNREG,
        enable_fp_fusion=ATTENTION_FP_FUSION,
    )
    return o, o_ref, (lse,)


def variant(pingpong: bool, stages: int = 2) -> Variant:
    """One build at the real shapes' argument types (bf16 q/k/v/o, FP32 o_ref and lse2, Dh 128):
    ping-pong or one 8-warp consumer, `stages` deep (h3lab.bench.compile_pinned builds it)."""
    rows, warps = (64, 4) if pingpong else (128, 8)
    lq, lk = _smem_layout(rows, 128, torch.bfloat16), _smem_layout(128, 128, torch.bfloat16)
    types = {"q_desc": f"tensordesc<bf16[{rows},128],{lq!r}>", "k_desc": f"tensordesc<bf16[128,128],{lk!r}>"}
    types |= {"v_desc": f"tensordesc<bf16[128,128],{lk!r}>", "o_ptr": "*bf16", "oref_ptr": "*fp32"}
    types |= {"lse_ptr": "*fp32", "qk_scale": "fp32"}
    const = {"STAGES": stages, "PINGPONG": pingpong, "WRITE_REF": True, "num_warps": warps}
    what = f"gluon, head_dim 128, {'ping-pong' if pingpong else 'one consumer'}, {stages} stages"
    opts = {"num_warps": warps, "num_stages": 1, "maxnreg": MAXNREG, "enable_fp_fusion": ATTENTION_FP_FUSION}
    return Variant("attention_fwd", what, attention_fwd_ws_kernel, types, const, opts, align_pointers=False)


def variants(node: str) -> list[Variant]:
    """The pinned head_dim 128 forward when its entry says "IMPL": "gluon" (else none: the Triton
    kernel runs it, h3lab.triton.attention_fwd.variants)."""
    cfg = configs.pinned("attention_fwd", node)["by_head_dim"].get("128", {})
    if cfg.get("IMPL") != "gluon":
        return []
    return [variant(bool(cfg.get("PINGPONG", False)), cfg.get("GLUON_STAGES", 2))]
