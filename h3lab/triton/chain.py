"""The FP32 chain GEMM of the model's float32 modules and their weight gradients, as one Triton kernel.

Reference: h3lab.ops.chain.chain_mm, bit for bit. Each output element is the chain
((0 + a[m,0] b[0,n]) + a[m,1] b[1,n]) + ..., k ascending, each product and each sum one IEEE FP32
operation (launched with `enable_fp_fusion=False`). Where both operands are bf16 the reference
uses `addcmul_`, which may fuse: the bits agree wherever the product is exact in FP32, i.e. not
below FP32's normal range (|a b| >= 2^-126); the model's float32 modules pass an FP32 operand, for
which both round the product first. Unlike the block's tensor-core GEMMs, this gives
the torch backend's bits on every device, so the float32 modules (the embedders' and heads'
projections, the time embedder) compute the same bytes on either backend. The torch chain runs one
launch per k: on a GPU that is K launches per call (K = 5376 for a head's projection, K = rows for
its weight gradient); this is one launch per call.

Launchers: `chain_mm`; `launch_chain`, which h3lab.triton.few_rows.mm_few_k shares.
Dimension legend: M rows, K reduced, N columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.triton import configs
from h3lab.triton.gemm_host import check_device, check_operand
from h3lab.triton.variant import Variant, options

F32 = torch.float32
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "UNROLL", "num_warps")
MAX_ELEMENTS = 2**31 - 1  # per operand: its contiguous copy's offsets k * stride + m must fit int32


@triton.jit
def chain_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    s_ak,
    s_am,
    s_bk,
    s_bn,
    s_cm,
    s_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNROLL: tl.constexpr,
):
    # c[m, n] = ((0 + a[0,m] b[0,n]) + a[1,m] b[1,n]) + ..., k ascending, one rounding at the store.
    # UNROLL steps of k load first and add in order after: more loads in flight, the same adds. A
    # step past K loads a = b = 0 and adds +0, which leaves acc's bits as they are for every acc but
    # -0 (Inf and NaN included), and the chain never holds -0: it starts at +0, and x + y is -0 only
    # for x = y = -0.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_col = a_ptr + rm.to(tl.int64) * s_am
    b_row = b_ptr + rn * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, UNROLL):
        parts = ()
        for j in tl.static_range(UNROLL):
            k = k0 + j
            live = (k < K).to(tl.int32)  # past K: every mask empty (a scalar bound, not a scalar & vector)
            a = tl.load(a_col + k * s_ak, mask=rm < M * live, other=0.0).to(tl.float32)
            b = tl.load(b_row + k * s_bk, mask=rn < N * live, other=0.0).to(tl.float32)
            parts = parts + ((a, b),)  # noqa: RUF005 (a jit tuple grows by +, not by unpacking)
        for j in tl.static_range(UNROLL):
            a, b = parts[j]
            acc += a[:, None] * b[None, :]
    c = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def chain_mm(a_MK: Tensor, b_KN: Tensor, *, node: str | None = None, config: Mapping[str, Any] | None = None) -> Tensor:
    """FP32 [M, N] = a @ b as h3lab.ops.chain.chain_mm computes it (module docstring).

    Args:
        a_MK, b_KN: 2-D bf16 or fp32 tensors, any strides (copied so that each k step reads
            contiguous rows of a^T and b).
        config: CONFIG_KEYS instead of the node's pinned "chain" entry (every tile gives the same
            bits; h3lab.bench.chain_bench times them).

    Raises:
        ValueError: shapes, dtypes, devices, a node without a pinned "chain" entry, a config
            without exactly CONFIG_KEYS.
    """
    check_operand("chain_mm", "a_MK", a_MK)
    check_operand("chain_mm", "b_KN", b_KN)
    if max(a_MK.numel(), b_KN.numel()) > MAX_ELEMENTS:
        raise ValueError(
            f"chain_mm: a_MK {tuple(a_MK.shape)}, b_KN {tuple(b_KN.shape)}; allowed: at most {MAX_ELEMENTS} "
            "elements each (the kernel's offsets k * stride are int32)"
        )
    device = check_device("chain_mm", a_MK, b_KN)
    (M, K), (K2, N) = a_MK.shape, b_KN.shape
    if K != K2:
        raise ValueError(f"chain_mm: a_MK {tuple(a_MK.shape)}, b_KN {tuple(b_KN.shape)}; allowed: the same K")
    if config is not None:  # a caller's tile; the pinned ones build in compile_pinned's tests
        _check_config(config)
    cfg = configs.pinned("chain", node or configs.node_of(device)) if config is None else config
    c = torch.zeros((M, N), dtype=F32, device=device)
    if M and N and K:
        a_KM = a_MK.t().contiguous()
        b_KN = b_KN.contiguous()
        launch_chain(a_KM, b_KN, c, (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["UNROLL"]), cfg["num_warps"])
    return c


def _check_config(cfg: Mapping[str, Any]) -> None:
    if set(cfg) - {"comment"} != set(CONFIG_KEYS):
        raise ValueError(f"chain_mm config keys {sorted(cfg)}; allowed: exactly {list(CONFIG_KEYS)}")
    for key in CONFIG_KEYS:
        v = cfg[key]
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
        if not ok or (key != "UNROLL" and v & (v - 1)):
            allowed = "an int >= 1" if key == "UNROLL" else "a power of two"
            raise ValueError(f"chain_mm config {key} {v!r}; allowed: {allowed}")


def launch_chain(a_KM: Tensor, b_KN: Tensor, c_MN: Tensor, tile: tuple[int, int, int], num_warps: int) -> None:
    """c = the chain over k of a[k, m] * b[k, n] (`chain_kernel`), any strides, rounded once to c's dtype;
    `tile`: (BLOCK_M, BLOCK_N, UNROLL)."""
    (K, M), N = a_KM.shape, b_KN.shape[1]
    block_m, block_n, unroll = tile
    chain_kernel[(configs.cdiv(M, block_m), configs.cdiv(N, block_n))](
        a_KM,
        b_KN,
        c_MN,
        M,
        N,
        K,
        a_KM.stride(0),
        a_KM.stride(1),
        b_KN.stride(0),
        b_KN.stride(1),
        c_MN.stride(0),
        c_MN.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UNROLL=unroll,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )


def variants(node: str) -> list[Variant]:
    """The float32 modules' GEMM: a bf16 activation against an fp32 weight."""
    cfg = configs.pinned("chain", node)
    types = {"a_ptr": "*bf16", "b_ptr": "*fp32", "c_ptr": "*fp32"}
    const = {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "UNROLL": cfg["UNROLL"]}
    return [Variant("chain", "chain_mm", chain_kernel, types, const, options(cfg, stages=False))]
