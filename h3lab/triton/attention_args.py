"""The attention launchers' checked operands: shapes, dtypes, the scale, the statistics' layout.

Shared by h3lab.triton.attention (the pinned launchers) and the fused backwards (attention_fused,
attention_fused_sm90), which the launchers call: one set of checks and one message per bad input.
The fused backwards' launch orders and dq modes live here too (their one check).
Dimension legend: Q query rows, K key rows, H heads, Dh head_dim; q [Q, H, Dh], k/v [K, H, Dh].
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from h3lab.triton.configs import interpreting

F32 = torch.float32
LOG2E = 1.4426950408889634  # 1 / ln 2; qk_scale = scale * LOG2E is rounded once to FP32 at launch
# tensor-core input dtypes on CUDA; the interpreter computes bf16 wrong (numpy has no bf16 dot), so
# there FP32 with IEEE dots is the only honest input
GPU_DTYPES = (torch.bfloat16, torch.float16)
INTERPRETER_DTYPES = (torch.float32,)
ORDERS = ("heads_first", "keys_first")  # grid axis 0 (CUDA's fastest): heads, or key blocks (module docstring)
# what happens to dq's partials: "ordered" is the kernel; "unordered" (atomic adds in whatever order the
# blocks arrive: other bits run to run) and "skipped" (no dq at all) exist only so that
# h3lab.bench.attention_fused_bwd can split the time of the turns from the adds' and the products'
DQ_MODES = ("ordered", "unordered", "skipped")


def check_modes(who: str, order: str, dq_mode: str) -> None:
    """ValueError unless `order` is one of ORDERS and `dq_mode` one of DQ_MODES (both fused backwards')."""
    if order not in ORDERS:
        raise ValueError(f"{who} order {order!r}; allowed: {list(ORDERS)}")
    if dq_mode not in DQ_MODES:
        raise ValueError(f"{who} dq_mode {dq_mode!r}; allowed: {list(DQ_MODES)}")


def check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        raise ValueError(f"need q [Q, H, Dh], k and v [K, H, Dh]; got {shapes}")
    if q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q and k must agree on (H, Dh); got {tuple(q.shape[1:])} and {tuple(k.shape[1:])}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device; got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    allowed = INTERPRETER_DTYPES if interpreting() else GPU_DTYPES
    if q.dtype not in allowed:
        where = "under TRITON_INTERPRET=1" if interpreting() else "on CUDA"
        raise ValueError(f"attention kernels take q/k/v in {list(allowed)} {where}; got {q.dtype}")
    if k.shape[0] == 0:
        raise ValueError("attention needs at least one key")


def check_scale(scale: float) -> None:
    # the forward takes max(q . k) * scale as max(s): exact only for a positive scale
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number (1/sqrt(head_dim)); got {scale}")


def lastdim(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def strides(*ts: Tensor) -> tuple[int, ...]:
    """The (row, head) strides of each [rows, H, Dh] tensor, one after the other: a kernel's strides tuple."""
    return tuple(n for t in ts for n in (t.stride(0), t.stride(1)))


def lse_of(stats: Sequence[Tensor], h: int, n: int) -> Tensor:
    if len(stats) != 1:
        raise ValueError(f"stats must be (lse2,) as attention_fwd of this module returns; got {len(stats)} tensors")
    return stat(stats[0], h, n)


def stat(t: Tensor, h: int, n: int) -> Tensor:
    """A per-(head, query) statistic as the contiguous FP32 [H, Q] the kernels index (h * Q + i)."""
    if t.shape != (h, n) or t.dtype != F32:
        raise ValueError(f"stats/delta must be FP32 [H, Q] = [{h}, {n}]; got {t.dtype} {tuple(t.shape)}")
    return t.contiguous()


def bwd_operands(
    q: Tensor, do: Tensor, stats: Sequence[Tensor], delta: Tensor, k: Tensor, v: Tensor, scale: float
) -> tuple[Tensor, ...]:
    """The backward kernels' checked operands: q, dO, k, v with unit last stride, lse and delta [H, Q]."""
    check_inputs(q, k, v)
    check_scale(scale)
    if do.shape != q.shape or do.dtype != q.dtype:
        raise ValueError(f"dO must match q: {q.dtype} {tuple(q.shape)}; got {do.dtype} {tuple(do.shape)}")
    Q, H = q.shape[0], q.shape[1]
    return lastdim(q), lastdim(do), lastdim(k), lastdim(v), lse_of(stats, H, Q), stat(delta, H, Q)
