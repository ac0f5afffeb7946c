"""The sm90 attention kernels' arithmetic on any device: forward, delta, dq, dk/dv.

Each function gives the bits of its h3lab.triton.attention launcher on an H100/H200 with bf16 q, k,
v, dO, following the kernel's per-row operations in order, with the contractions and special
instructions the compiled PTX holds (Triton 3.6, sm90; python -m h3lab.bench.ptx_audit):
- products q k^T, P V, dO V^T, dS K, P^T dO, dS^T Q: tensor-core chains (h3lab.emulate.wgmma),
  a score's first step without accumulator, P and dS rounded to bf16 first;
- the forward per key block of BLOCK_N keys ascending (the ragged last one masked to -inf):
  m' = max(m, rowmax(s) * qk_scale); alpha = ex2(m - m'); p = ex2(fma(qk_scale, s, -m'));
  l' = fma(l, alpha, rowsum(p)) with rowsum in the wgmma layout's order (h3lab.emulate.lanes.mma);
  acc' = acc * alpha, then acc' + P V; at the end o = div.full(acc, l), lse2 = m + log2(l);
- the backward's p = ex2(fma(s, qk_scale, -lse2)) (masked to 0 past the last key or query),
  dS = p * (dP - delta), dq and dk scaled once by `scale` at the end;
- delta = rowsum(dO * O) in the delta kernel's blocked layout, products contracted (lanes.row_dot).
qk_scale = scale * log2(e) and scale are FP32 kernel arguments (the launch rounds them once).
ex2 (ex2.approx.ftz), div.full and log2 (libdevice) come from h3lab.emulate.sfu. The Gluon
forward for head_dim 128 (h3lab.triton.attention_fwd_sm90) runs the same operations per row, with
a score accumulator of +0 instead of none (the same bits: an exact zero sum is +0 either way); its
fused backward (attention_fused_sm90) gives dq at head_dim 128 as per-key-block partials added in
order, and dk, dv as the dk/dv kernel does.

Dimension legend: Q queries, K keys, H heads, Dh head_dim; [H, Q, ...] inside, the launchers' layouts outside.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from h3lab.emulate import lanes, mma, sfu, tiles, wgmma
from h3lab.emulate.fma import fma_f32
from h3lab.ops.fixed import round_to

F32 = torch.float32
LOG2E = 1.4426950408889634  # as h3lab.triton.attention: qk_scale = scale * LOG2E, rounded to FP32 at launch
DTYPES = (torch.bfloat16,)


def _f32(x: float) -> Tensor:
    return torch.tensor(x, dtype=F32)


def _check(*ts: Tensor) -> None:
    for t in ts:
        if t.dtype not in DTYPES or t.dim() != 3:
            raise ValueError(f"attention operand {t.dtype} {tuple(t.shape)}; allowed: [rows, H, Dh] of {DTYPES}")
    if not math.prod(ts[0].shape[1:]) or any(t.shape[1:] != ts[0].shape[1:] for t in ts):
        raise ValueError(f"attention operands {[tuple(t.shape) for t in ts]}; allowed: one (H, Dh), both nonzero")


def _blocks(x_HRD: Tensor, block: int) -> list[tuple[Tensor, int]]:
    """x's row blocks of `block` rows, the last zero-padded (a masked load's other=0), with their real counts."""
    out = []
    for r0 in range(0, x_HRD.shape[1], block):
        part = x_HRD[:, r0 : r0 + block]
        n = part.shape[1]
        out.append((torch.nn.functional.pad(part, (0, 0, 0, block - n)) if n < block else part, n))
    return out


def _t(x: Tensor) -> Tensor:
    return x.transpose(-1, -2)


def forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, out_dtype: torch.dtype, *, model: mma.MmaModel = mma.SM90
) -> tuple[Tensor, Tensor, tuple[Tensor]]:
    """attention_fwd's (o [Q, H, Dh] out_dtype, o_ref FP32, (lse2 [H, Q],)) (module docstring)."""
    _check(q, k, v)
    if k.shape[0] == 0:
        raise ValueError("attention needs at least one key")
    block_n = tiles.attention("attention_fwd", q.shape[-1])["BLOCK_N"]
    qk_scale = _f32(scale * LOG2E)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, rows, Dh]
    H, Q, Dh = qh.shape
    m = torch.full((H, Q), float("-inf"), dtype=F32)
    l_sum = torch.zeros((H, Q), dtype=F32)
    acc = torch.zeros((H, Q, Dh), dtype=F32)
    layout = lanes.mma(block_n)
    for (kb, n), (vb, _) in zip(_blocks(kh, block_n), _blocks(vh, block_n), strict=True):
        s = wgmma.dot(qh, _t(kb), None, model=model)  # [H, Q, BLOCK_N]
        if n < block_n:
            s[..., n:] = float("-inf")
        m_new = torch.maximum(m, s.amax(-1) * qk_scale)
        alpha = sfu.ex2_approx_ftz(m - m_new)
        p = sfu.ex2_approx_ftz(fma_f32(qk_scale, s, -m_new.unsqueeze(-1)))
        l_sum = fma_f32(l_sum, alpha, lanes.row_sum(p, layout))
        acc = acc * alpha.unsqueeze(-1)
        acc = wgmma.dot(round_to(p, v.dtype), vb, acc, model=model)
        m = m_new
    o_ref = sfu.div_full(acc, l_sum.unsqueeze(-1)).transpose(0, 1)
    lse = m + sfu.log2_libdevice(l_sum)
    return round_to(o_ref, out_dtype), o_ref, (lse,)


