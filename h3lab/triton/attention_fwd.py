"""Attention forward kernel (FlashAttention-2 order): one program per (query block, head).

Reference: h3lab.ops.attention.attention_fwd (same softmax, chains instead of tensor-core tiles).
Launcher: h3lab.triton.attention.attention_fwd.

Why a query row's bits never depend on the call: the program walks the key blocks 0, BLOCK_N,
2*BLOCK_N, ... of the full key set in ascending order (no split-KV, no atomics), and every value
of row i (scores, running max, running sum, accumulator) is computed by element- or row-local
operations whose order is fixed by the compiled tile shape alone: MMA sums over head channels in
the instruction's fixed k order, `tl.max`/`tl.sum` reduce a row with one fixed tree per row. So the
row's position inside the tile, the number of rows in the call and the other heads don't enter.
The key count is not a specialised argument (`do_not_specialize`), so one binary serves every Q, K.

Softmax runs in base 2 (exp2 is the hardware instruction): s2 = (q . k) * qk_scale with
qk_scale = scale * log2(e) rounded once to FP32 by the launcher; lse2 = m2 + log2(l) is the one
statistic the backward needs to replay p = exp2(s2 - lse2).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from h3lab.triton import configs
from h3lab.triton.variant import ATTENTION_FP_FUSION, Variant


@triton.jit
def _fwd_key_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_n, n_k, qk_scale, MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    """One key block of the online softmax; MASK only for the ragged last block (keys >= n_k)."""
    if MASK:
        key_ok = offs_n < n_k
        k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N] FP32
    if MASK:
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
    # max(qk) * qk_scale == max(qk * qk_scale) exactly (qk_scale > 0, rounding is monotone): one
    # multiply per row instead of per score; the per-score multiply can then fuse into the
    # subtraction (FFMA). Fused or not is decided once per compiled binary, the same for every row.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # finite: every block holds >= 1 real key
    alpha = tl.math.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # P enters the tensor core in the input dtype (bf16 on GPU, as every flash kernel does);
    # the accumulator stays FP32
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["n_q", "n_k"])
def attention_fwd_kernel(
    inputs,
    outputs,
    n_q,
    n_k,
    qk_scale,
    input_strides,
    output_strides,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_REF: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """inputs q [n_q, H, D], k/v [n_k, H, D] (last dim contiguous) -> outputs o [n_q, H, D], o_ref (FP32),
    lse2 [H, n_q] (contiguous); the strides are each tensor's (row, head) strides, in that order."""
    q_ptr, k_ptr, v_ptr = inputs
    o_ptr, oref_ptr, lse_ptr = outputs
    stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh = input_strides
    stride_om, stride_oh, stride_rm, stride_rh = output_strides
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < n_q
    rows = offs_m.to(tl.int64)[:, None]  # rows * stride exceeds int32 past ~300k rows of 7168

    q = tl.load(q_ptr + h * stride_qh + rows * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_ptrs = k_ptr + h * stride_kh + offs_n[:, None] * stride_km + offs_d[None, :]
    v_ptrs = v_ptr + h * stride_vh + offs_n[:, None] * stride_vm + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_full = n_k // BLOCK_N
    for _ in range(n_full):  # full key blocks, unmasked
        acc, l_i, m_i = _fwd_key_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_n, n_k, qk_scale, False, DOT_PREC)
        k_ptrs += BLOCK_N * stride_km
        v_ptrs += BLOCK_N * stride_vm
    if n_full * BLOCK_N < n_k:  # the ragged last block: depends on n_k only, never on the queries
        acc, l_i, m_i = _fwd_key_block(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_n + n_full * BLOCK_N, n_k, qk_scale, True, DOT_PREC
        )

    o = acc / l_i[:, None]
    tl.store(
        o_ptr + h * stride_oh + rows * stride_om + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None]
    )
    if WRITE_REF:  # the FP32 output the backward's delta = rowsum(dO * O) reads
        tl.store(oref_ptr + h * stride_rh + rows * stride_rm + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(lse_ptr + h * n_q + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _fwd_step(acc, l_i, m_i, q, k, v, key_ok, qk_scale, MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    """_fwd_key_block's arithmetic on tiles already loaded: the same operations in the same order."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if MASK:
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["n_q", "n_k"])
def attention_fwd_tma_kernel(
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
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_REF: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """attention_fwd_kernel with q, k, v through TMA descriptors over [rows, H * Dh] (block [rows, Dh]
    at column h * Dh); the same arithmetic per row. Rows past n_q / n_k load as zeros (the descriptor's
    bounds), as the masked pointer loads did; the ragged key block masks its scores to -inf."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    col = h * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < n_q
    rows = offs_m.to(tl.int64)[:, None]
    q = q_desc.load([pid_m * BLOCK_M, col])

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_full = n_k // BLOCK_N
    for j in range(n_full):  # full key blocks, unmasked
        k = k_desc.load([j * BLOCK_N, col])
        v = v_desc.load([j * BLOCK_N, col])
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k, v, offs_n, qk_scale, False, DOT_PREC)
    if n_full * BLOCK_N < n_k:  # the ragged last block: depends on n_k only, never on the queries
        k = k_desc.load([n_full * BLOCK_N, col])
        v = v_desc.load([n_full * BLOCK_N, col])
        key_ok = offs_n + n_full * BLOCK_N < n_k
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k, v, key_ok, qk_scale, True, DOT_PREC)

    o = acc / l_i[:, None]
    h64 = h.to(tl.int64)
    tl.store(
        o_ptr + h64 * stride_oh + rows * stride_om + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None]
    )
    if WRITE_REF:
        tl.store(oref_ptr + h64 * stride_rh + rows * stride_rm + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(lse_ptr + h64 * n_q + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


# ---- the builds compile_pinned compiles ----------------------------------------------------------


def arg_types(cfg: dict[str, Any], head_dim: int, tma: tuple[str, ...]) -> dict[str, str]:
    """The types of the attention kernels' arguments at the real calls, by name: bf16 q, k, v, dO (the
    descriptors named in `tma` over [rows, H * Dh] with [block rows, Dh] blocks), FP32 reference
    output, statistics and gradients, FP32 scales."""
    rows = {"q_desc": cfg["BLOCK_M"], "do_desc": cfg["BLOCK_M"], "k_desc": cfg["BLOCK_N"], "v_desc": cfg["BLOCK_N"]}
    return {n: f"tensordesc<bf16[{rows[n]}, {head_dim}]>" for n in tma} | {"qk_scale": "fp32", "scale": "fp32"}


def variant(cfg: dict[str, Any], head_dim: int, what: str = "", aligned_strides: bool = False) -> Variant:
    """The forward under `cfg` (a pinned entry or a candidate): the TMA kernel when it says "TMA".
    `aligned_strides`: strides taken as multiples of 16, as at the real shapes."""
    if cfg.get("TMA"):
        fn = attention_fwd_tma_kernel
        types = arg_types(cfg, head_dim, ("q_desc", "k_desc", "v_desc"))
        types |= {"o_ptr": "*bf16", "oref_ptr": "*fp32", "lse_ptr": "*fp32"}
    else:
        fn = attention_fwd_kernel
        types = arg_types(cfg, head_dim, ()) | {"inputs": ("*bf16",) * 3, "outputs": ("*bf16", "*fp32", "*fp32")}
        types |= {"input_strides": ("i32",) * 6, "output_strides": ("i32",) * 4}
    const = {"HEAD_DIM": head_dim, "DOT_PREC": "tf32", "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}
    const |= {"WRITE_REF": True}
    aligned = tuple(n for n in fn.arg_names if "stride" in n) if aligned_strides else ()
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "enable_fp_fusion": ATTENTION_FP_FUSION}
    return Variant("attention_fwd", what, fn, types, const, opts, aligned)


def variants(node: str) -> list[Variant]:
    """The forward at every pinned head dim."""
    by_dim = configs.pinned("attention_fwd", node)["by_head_dim"]
    return [variant(by_dim[dh], int(dh), f"head_dim {dh}") for dh in sorted(by_dim, key=int)]
