"""AdamW's update of one piece and its write-back as one Triton kernel.

Reference: h3lab.ops.adamw.adamw_update, bit for bit: per element the same IEEE FP32 operations in
the same order (launched with `enable_fp_fusion=False`, so no multiply-add is contracted; division
and square root through `div_rn` and `sqrt_rn`, correctly rounded, not the approximate defaults),
and the weight rounded to bf16 by the reference's integer round-half-to-even (h3lab.ops.fixed.round_to),
so the bytes do not depend on a conversion instruction. An element's result depends on its own
operands only, never on the tile. The reference reads and writes each piece about seventeen times
(one torch op each, ~17 launches per piece); this reads the gradient and the state once and writes
the state and the weight once.

Launcher: `adamw_update`. Dimension legend: R rows, C columns of a piece viewed as 2-D.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.ops.adamw import ADAMW_SCALARS
from h3lab.triton import configs
from h3lab.triton.gemm_host import check_device
from h3lab.triton.variant import Variant, options

F32 = torch.float32
GRAD_DTYPES = (torch.bfloat16, torch.float32)
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _round_bf16_bits(x):
    # h3lab.ops.fixed._round_bits: round half to even on the dropped 16 bits; NaN -> quiet NaN, sign kept
    u = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0 | ((u >> 16) & 0x8000), r)
    return (r - ((r & 0x8000) << 1)).to(tl.int16)


@triton.jit
def adamw_kernel(
    master_ptr,
    m_ptr,
    v_ptr,
    g_ptr,
    w_ptr,
    coef_ptr,
    s_ptr,
    n,
    C,
    s_gr,
    s_gc,
    s_wr,
    s_wc,
    W_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    r, c = i // C, i % C
    # the scalars in h3lab.ops.adamw.ADAMW_SCALARS order
    decay, beta1, omb1 = tl.load(s_ptr + 0), tl.load(s_ptr + 1), tl.load(s_ptr + 2)
    beta2, omb2, bias2_sqrt = tl.load(s_ptr + 3), tl.load(s_ptr + 4), tl.load(s_ptr + 5)
    step_size, eps = tl.load(s_ptr + 6), tl.load(s_ptr + 7)
    g = tl.load(g_ptr + r * s_gr + c * s_gc, mask=mask, other=0.0).to(tl.float32) * tl.load(coef_ptr)
    m = tl.load(m_ptr + i, mask=mask, other=0.0) * beta1 + g * omb1
    v = tl.load(v_ptr + i, mask=mask, other=0.0) * beta2 + (g * g) * omb2
    w = tl.load(master_ptr + i, mask=mask, other=0.0) * decay
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    w = w - tl.div_rn(m, denom) * step_size
    tl.store(m_ptr + i, m, mask=mask)
    tl.store(v_ptr + i, v, mask=mask)
    tl.store(master_ptr + i, w, mask=mask)
    if W_BF16:
        tl.store(w_ptr + r * s_wr + c * s_wc, _round_bf16_bits(w), mask=mask)
    else:
        tl.store(w_ptr + r * s_wr + c * s_wc, w, mask=mask)


def _as_2d(t: Tensor) -> Tensor:
    return t.reshape(1, -1) if t.dim() < 2 else t  # a 1-D view stays a view


def adamw_update(
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    grad: Tensor,
    coef: Tensor,
    s: Tensor,
    weight: Tensor,
    *,
    node: str | None = None,
) -> None:
    """h3lab.ops.adamw.adamw_update as one launch (module docstring): the same arguments, the same bytes.

    `master`, `exp_avg`, `exp_avg_sq`: contiguous FP32 of the piece's shape (0-, 1- or 2-D); `grad`,
    `weight`: the piece's shape with any strides (a unit's columns), bf16 or fp32; `s`: contiguous.

    Raises:
        ValueError: shapes, dtypes, devices or layouts other than those above.
    """
    shape = master.shape
    if master.dim() > 2:
        raise ValueError(f"adamw_update: a {master.dim()}-D piece {list(shape)}; allowed: 0-, 1- or 2-D")
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("s", s)):
        if not t.is_contiguous():
            raise ValueError(f"adamw_update: {name} has strides {t.stride()}; allowed: contiguous")
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != shape or t.dtype != F32:
            raise ValueError(f"adamw_update: {name} is {t.dtype} {list(t.shape)}; allowed: torch.float32 {list(shape)}")
    for name, t, dtypes in (("grad", grad, GRAD_DTYPES), ("weight", weight, WEIGHT_DTYPES)):
        if t.shape != shape or t.dtype not in dtypes:
            raise ValueError(
                f"adamw_update: {name} is {t.dtype} {list(t.shape)}; allowed: {list(dtypes)}, {list(shape)}"
            )
    if coef.numel() != 1 or coef.dtype != F32 or s.shape != (len(ADAMW_SCALARS),) or s.dtype != F32:
        raise ValueError(
            f"adamw_update: coef {coef.dtype} {list(coef.shape)}, s {s.dtype} {list(s.shape)}; allowed: a 0-d "
            f"torch.float32 and torch.float32 [{len(ADAMW_SCALARS)}] ({', '.join(ADAMW_SCALARS)})"
        )
    device = check_device("adamw_update", master, exp_avg, exp_avg_sq, grad, coef, s, weight)
    cfg = configs.pinned("adamw", node or configs.node_of(device))
    n = master.numel()
    if not n:
        return
    g2, w2 = _as_2d(grad), _as_2d(weight)
    w_bf16 = weight.dtype == torch.bfloat16
    w_store = w2.view(torch.int16) if w_bf16 else w2  # the rounded bits are stored as integers
    adamw_kernel[(configs.cdiv(n, cfg["BLOCK"]),)](
        master,
        exp_avg,
        exp_avg_sq,
        g2,
        w_store,
        coef,
        s,
        n,
        g2.shape[1],
        g2.stride(0),
        g2.stride(1),
        w_store.stride(0),
        w_store.stride(1),
        W_BF16=w_bf16,
        BLOCK=cfg["BLOCK"],
        num_warps=cfg["num_warps"],
        enable_fp_fusion=False,
    )


def variants(node: str) -> list[Variant]:
    """The update of a bf16 weight (written as its bits) and of an fp32 one."""
    cfg = configs.pinned("adamw", node)
    out = []
    for w_bf16 in (True, False):
        types = {f"{n}_ptr": "*fp32" for n in ("master", "m", "v", "coef", "s")}
        types |= {"g_ptr": "*bf16", "w_ptr": "*i16" if w_bf16 else "*fp32"}
        const = {"W_BF16": w_bf16, "BLOCK": cfg["BLOCK"]}
        what = f"{'bf16' if w_bf16 else 'fp32'} weight"
        out.append(Variant("adamw", what, adamw_kernel, types, const, options(cfg, stages=False)))
    return out
