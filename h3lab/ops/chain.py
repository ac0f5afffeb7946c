"""The FP32 chain GEMM: a @ b as one left-to-right chain over k per output element, and its batched form.

The reference of h3lab.triton.chain (bit for bit) and the chain every torch GEMM of the block runs
(h3lab.ops.gemm, unit_gemm, rows, attention). Dimension legend: B batch, M rows, K reduced, N columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Columns per step of the chain on CPU: a [264, 2048] fp32 accumulator (2.1 MB) stays in L2;
# measured 34 GFLOP/s at M=264, K=5376 on 2 cores against 11 GFLOP/s with 256-wide tiles.
_CPU_TILE_N = 2048


def chain_mm(a_MK: Tensor, b_KN: Tensor, acc_MN: Tensor | None = None) -> Tensor:
    """a @ b in float32 as one left-to-right chain over k: acc = acc + a[:, k] * b[k, :].

    Row m of the result depends only on a[m] and b (never on M), column n only on b[:, n]; the
    order over k is ascending. bf16 (and fp16) products are exact in fp32 unless they fall below its
    normal range (|a b| < 2^-126), so fusing the multiply and add changes no bit above it; fp32
    operands take a separate multiply and add. `acc_MN`
    continues an earlier chain (the q,k,v and hidden,gate pieces of one canonical unit).
    """
    M, K = a_MK.shape
    K2, N = b_KN.shape
    assert K == K2, (a_MK.shape, b_KN.shape)
    exact_products = a_MK.dtype in (torch.bfloat16, torch.float16) and b_KN.dtype in (torch.bfloat16, torch.float16)
    a_KM = a_MK.to(torch.float32).t().contiguous()
    b_KN = b_KN.to(torch.float32).contiguous()
    out = torch.zeros(M, N, dtype=torch.float32, device=a_MK.device) if acc_MN is None else acc_MN
    tile = _CPU_TILE_N if a_MK.device.type == "cpu" else N
    for n0 in range(0, N, max(tile, 1)):
        acc = out[:, n0 : n0 + tile]
        acc = acc.contiguous() if not acc.is_contiguous() else acc
        b_tile = b_KN[:, n0 : n0 + tile]
        for k in range(K):
            if exact_products:
                acc.addcmul_(a_KM[k].unsqueeze(1), b_tile[k].unsqueeze(0))
            else:
                acc.add_(a_KM[k].unsqueeze(1) * b_tile[k].unsqueeze(0))
        if acc.data_ptr() != out[:, n0 : n0 + tile].data_ptr():
            out[:, n0 : n0 + tile] = acc
    return out


def chain_bmm(a_BMK: Tensor, b_BKN: Tensor) -> Tensor:
    """Batched `chain_mm`: for every b, a[b] @ b[b] as one FP32 chain over k ascending."""
    B, M, K = a_BMK.shape
    assert b_BKN.shape[:2] == (B, K), (a_BMK.shape, b_BKN.shape)
    exact_products = a_BMK.dtype in (torch.bfloat16, torch.float16) and b_BKN.dtype in (torch.bfloat16, torch.float16)
    a_KBM = a_BMK.to(torch.float32).permute(2, 0, 1).contiguous()
    b_KBN = b_BKN.to(torch.float32).permute(1, 0, 2).contiguous()
    acc = torch.zeros(B, M, b_BKN.shape[2], dtype=torch.float32, device=a_BMK.device)
    for k in range(K):
        if exact_products:
            acc.addcmul_(a_KBM[k].unsqueeze(2), b_KBN[k].unsqueeze(1))
        else:
            acc.add_(a_KBM[k].unsqueeze(2) * b_KBN[k].unsqueeze(1))
    return acc