def delta(do: Tensor, o_ref: Tensor) -> Tensor:
    """attention_delta's delta [H, Q] = rowsum(dO * O) in the kernel's layout (8 values per lane)."""
    if do.dim() != 3 or do.shape != o_ref.shape:
        raise ValueError(f"need dO and O of one shape [Q, H, Dh]; got {tuple(do.shape)}, {tuple(o_ref.shape)}")
    tiles.attention("attention_delta", do.shape[-1])
    return lanes.row_dot(do, o_ref, lanes.blocked(do.shape[-1], 8)).transpose(0, 1)


def _stat(t: Tensor, H: int, Q: int) -> Tensor:
    if t.shape != (H, Q) or t.dtype != F32:
        raise ValueError(f"stats/delta must be FP32 [H, Q] = [{H}, {Q}]; got {t.dtype} {tuple(t.shape)}")
    return t


def _lse(stats, H: int, Q: int) -> Tensor:
    if len(stats) != 1:
        raise ValueError(f"stats must be (lse2,) as the sm90 forward returns; got {len(stats)} tensors")
    return _stat(stats[0], H, Q)


def bwd_q(
    q: Tensor, do: Tensor, stats, delta_HQ: Tensor, k: Tensor, v: Tensor, scale: float, *, model=mma.SM90
) -> Tensor:
    """attention_bwd_q's dq [Q, H, Dh] FP32: key blocks ascending, dq scaled once at the end. Under
    IMPL gluon (the fused kernel) each key block's dS K is its own chain and the FP32 partials are
    added in key-block order (`_bwd_q_fused`); else one chain runs through every key block."""
    _check(q, do, k, v)
    cfg = tiles.attention("attention_bwd_q", q.shape[-1])
    qh, doh, kh, vh = (t.transpose(0, 1) for t in (q, do, k, v))
    H, Q, Dh = qh.shape
    neg_lse = -_lse(stats, H, Q).unsqueeze(-1)
    delta_ = _stat(delta_HQ, H, Q).unsqueeze(-1)
    if cfg.get("IMPL") == "gluon":
        return _bwd_q_fused((qh, doh, kh, vh), neg_lse, delta_, scale, cfg["BLOCK_N"], model)
    qk_scale = _f32(scale * LOG2E)
    dq = torch.zeros((H, Q, Dh), dtype=F32)
    for (kb, n), (vb, _) in zip(_blocks(kh, cfg["BLOCK_N"]), _blocks(vh, cfg["BLOCK_N"]), strict=True):
        p = sfu.ex2_approx_ftz(fma_f32(qk_scale, wgmma.dot(qh, _t(kb), None, model=model), neg_lse))
        if n < cfg["BLOCK_N"]:
            p[..., n:] = 0.0
        ds = p * (wgmma.dot(doh, _t(vb), None, model=model) - delta_)
        dq = wgmma.dot(round_to(ds, k.dtype), kb, dq, model=model)
    return (dq * _f32(scale)).transpose(0, 1)


