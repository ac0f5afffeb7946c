"""A fused attention backward with dq summed in key-block order: a measured candidate, not the pinned path.

One program per (key block, head) computes dk, dv with attention_bwd_kv's operations (the same
bits; padded keys' p is zeroed too, which dk, dv of real keys never read) and, per query block,
dq's partial dS @ K over its key block. The partials of a query block are added into an FP32 dq
in ascending key-block order: a turn counter per (head, query block) lets key block j add only
after key block j - 1 has (acquire / release atomics). So a query row's dq = ((0 + P_0) + P_1) + ...
over key blocks, an order fixed by the key-block index alone: within the h3-parallel-v1 contract
(row-local, independent of the query split and the row count), but other bits than the pinned
split kernels' (which chain dS @ K through one accumulator).

It exists to measure what an ordered dq costs when the compute warps wait their turn themselves
(h3lab.bench.attention_fused_bwd); FlashAttention-3's deterministic backward hands the ordered adds
to a producer warp (asynchronous TMA reduce-add), which Triton does not let a kernel express.
Programs of one head run in launch order: key block j spins until j - 1 has added, which needs
j - 1 resident or done (CUDA dispatches a grid's blocks in order; FA3 relies on the same).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.triton.attention import LOG2E, _bwd_operands, _row_desc
from h3lab.triton.configs import cdiv

F32 = torch.float32


@triton.jit(do_not_specialize=["n_q", "n_k"])
def attention_bwd_fused_kernel(
    q_desc,
    do_desc,
    lse_ptr,
    delta_ptr,
    k_ptr,
    v_ptr,
    dk_ptr,
    dv_ptr,
    dq_ptr,
    turn_ptr,
    n_q,
    n_k,
    qk_scale,
    scale,
    stride_km,
    stride_kh,
    stride_vm,
    stride_vh,
    stride_gm,
    stride_gh,
    stride_qm,
    stride_qh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """dk, dv [n_k, H, D] FP32 of this key block; dq [n_q, H, D] FP32 (zeroed) += this key block's part,
    in key-block order; turn [H, cdiv(n_q, BLOCK_M)] int32 (zeroed) counts the key blocks added."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    col = h * HEAD_DIM
    h64 = h.to(tl.int64)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < n_k
    keys = offs_n.to(tl.int64)[:, None]
    # padded key rows load k = v = 0; their p is masked below so they add nothing to dq
    k = tl.load(k_ptr + h64 * stride_kh + keys * stride_km + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(v_ptr + h64 * stride_vh + keys * stride_vm + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    stat = h64 * n_q
    n_qb = tl.cdiv(n_q, BLOCK_M)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for i in range(n_qb):
        rows = offs_m + i * BLOCK_M
        row_ok = rows < n_q
        q = q_desc.load([i * BLOCK_M, col])
        do = do_desc.load([i * BLOCK_M, col])
        lse = tl.load(lse_ptr + stat + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + stat + rows, mask=row_ok, other=0.0)
        # _dkdv_step's operations (the same dk, dv bits), with dS kept for dq's part
        s2_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale
        p_t = tl.where(row_ok[None, :] & key_ok[:, None], tl.math.exp2(s2_t - lse[None, :]), 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PREC)
        part = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PREC)  # [BLOCK_M, Dh] over this key block
        turn = turn_ptr + h * n_qb + i
        while tl.atomic_cas(turn, j, j, sem="acquire") != j:
            pass
        ptrs = dq_ptr + h64 * stride_qh + rows.to(tl.int64)[:, None] * stride_qm + offs_d[None, :]
        tl.atomic_add(ptrs, part, mask=row_ok[:, None], sem="relaxed")
        tl.debug_barrier()  # every thread's adds issued before the turn passes on
        tl.atomic_xchg(turn, j + 1, sem="release")
    dk = dk * scale
    out = h64 * stride_gh + keys * stride_gm + offs_d[None, :]
    tl.store(dk_ptr + out, dk, mask=key_ok[:, None])
    tl.store(dv_ptr + out, dv, mask=key_ok[:, None])


def attention_bwd_fused(
    q: Tensor,
    do: Tensor,
    stats: Sequence[Tensor],
    delta: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    config: Mapping[str, Any],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq [Q, H, Dh], dk, dv [K, H, Dh]) FP32 under `config` (BLOCK_M, BLOCK_N, num_warps, num_stages):
    dk, dv are attention_bwd_kv's bytes with the same tile; dq is summed in key-block order."""
    q, do, k, v, lse, delta = _bwd_operands(q, do, stats, delta, k, v, scale)
    (Q, H, Dh), K = q.shape, k.shape[0]
    descs = [_row_desc(t, config["BLOCK_M"]) for t in (q, do)]
    if any(d is None for d in descs) or Q == 0:
        raise ValueError("attention_bwd_fused needs q and dO with heads side by side, 16-byte rows, Q > 0")
    dq = torch.zeros((Q, H, Dh), dtype=F32, device=q.device)
    dk = torch.empty((K, H, Dh), dtype=F32, device=q.device)
    dv = torch.empty((K, H, Dh), dtype=F32, device=q.device)
    turn = torch.zeros((H, cdiv(Q, config["BLOCK_M"])), dtype=torch.int32, device=q.device)
    dot_prec = "ieee" if q.dtype == F32 else "tf32"
    attention_bwd_fused_kernel[(cdiv(K, config["BLOCK_N"]), H)](
        *descs,
        lse,
        delta,
        k,
        v,
        dk,
        dv,
        dq,
        turn,
        Q,
        K,
        scale * LOG2E,
        scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        dk.stride(0),
        dk.stride(1),
        dq.stride(0),
        dq.stride(1),
        HEAD_DIM=Dh,
        BLOCK_M=config["BLOCK_M"],
        BLOCK_N=config["BLOCK_N"],
        DOT_PREC=dot_prec,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return dq.mul_(scale), dk, dv
