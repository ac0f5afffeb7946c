"""Attention launchers (Backend protocol): forward, delta, dq, dk/dv over keys in canonical order, and
the whole backward of every query and key (`attention_bwd`: one fused Gluon launch on sm90).

Kernels: h3lab.triton.attention_fwd (forward) and h3lab.triton.attention_bwd (delta, dq, dk/dv);
the forward, dq and dk/dv kernels each come as a pointer kernel and a TMA kernel, the latter used
when the config says "TMA": true (descriptor loads of the operands walked in the loop: k, v for the
forward and dq; q, dO for dk/dv). Reference arithmetic: h3lab.ops.attention. Pinned tiles:
kernels/<node>.json, keys attention_fwd, attention_delta, attention_bwd_q, attention_bwd_kv, each
{"by_head_dim": {"<Dh>": config}}. A TMA config whose operands a descriptor cannot walk (rows not
16-byte aligned, heads not side by side) runs the pointer kernel with the same tile instead: the
same arithmetic, so the same bits (tests/test_kernels_attention_long.py checks the equality, in the
interpreter and on the GPU).

Dimension legend: Q query rows, K key rows (active keys, canonical order), H heads, Dh head_dim.
Layout: q [Q, H, Dh], k/v [K, H, Dh], head_dim contiguous, any row/head stride.

Contract (tested in tests/test_kernels_attention.py): a query row's o, lse2, delta and dq depend
only on that row and the whole key set; a key row's dk/dv only on that key and the whole query set
(passed in canonical order); a head's results only on that head; repeat runs are bitwise equal.
Statistics: `stats = (lse2,)`, lse2 [H, Q] FP32 the base-2 log-sum-exp of s2 = (q . k) * scale * log2(e).
`o_ref` is the FP32 output before rounding (o itself when out_dtype is FP32): delta = rowsum(dO * O)
then uses the unrounded O, as the reference does (costs one extra FP32 [Q, H, Dh] write + read,
small beside fwd+bwd: the kernels' timings are in reports/h200/attention.json).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from h3lab.triton.attention_args import (
    F32,
    LOG2E,
    bwd_operands,
    check_inputs,
    check_scale,
    lastdim,
    strides,
)
from h3lab.triton.attention_bwd import (
    attention_bwd_kv_kernel,
    attention_bwd_kv_tma_kernel,
    attention_bwd_q_kernel,
    attention_bwd_q_tma_kernel,
    attention_delta_kernel,
)
from h3lab.triton.attention_fwd import attention_fwd_kernel, attention_fwd_tma_kernel
from h3lab.triton.configs import cdiv, interpreting, node_of, pinned
from h3lab.triton.variant import ATTENTION_FP_FUSION

KERNELS = ("attention_fwd", "attention_delta", "attention_bwd_q", "attention_bwd_kv")
# the keys each kernel's configuration may carry (a candidate with another key is refused, not ignored)
CONFIG_KEYS = {
    "attention_fwd": {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "TMA", "IMPL", "PINGPONG", "GLUON_STAGES"},
    "attention_delta": {"BLOCK_R", "num_warps", "num_stages"},
    "attention_bwd_q": {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "TMA", "IMPL"},
    "attention_bwd_kv": {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "TMA"},
}


def config_for(kernel: str, head_dim: int, node: str) -> dict[str, Any]:
    """The pinned configuration of one attention kernel for `head_dim` on `node`; raises if none."""
    assert kernel in KERNELS, kernel
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"no pinned configuration for head_dim={head_dim}: must be a power of two >= 16")
    by_dim = pinned(kernel, node)["by_head_dim"]
    if str(head_dim) not in by_dim:
        allowed = sorted(int(d) for d in by_dim)
        raise ValueError(f"no pinned configuration for head_dim={head_dim} ({kernel} on {node}); allowed: {allowed}")
    return dict(by_dim[str(head_dim)])


def _launch_cfg(kernel: str, x: Tensor, node: str | None, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """`config` overrides the pinned one (benchmarks of candidates); production passes None."""
    cfg = dict(config) if config is not None else config_for(kernel, x.shape[-1], node or node_of(x.device))
    unknown = set(cfg) - CONFIG_KEYS[kernel] - {"comment"}
    if unknown:
        raise ValueError(f"{kernel} config keys {sorted(unknown)} unknown; allowed: {sorted(CONFIG_KEYS[kernel])}")
    return cfg


def _row_desc(t: Tensor, block_rows: int) -> TensorDescriptor | None:
    """A TMA descriptor over [rows, H * Dh] with [block_rows, Dh] blocks (head h at column h * Dh),
    when t [rows, H, Dh] has its heads side by side and 16-byte aligned rows; else None."""
    rows, heads, dh = t.shape
    aligned = t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
    overlapping = rows > 1 and t.stride(0) < heads * dh  # expanded or overlapping rows: no descriptor
    if rows == 0 or t.stride(2) != 1 or (heads > 1 and t.stride(1) != dh) or not aligned or overlapping:
        return None
    return TensorDescriptor(t, [rows, heads * dh], [t.stride(0), 1], [block_rows, dh])


def _runs_gluon(cfg: Mapping[str, Any], q: Tensor) -> bool:
    """Whether the warp-specialised Gluon forward (h3lab.triton.attention_fwd_sm90) takes this call:
    "IMPL": "gluon" with "TMA": true, a compiled run on an sm90 device. The caller has found TMA
    descriptors for q, k, v; without them the Triton kernels run the config's tile with its
    num_warps and num_stages, with the same bits (the GPU tests compare the forwards byte for byte).
    The Gluon kernel's own warps follow from "PINGPONG" and its ring depth is "GLUON_STAGES" (2 or
    3, default 2). A Gluon config the kernel cannot run raises."""
    impl = cfg.get("IMPL", "triton")
    if impl not in ("triton", "gluon"):
        raise ValueError(f"attention_fwd IMPL {impl!r}; allowed: 'triton', 'gluon'")
    if impl == "triton" or interpreting():
        return False
    cap = torch.cuda.get_device_capability(q.device)
    if cap != (9, 0):
        raise ValueError(f"attention_fwd IMPL gluon: device capability {cap}; allowed: (9, 0) (sm90)")
    allowed = {"BLOCK_M": [128], "BLOCK_N": [128], "TMA": [True], "GLUON_STAGES": [2, 3]}
    for key, values in allowed.items():
        value = cfg.get(key, 2 if key == "GLUON_STAGES" else None)
        if value not in values:
            raise ValueError(f"attention_fwd IMPL gluon: {key}={value}; allowed: {values}")
    if q.shape[-1] != 128:
        raise ValueError(f"attention_fwd IMPL gluon: head_dim {q.shape[-1]}; allowed: 128")
    return True


def _bwd_gluon(cfg: Mapping[str, Any], q: Tensor) -> bool:
    """Whether dq is the Gluon fused kernel's (h3lab.triton.attention_fused_sm90): "IMPL": "gluon".
    It has no other kernel with its bits (dq's partials added per key block, not chained), so a call
    it cannot run raises: the interpreter, a device other than sm90, another tile, dtype or head dim."""
    impl = cfg.get("IMPL", "triton")
    if impl not in ("triton", "gluon"):
        raise ValueError(f"attention_bwd_q IMPL {impl!r}; allowed: 'triton', 'gluon'")
    if impl == "triton":
        return False
    if interpreting() or q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        raise ValueError(f"attention_bwd_q IMPL gluon on {q.device}; allowed: a compiled run on an sm90 GPU")
    got = {"BLOCK_M": cfg.get("BLOCK_M"), "BLOCK_N": cfg.get("BLOCK_N"), "head_dim": q.shape[-1], "dtype": q.dtype}
    want = {"BLOCK_M": 64, "BLOCK_N": 128, "head_dim": 128, "dtype": torch.bfloat16}
    if got != want:
        raise ValueError(f"attention_bwd_q IMPL gluon: {got}; allowed: {want}")
    return True


def _dot_precision(dtype: torch.dtype) -> str:
    # FP32 operands must not silently become TF32 (10-bit mantissa); bf16/fp16 ignore the flag
    return "ieee" if dtype == F32 else "tf32"


def attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    out_dtype: torch.dtype,
    *,
    node: str | None = None,
    config: Mapping[str, Any] | None = None,
) -> tuple[Tensor, Tensor, tuple[Tensor]]:
    """(o [Q, H, Dh] out_dtype, o_ref [Q, H, Dh] FP32, (lse2 [H, Q] FP32,)) of softmax(q k^T * scale) v."""
    check_inputs(q, k, v)
    check_scale(scale)
    if out_dtype not in (torch.bfloat16, torch.float16, F32):
        raise ValueError(f"out_dtype {out_dtype} not supported; allowed: torch.bfloat16, torch.float16, torch.float32")
    q, k, v = lastdim(q), lastdim(k), lastdim(v)
    (Q, H, Dh), K = q.shape, k.shape[0]
    cfg = _launch_cfg("attention_fwd", q, node, config)
    o = torch.empty((Q, H, Dh), dtype=out_dtype, device=q.device)
    o_ref = o if out_dtype == F32 else torch.empty((Q, H, Dh), dtype=F32, device=q.device)
    lse = torch.empty((H, Q), dtype=F32, device=q.device)
    if Q == 0:
        return o, o_ref, (lse,)
    grid = (cdiv(Q, cfg["BLOCK_M"]), H)
    tma = cfg.get("TMA", False)  # descriptors only for a TMA config: each costs host time per call
    descs = [_row_desc(t, cfg[b]) for t, b in ((q, "BLOCK_M"), (k, "BLOCK_N"), (v, "BLOCK_N"))] if tma else [None]
    if all(d is not None for d in descs) and _runs_gluon(cfg, q):
        from h3lab.triton.attention_fwd_sm90 import attention_fwd_sm90  # Gluon (Hopper only): imported where it runs

        return attention_fwd_sm90(q, k, v, scale * LOG2E, out_dtype, cfg)
    if all(d is not None for d in descs):
        _fwd_tma(grid, descs, (o, o_ref, lse), Q, K, scale * LOG2E, cfg, q.dtype)
    else:
        _fwd_pointers(grid, (q, k, v), (o, o_ref, lse), Q, K, scale * LOG2E, cfg)
    return o, o_ref, (lse,)


def _fwd_tma(
    grid: tuple[int, int],
    descs: list[TensorDescriptor],
    outputs: tuple[Tensor, Tensor, Tensor],
    Q: int,
    K: int,
    qk_scale: float,
    cfg: Mapping[str, Any],
    dtype: torch.dtype,
) -> None:
    """attention_fwd_tma_kernel: q, k, v through their row descriptors into (o, o_ref, lse2); o_ref is
    written only when it is not o (out_dtype other than FP32)."""
    o, o_ref, lse = outputs
    attention_fwd_tma_kernel[grid](
        *descs,
        o,
        o_ref,
        lse,
        Q,
        K,
        qk_scale,
        o.stride(0),
        o.stride(1),
        o_ref.stride(0),
        o_ref.stride(1),
        HEAD_DIM=o.shape[2],
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        WRITE_REF=o_ref is not o,
        DOT_PREC=_dot_precision(dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        enable_fp_fusion=ATTENTION_FP_FUSION,
    )


def _fwd_pointers(
    grid: tuple[int, int],
    inputs: tuple[Tensor, Tensor, Tensor],
    outputs: tuple[Tensor, Tensor, Tensor],
    Q: int,
    K: int,
    qk_scale: float,
    cfg: Mapping[str, Any],
) -> None:
    """attention_fwd_kernel: q, k, v through pointers and their (row, head) strides into (o, o_ref,
    lse2); o_ref is written only when it is not o (out_dtype other than FP32)."""
    q, k, v = inputs
    o, o_ref, lse = outputs
    attention_fwd_kernel[grid](
        (q, k, v),
        (o, o_ref, lse),
        Q,
        K,
        qk_scale,
        strides(q, k, v),
        strides(o, o_ref),
        HEAD_DIM=q.shape[2],
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        WRITE_REF=o_ref is not o,
        DOT_PREC=_dot_precision(q.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        enable_fp_fusion=ATTENTION_FP_FUSION,
    )


def attention_delta(
    do: Tensor, o_ref: Tensor, *, node: str | None = None, config: Mapping[str, Any] | None = None
) -> Tensor:
    """delta [H, Q] FP32 = rowsum over head_dim of dO * O, one fixed tree per row (not torch.sum,
    whose CUDA reduction plan depends on the tensor's shape)."""
    if do.dim() != 3 or do.shape != o_ref.shape:
        raise ValueError(f"need dO and O of one shape [Q, H, Dh]; got {tuple(do.shape)}, {tuple(o_ref.shape)}")
    do, o_ref = lastdim(do), lastdim(o_ref)
    Q, H, Dh = do.shape
    cfg = _launch_cfg("attention_delta", do, node, config)
    delta = torch.empty((H, Q), dtype=F32, device=do.device)
    if Q == 0:
        return delta
    attention_delta_kernel[(cdiv(Q, cfg["BLOCK_R"]), H)](
        do,
        o_ref,
        delta,
        Q,
        do.stride(0),
        do.stride(1),
        o_ref.stride(0),
        o_ref.stride(1),
        HEAD_DIM=Dh,
        BLOCK_R=cfg["BLOCK_R"],
        num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 1),
        enable_fp_fusion=ATTENTION_FP_FUSION,
    )
    return delta


def _bwd_meta(cfg: Mapping[str, Any], head_dim: int, dtype: torch.dtype) -> dict[str, Any]:
    """The backward kernels' compile-time arguments and launch options under `cfg`."""
    meta = {"HEAD_DIM": head_dim, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "enable_fp_fusion": ATTENTION_FP_FUSION}
    return meta | {"DOT_PREC": _dot_precision(dtype)} | launch


def attention_bwd_q(
    q: Tensor,
    do: Tensor,
    stats: Sequence[Tensor],
    delta: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    node: str | None = None,
    config: Mapping[str, Any] | None = None,
) -> Tensor:
    """dq [Q, H, Dh] FP32 for these queries over all keys; scaled once, on the FP32 sum. Under "IMPL":
    "gluon" the fused sm90 kernel without dk and dv computes it (`_bwd_gluon`), else the dq kernel."""
    q, do, k, v, lse, delta = bwd_operands(q, do, stats, delta, k, v, scale)
    (Q, H, Dh), K = q.shape, k.shape[0]
    cfg = _launch_cfg("attention_bwd_q", q, node, config)
    if _bwd_gluon(cfg, q) and Q:
        from h3lab.triton.attention_fused_sm90 import attention_bwd_q_sm90  # Gluon (Hopper only)

        return attention_bwd_q_sm90(q, do, (lse,), delta, k, v, scale)
    dq = torch.empty((Q, H, Dh), dtype=F32, device=q.device)
    if Q == 0:
        return dq
    grid = (cdiv(Q, cfg["BLOCK_M"]), H)
    common = _bwd_meta(cfg, Dh, q.dtype)
    descs = [_row_desc(t, cfg["BLOCK_N"]) for t in (k, v)] if cfg.get("TMA", False) else [None]
    query, scales = (q, do, lse, delta), (scale * LOG2E, scale)
    if all(d is not None for d in descs):
        attention_bwd_q_tma_kernel[grid](query, *descs, dq, Q, K, *scales, strides(q, do), strides(dq), **common)
        return dq
    attention_bwd_q_kernel[grid](query, (k, v), dq, Q, K, *scales, strides(q, do), strides(k, v), strides(dq), **common)
    return dq


def attention_bwd_kv(
    q: Tensor,
    do: Tensor,
    stats: Sequence[Tensor],
    delta: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    node: str | None = None,
    config: Mapping[str, Any] | None = None,
) -> tuple[Tensor, Tensor]:
    """dk, dv [K, H, Dh] FP32 for these keys; q, dO, stats, delta must be every query in canonical order."""
    q, do, k, v, lse, delta = bwd_operands(q, do, stats, delta, k, v, scale)
    (Q, H, Dh), K = q.shape, k.shape[0]
    cfg = _launch_cfg("attention_bwd_kv", q, node, config)
    dk = torch.empty((K, H, Dh), dtype=F32, device=q.device)
    dv = torch.empty((K, H, Dh), dtype=F32, device=q.device)
    if Q == 0:  # no queries: the gradients are exact zeros
        return dk.zero_(), dv.zero_()
    grid = (cdiv(K, cfg["BLOCK_N"]), H)
    common = _bwd_meta(cfg, Dh, q.dtype)
    descs = [_row_desc(t, cfg["BLOCK_M"]) for t in (q, do)] if cfg.get("TMA", False) else [None]
    keys, grads, scales, kv_strides = (k, v), (dk, dv), (scale * LOG2E, scale), (strides(k, v), strides(dk))
    if all(d is not None for d in descs):
        attention_bwd_kv_tma_kernel[grid](*descs, (lse, delta), keys, grads, Q, K, *scales, *kv_strides, **common)
        return dk, dv
    query = (q, do, lse, delta)
    attention_bwd_kv_kernel[grid](query, keys, grads, Q, K, *scales, strides(q, do), *kv_strides, **common)
    return dk, dv


def attention_bwd(
    q: Tensor,
    do: Tensor,
    stats: Sequence[Tensor],
    delta: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    node: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq [Q, H, Dh], dk, dv [K, H, Dh]) FP32 of every query and every key, each in canonical order:
    `attention_bwd_q`'s and `attention_bwd_kv`'s bytes, in one fused launch where dq is the Gluon
    kernel's (the pinned dk/dv tile is then the fused kernel's, else ValueError), else the two."""
    node = node or node_of(q.device)
    cfg_q = config_for("attention_bwd_q", q.shape[-1], node) if q.dim() == 3 else {}
    if not (cfg_q.get("IMPL") == "gluon" and _bwd_gluon(cfg_q, q) and q.shape[0]):
        return attention_bwd_q(q, do, stats, delta, k, v, scale, node=node), *attention_bwd_kv(
            q, do, stats, delta, k, v, scale, node=node
        )
    cfg_kv = config_for("attention_bwd_kv", q.shape[-1], node)
    if (cfg_kv["BLOCK_M"], cfg_kv["BLOCK_N"]) != (64, 128):
        raise ValueError(
            f"attention_bwd on {node}: attention_bwd_kv BLOCK_M, BLOCK_N = {cfg_kv['BLOCK_M']}, {cfg_kv['BLOCK_N']}; "
            "allowed with attention_bwd_q IMPL gluon: 64, 128 (the fused kernel's dk/dv tile)"
        )
    from h3lab.triton.attention_fused_sm90 import attention_bwd_fused_sm90  # Gluon (Hopper only)

    return attention_bwd_fused_sm90(q, do, stats, delta, k, v, scale)


def flops(n_q: int, n_k: int, heads: int, head_dim: int) -> dict[str, float]:
    """Tensor-core FLOPs: fwd 2 GEMMs (QK^T, PV); dq 3 (QK^T, dO V^T, dS K); dk/dv 4 (+ P^T dO, dS^T Q);
    the split backward 7, the fused one 5 (each product once)."""
    gemm = 2.0 * n_q * n_k * heads * head_dim
    return {"fwd": 2 * gemm, "bwd_q": 3 * gemm, "bwd_kv": 4 * gemm, "bwd": 7 * gemm, "bwd_fused": 5 * gemm}
