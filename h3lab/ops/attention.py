"""Full softmax attention over keys in canonical (logical-key) order: forward and backward.

Dimension legend: H local heads, Q query rows, K key rows (active keys, canonical order), Dh head_dim.
Each score is one FP32 chain over head channels; each query's softmax runs over all keys in one
fixed order; P @ V is a chain over keys ascending; dK/dV are chains over queries in canonical
order. Nothing depends on how many queries a call holds, so context-parallel ranks that split
the queries reproduce the single-process bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from h3lab.ops.chain import chain_bmm
from h3lab.ops.fixed import exp, pair_sum


def scores(q_QHD: Tensor, k_KHD: Tensor, scale: float) -> Tensor:
    """s = (q . k) * scale per head: [H, Q, K] FP32."""
    return chain_bmm(q_QHD.transpose(0, 1), k_KHD.permute(1, 2, 0)) * scale


def probs(s_HQK: Tensor, rowmax_HQ: Tensor, denom_HQ: Tensor) -> Tensor:
    return exp(s_HQK - rowmax_HQ.unsqueeze(-1)) / denom_HQ.unsqueeze(-1)


def attention_fwd(q_QHD: Tensor, k_KHD: Tensor, v_KHD: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (o [Q, H, Dh] FP32, row max [H, Q], denominator [H, Q]); the latter two replay P exactly."""
    s = scores(q_QHD, k_KHD, scale)
    rowmax = s.amax(dim=-1)  # exact: max has no rounding
    denom = pair_sum(exp(s - rowmax.unsqueeze(-1)), -1)
    p = probs(s, rowmax, denom)
    o = chain_bmm(p, v_KHD.transpose(0, 1))
    return o.transpose(0, 1), rowmax, denom


def attention_delta(do_QHD: Tensor, o_QHD: Tensor) -> Tensor:
    """delta = rowsum(dO * O) per (head, query) [H, Q], a balanced tree over head channels."""
    return pair_sum(do_QHD.to(torch.float32) * o_QHD.to(torch.float32), -1).transpose(0, 1)


def attention_bwd_q(
    q_QHD: Tensor,
    do_QHD: Tensor,
    rowmax_HQ: Tensor,
    denom_HQ: Tensor,
    delta_HQ: Tensor,
    k_KHD: Tensor,
    v_KHD: Tensor,
    scale: float,
) -> Tensor:
    """dq [Q, H, Dh] FP32 for these queries over all keys: (dS @ K) * scale, dS = P * (dP - delta)."""
    ds = _ds(q_QHD, do_QHD, rowmax_HQ, denom_HQ, delta_HQ, k_KHD, v_KHD, scale)[0]
    return (chain_bmm(ds, k_KHD.transpose(0, 1)) * scale).transpose(0, 1)


def attention_bwd_kv(
    q_QHD: Tensor,
    do_QHD: Tensor,
    rowmax_HQ: Tensor,
    denom_HQ: Tensor,
    delta_HQ: Tensor,
    k_KHD: Tensor,
    v_KHD: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """dk, dv [K, H, Dh] FP32 for these keys; queries must be all active queries in canonical order."""
    ds, p = _ds(q_QHD, do_QHD, rowmax_HQ, denom_HQ, delta_HQ, k_KHD, v_KHD, scale)
    dk = chain_bmm(ds.transpose(1, 2), q_QHD.transpose(0, 1)) * scale
    dv = chain_bmm(p.transpose(1, 2), do_QHD.transpose(0, 1))
    return dk.transpose(0, 1), dv.transpose(0, 1)


def _ds(q, do, rowmax, denom, delta, k, v, scale) -> tuple[Tensor, Tensor]:
    p = probs(scores(q, k, scale), rowmax, denom)
    dp = chain_bmm(do.transpose(0, 1), v.permute(1, 2, 0))  # [H, Q, K], chain over head channels
    return p * (dp - delta.unsqueeze(-1)), p
