# Whole on purpose: three kernels that share their tile loads and step functions, and their builds.
"""Attention backward kernels: delta = rowsum(dO * O), dq per query block, dk/dv per key block.

References: h3lab.ops.attention.attention_delta / attention_bwd_q / attention_bwd_kv.
Launchers: h3lab.triton.attention.

All three recompute p = exp2(s2 - lse2) from the forward's base-2 log-sum-exp (s2 = q . k * qk_scale)
and accumulate in FP32; dS and P enter the tensor core in the input dtype (bf16 on GPU). The
softmax scale that turns d(s2-space) into d(q . k) is applied once, to the FP32 accumulator in the
epilogue (dq *= scale, dk *= scale), as in the reference.

The dq and dk/dv kernels come twice: with pointer loads, and with TMA descriptor loads of the
operands their loop walks (k, v for dq; q, dO for dk/dv). Both run the same step functions
(_dq_step, _dkdv_step) on the loaded tiles, so they give the same bits; the launcher takes the TMA
kernel when the pinned config says "TMA" and the operands have a descriptor.

Invariance, as in attention_fwd: the dq program of a query walks every key block ascending, the
dk/dv program of a key walks every query block of the canonical query set ascending; rows are
never mixed by any operation, so a query's dq depends only on it and the keys, a key's dk/dv only
on it and the queries. No atomics, no split over the reduced axis. Row counts are not specialised.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from h3lab.triton import configs
from h3lab.triton.attention_fwd import arg_types
from h3lab.triton.variant import ATTENTION_FP_FUSION, Variant


@triton.jit(do_not_specialize=["n_q"])
def attention_delta_kernel(
    do_ptr,
    o_ptr,
    delta_ptr,
    n_q,
    stride_dm,
    stride_dh,
    stride_om,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """delta[h, i] = sum_d dO[i, h, d] * O[i, h, d] in FP32: one fixed per-row tree (tl.sum)."""
    offs_m = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < n_q
    rows = offs_m.to(tl.int64)[:, None]
    do = tl.load(do_ptr + h * stride_dh + rows * stride_dm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    o = tl.load(o_ptr + h * stride_oh + rows * stride_om + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    tl.store(delta_ptr + h * n_q + offs_m, tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1), mask=row_ok)


@triton.jit
def _query_tiles(query, query_strides, h, n_q, offs_m, offs_d):
    """A query block's resident tiles: q, dO [BLOCK_M, Dh], lse2, delta [BLOCK_M] of query (q, dO, lse2,
    delta; q's and dO's (row, head) strides). Padded query rows load q = dO = 0, lse = delta = 0: p = 1,
    dS = 0, no inf/NaN, never stored. h is an int64 head index."""
    q_ptr, do_ptr, lse_ptr, delta_ptr = query
    stride_qm, stride_qh, stride_dm, stride_dh = query_strides
    row_ok = offs_m < n_q
    rows = offs_m.to(tl.int64)[:, None]  # rows * stride exceeds int32 past ~300k rows of 7168
    q = tl.load(q_ptr + h * stride_qh + rows * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + h * stride_dh + rows * stride_dm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + h * n_q + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + h * n_q + offs_m, mask=row_ok, other=0.0)
    return q, do, lse, delta, row_ok, rows


@triton.jit
def _key_tiles(keys, key_strides, h, n_k, offs_n, offs_d):
    """A key block's resident tiles: k, v [BLOCK_N, Dh] of keys (k, v; their (row, head) strides). Padded
    key rows load k = v = 0: their columns of dS and P are harmless to dk, dv and never stored. h is an
    int64 head index."""
    k_ptr, v_ptr = keys
    stride_km, stride_kh, stride_vm, stride_vh = key_strides
    key_ok = offs_n < n_k
    key_rows = offs_n.to(tl.int64)[:, None]
    k = tl.load(k_ptr + h * stride_kh + key_rows * stride_km + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(v_ptr + h * stride_vh + key_rows * stride_vm + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    return k, v, key_ok, key_rows


@triton.jit
def _dq_step(dq, q, do, lse, delta, k, v, key_ok, qk_scale, MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    """One key block of dq on tiles already loaded (padded keys load as zeros; MASK zeroes their p)."""
    s2 = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    p = tl.math.exp2(s2 - lse[:, None])
    if MASK:
        p = tl.where(key_ok[None, :], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)


@triton.jit
def _dq_key_block(
    dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_n, n_k, qk_scale, MASK: tl.constexpr, DOT_PREC: tl.constexpr
):
    if MASK:
        key_ok = offs_n < n_k
        k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
    else:
        key_ok = offs_n  # unused: MASK is off
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return _dq_step(dq, q, do, lse, delta, k, v, key_ok, qk_scale, MASK, DOT_PREC)


@triton.jit(do_not_specialize=["n_q", "n_k"])
def attention_bwd_q_kernel(
    query,
    keys,
    dq_ptr,
    n_q,
    n_k,
    qk_scale,
    scale,
    query_strides,
    key_strides,
    dq_strides,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """dq [n_q, H, D] FP32 = scale * sum over key blocks of dS @ K; query (q, dO, lse2, delta: lse2/delta
    [H, n_q] contiguous), keys (k, v); the strides are each tensor's (row, head) strides."""
    k_ptr, v_ptr = keys
    stride_km, stride_kh, stride_vm, stride_vh = key_strides
    stride_gm, stride_gh = dq_strides
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q, do, lse, delta, row_ok, rows = _query_tiles(query, query_strides, h, n_q, offs_m, offs_d)
    k_ptrs = k_ptr + h * stride_kh + offs_n[:, None] * stride_km + offs_d[None, :]
    v_ptrs = v_ptr + h * stride_vh + offs_n[:, None] * stride_vm + offs_d[None, :]

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_full = n_k // BLOCK_N
    for _ in range(n_full):
        dq = _dq_key_block(dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_n, n_k, qk_scale, False, DOT_PREC)
        k_ptrs += BLOCK_N * stride_km
        v_ptrs += BLOCK_N * stride_vm
    if n_full * BLOCK_N < n_k:
        dq = _dq_key_block(
            dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_n + n_full * BLOCK_N, n_k, qk_scale, True, DOT_PREC
        )
    dq = dq * scale  # the one scaling of dq, on the FP32 sum (reference: chain_bmm(ds, k) * scale)
    tl.store(dq_ptr + h * stride_gh + rows * stride_gm + offs_d[None, :], dq, mask=row_ok[:, None])