def _bwd_q_fused(qdkv_H: tuple[Tensor, ...], neg_lse: Tensor, delta_: Tensor, scale: float, block_n: int, model):
    """The Gluon fused kernel's dq (h3lab.triton.attention_fused_sm90) from [H, rows, Dh] q, dO, k, v
    and [H, Q, 1] -lse2, delta: per key block, S^T = K Q^T and dP^T = V dO^T, P^T = ex2(fma(S^T,
    qk_scale, -lse2)), dS^T = P^T (dP^T - delta) with padded keys' rows +0, the partial dS K as one
    fresh chain, added into dq (from +0) in key-block order (TMA reduce-adds: FP32, round to nearest);
    dq times scale at the end."""
    qh, doh, kh, vh = qdkv_H
    H, Q, Dh = qh.shape
    qk_scale = _f32(scale * LOG2E)
    neg_lse_t, delta_t = _t(neg_lse), _t(delta_)  # [H, 1, Q]
    dq = torch.zeros((H, Q, Dh), dtype=F32)
    for (kb, n), (vb, _) in zip(_blocks(kh, block_n), _blocks(vh, block_n), strict=True):
        p_t = sfu.ex2_approx_ftz(fma_f32(qk_scale, wgmma.dot(kb, _t(qh), None, model=model), neg_lse_t))
        ds_t = p_t * (wgmma.dot(vb, _t(doh), None, model=model) - delta_t)  # [H, BLOCK_N, Q]
        ds_t[:, n:] = 0.0
        dq = dq + wgmma.dot(_t(round_to(ds_t, kh.dtype)), kb, None, model=model)
    return (dq * _f32(scale)).transpose(0, 1)


def bwd_kv(
    q: Tensor, do: Tensor, stats, delta_HQ: Tensor, k: Tensor, v: Tensor, scale: float, *, model=mma.SM90
) -> tuple[Tensor, Tensor]:
    """attention_bwd_kv's (dk, dv) [K, H, Dh] FP32: query blocks ascending, dk scaled once at the end."""
    _check(q, do, k, v)
    block_m = tiles.attention("attention_bwd_kv", q.shape[-1])["BLOCK_M"]
    qh, doh, kh, vh = (t.transpose(0, 1) for t in (q, do, k, v))
    H, Q, Dh = qh.shape
    qk_scale = _f32(scale * LOG2E)
    neg_lse, delta_ = -_lse(stats, H, Q).unsqueeze(1), _stat(delta_HQ, H, Q).unsqueeze(1)  # [H, 1, Q]
    dk = torch.zeros((H, kh.shape[1], Dh), dtype=F32)
    dv = torch.zeros_like(dk)
    for i, ((qb, n), (dob, _)) in enumerate(zip(_blocks(qh, block_m), _blocks(doh, block_m), strict=True)):
        cols = slice(i * block_m, i * block_m + n)
        pad = (0, block_m - n)
        lse_b = torch.nn.functional.pad(neg_lse[..., cols], pad)  # a masked load reads 0 past n_q
        delta_b = torch.nn.functional.pad(delta_[..., cols], pad)
        p_t = sfu.ex2_approx_ftz(fma_f32(qk_scale, wgmma.dot(kh, _t(qb), None, model=model), lse_b))
        if n < block_m:
            p_t[..., n:] = 0.0
        dv = wgmma.dot(round_to(p_t, do.dtype), dob, dv, model=model)
        ds_t = p_t * (wgmma.dot(vh, _t(dob), None, model=model) - delta_b)
        dk = wgmma.dot(round_to(ds_t, q.dtype), qb, dk, model=model)
    return (dk * _f32(scale)).transpose(0, 1), dv.transpose(0, 1)