@triton.jit
def _dkdv_grads(dk, dv, k, v, q, do, lse, delta, row_ok, qk_scale, MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    """One query block of dk, dv on tiles already loaded (padded queries load as zeros; MASK zeroes their
    p); returns dk, dv and dS^T in the input dtype (the fused candidate's dq part reads it)."""
    s2_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [BLOCK_N, BLOCK_M] = s2^T
    p_t = tl.math.exp2(s2_t - lse[None, :])
    if MASK:
        p_t = tl.where(row_ok[None, :], p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PREC)
    return dk, dv, ds_t


@triton.jit
def _dkdv_step(dk, dv, k, v, q, do, lse, delta, row_ok, qk_scale, MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    dk, dv, _ = _dkdv_grads(dk, dv, k, v, q, do, lse, delta, row_ok, qk_scale, MASK, DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_query_block(
    dk,
    dv,
    k,
    v,
    q_ptrs,
    do_ptrs,
    lse_ptrs,
    delta_ptrs,
    offs_m,
    n_q,
    qk_scale,
    MASK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    if MASK:
        row_ok = offs_m < n_q
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_ptrs, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)
    else:
        row_ok = offs_m  # unused: MASK is off
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
        lse = tl.load(lse_ptrs)
        delta = tl.load(delta_ptrs)
    return _dkdv_step(dk, dv, k, v, q, do, lse, delta, row_ok, qk_scale, MASK, DOT_PREC)


# One function on purpose: a jit kernel; the key block's dk, dv and the query cursors live across its
# loop and masked last block, and its signature is fixed (do_not_specialize arguments).
@triton.jit(do_not_specialize=["n_q", "n_k"])
def attention_bwd_kv_kernel(
    query,
    keys,
    grads,
    n_q,
    n_k,
    qk_scale,
    scale,
    query_strides,
    key_strides,
    grad_strides,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """grads dk, dv [n_k, H, D] FP32 (same strides) for this key block, summed over all n_q queries
    ascending; query (q, dO, lse2, delta), keys (k, v); the strides are each tensor's (row, head) strides."""
    q_ptr, do_ptr, lse_ptr, delta_ptr = query
    dk_ptr, dv_ptr = grads
    stride_qm, stride_qh, stride_dm, stride_dh = query_strides
    stride_gm, stride_gh = grad_strides
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    k, v, key_ok, key_rows = _key_tiles(keys, key_strides, h, n_k, offs_n, offs_d)
    q_ptrs = q_ptr + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    do_ptrs = do_ptr + h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :]
    lse_ptrs = lse_ptr + h * n_q + offs_m
    delta_ptrs = delta_ptr + h * n_q + offs_m

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    n_full = n_q // BLOCK_M
    for _ in range(n_full):
        dk, dv = _dkdv_query_block(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, offs_m, n_q, qk_scale, False, DOT_PREC
        )
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dm
        lse_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    if n_full * BLOCK_M < n_q:
        dk, dv = _dkdv_query_block(
            dk,
            dv,
            k,
            v,
            q_ptrs,
            do_ptrs,
            lse_ptrs,
            delta_ptrs,
            offs_m + n_full * BLOCK_M,
            n_q,
            qk_scale,
            True,
            DOT_PREC,
        )
    dk = dk * scale  # the one scaling of dk, on the FP32 sum (reference: chain_bmm(ds^T, q) * scale)
    out = h * stride_gh + key_rows * stride_gm + offs_d[None, :]
    tl.store(dk_ptr + out, dk, mask=key_ok[:, None])
    tl.store(dv_ptr + out, dv, mask=key_ok[:, None])


@triton.jit(do_not_specialize=["n_q", "n_k"])
def attention_bwd_q_tma_kernel(
    query,
    k_desc,
    v_desc,
    dq_ptr,
    n_q,
    n_k,
    qk_scale,
    scale,
    query_strides,
    dq_strides,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """attention_bwd_q_kernel with k, v through TMA descriptors over [K, H * Dh] (block [BLOCK_N, Dh] at
    column h * Dh): the same arithmetic per row; keys past n_k load as zeros (the descriptor's bounds)."""
    stride_gm, stride_gh = dq_strides
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    col = h * HEAD_DIM
    h64 = h.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q, do, lse, delta, row_ok, rows = _query_tiles(query, query_strides, h64, n_q, offs_m, offs_d)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_full = n_k // BLOCK_N
    for j in range(n_full):
        k = k_desc.load([j * BLOCK_N, col])
        v = v_desc.load([j * BLOCK_N, col])
        dq = _dq_step(dq, q, do, lse, delta, k, v, offs_n, qk_scale, False, DOT_PREC)
    if n_full * BLOCK_N < n_k:
        k = k_desc.load([n_full * BLOCK_N, col])
        v = v_desc.load([n_full * BLOCK_N, col])
        dq = _dq_step(dq, q, do, lse, delta, k, v, offs_n + n_full * BLOCK_N < n_k, qk_scale, True, DOT_PREC)
    dq = dq * scale
    tl.store(dq_ptr + h64 * stride_gh + rows * stride_gm + offs_d[None, :], dq, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["n_q", "n_k"])
def attention_bwd_kv_tma_kernel(
    q_desc,
    do_desc,
    stats,
    keys,
    grads,
    n_q,
    n_k,
    qk_scale,
    scale,
    key_strides,
    grad_strides,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """attention_bwd_kv_kernel with q, dO through TMA descriptors over [Q, H * Dh] (block [BLOCK_M, Dh] at
    column h * Dh), stats (lse2, delta) by pointer: the same arithmetic per key; queries past n_q load as
    zeros (the descriptor's bounds)."""
    lse_ptr, delta_ptr = stats
    dk_ptr, dv_ptr = grads
    stride_gm, stride_gh = grad_strides
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.program_id(1)
    col = h * HEAD_DIM
    h64 = h.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    k, v, key_ok, key_rows = _key_tiles(keys, key_strides, h64, n_k, offs_n, offs_d)
    stat = h64 * n_q

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    n_full = n_q // BLOCK_M
    for i in range(n_full):
        q = q_desc.load([i * BLOCK_M, col])
        do = do_desc.load([i * BLOCK_M, col])
        lse = tl.load(lse_ptr + stat + i * BLOCK_M + offs_m)
        delta = tl.load(delta_ptr + stat + i * BLOCK_M + offs_m)
        dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse, delta, offs_m, qk_scale, False, DOT_PREC)
    if n_full * BLOCK_M < n_q:
        rows = offs_m + n_full * BLOCK_M
        row_ok = rows < n_q
        q = q_desc.load([n_full * BLOCK_M, col])
        do = do_desc.load([n_full * BLOCK_M, col])
        lse = tl.load(lse_ptr + stat + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + stat + rows, mask=row_ok, other=0.0)
        dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse, delta, row_ok, qk_scale, True, DOT_PREC)
    dk = dk * scale
    out = h64 * stride_gh + key_rows * stride_gm + offs_d[None, :]
    tl.store(dk_ptr + out, dk, mask=key_ok[:, None])
    tl.store(dv_ptr + out, dv, mask=key_ok[:, None])


# ---- the builds compile_pinned compiles ----------------------------------------------------------

KERNELS = {  # pinned entry: (pointer kernel, TMA kernel)
    "attention_bwd_q": (attention_bwd_q_kernel, attention_bwd_q_tma_kernel),
    "attention_bwd_kv": (attention_bwd_kv_kernel, attention_bwd_kv_tma_kernel),
}


def variant(kernel: str, cfg: dict[str, Any], head_dim: int, what: str = "", aligned_strides: bool = False) -> Variant:
    """The dq ("attention_bwd_q") or dk/dv ("attention_bwd_kv") kernel under `cfg` (a pinned entry or a
    candidate): the TMA kernel when it says "TMA". `aligned_strides`: strides taken as multiples of 16."""
    if kernel not in KERNELS:
        raise ValueError(f"attention_bwd variant: kernel {kernel!r}; allowed: {sorted(KERNELS)}")
    if cfg.get("IMPL") == "gluon":  # dq by the Gluon fused kernel without dk, dv (h3lab.triton.attention)
        from h3lab.triton.attention_fused_sm90 import variant as gluon_variant

        return gluon_variant(dkv=False)
    tma = bool(cfg.get("TMA"))
    fn = KERNELS[kernel][1 if tma else 0]
    query, stats, keys = ("*bf16", "*bf16", "*fp32", "*fp32"), ("*fp32", "*fp32"), ("*bf16", "*bf16")
    if kernel == "attention_bwd_q":
        types = arg_types(cfg, head_dim, ("k_desc", "v_desc") if tma else ()) | {"query": query, "dq_ptr": "*fp32"}
        types |= {"keys": keys, "key_strides": ("i32",) * 4} if not tma else {}
        types |= {"query_strides": ("i32",) * 4, "dq_strides": ("i32",) * 2}
    else:
        types = arg_types(cfg, head_dim, ("q_desc", "do_desc") if tma else ()) | {"keys": keys}
        types |= {"stats": stats} if tma else {"query": query, "query_strides": ("i32",) * 4}
        types |= {"grads": ("*fp32", "*fp32"), "key_strides": ("i32",) * 4, "grad_strides": ("i32",) * 2}
    const = {"HEAD_DIM": head_dim, "DOT_PREC": "tf32", "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}
    aligned = tuple(n for n in fn.arg_names if "strides" in n) if aligned_strides else ()
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "enable_fp_fusion": ATTENTION_FP_FUSION}
    return Variant(kernel, what, fn, types, const, opts, aligned)


def variants(node: str) -> list[Variant]:
    """delta, dq and dk/dv at every pinned head dim (a Gluon dq entry: dq alone and fused)."""
    out = []
    for kernel in ("attention_delta", *KERNELS):
        by_dim = configs.pinned(kernel, node)["by_head_dim"]
        for dh in sorted(by_dim, key=int):
            cfg = by_dim[dh]
            if kernel != "attention_delta":
                out.append(variant(kernel, cfg, int(dh), f"head_dim {dh}"))
                if cfg.get("IMPL") == "gluon":  # and with dk, dv: the fused launch (attention.attention_bwd)
                    from h3lab.triton.attention_fused_sm90 import variant as gluon_variant

                    out.append(gluon_variant(dkv=True))
                continue
            types = {"do_ptr": "*bf16", "o_ptr": "*fp32", "delta_ptr": "*fp32"}
            const = {"HEAD_DIM": int(dh), "BLOCK_R": cfg["BLOCK_R"]}
            opts = {"num_warps": cfg["num_warps"], "num_stages": cfg.get("num_stages", 1)}
            opts |= {"enable_fp_fusion": ATTENTION_FP_FUSION}
            out.append(Variant(kernel, f"head_dim {dh}", attention_delta_kernel, types, const, opts))
    return out
