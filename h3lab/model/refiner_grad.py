"""The token refiner's backward: every refiner weight's gradient and the gradient at its input.

Dimension legend: R text rows, D hidden, A attention width, F SwiGLU width, H heads, Dh head_dim.

It runs through the backend methods the block's backward runs (h3lab.block.backward), op for op,
with the identities the refiner's forward documents (h3lab.model.refiner), each exact:
- no modulation (scale = +0): d n = d m * (1 + 0) = d m; d scale and d shift are dropped;
- no RoPE (cos = 1, sin = 0): the rotary backward gives d q * 1 + rot^T(d q * 0) = d q;
- no gate (gate = 1): d y = 1 * d out = d out, and the residual's d x1 = d out + (norm2's d x).
The arithmetic is the contract's: dX of to_out and ff.net.2's inputs are plain k-ascending GEMMs,
dX of to_q/to_k/to_v and of ff.net.0 reduce the 8 canonical units' partials in the contract's tree
(q,k,v / hidden,gate order inside a unit), weight gradients reduce the text rows in ascending key
order (`row_mm`, `row_sum`), q/k-norm weight gradients sum each unit's heads ascending, then the
unit tree. Every rank computes it in full (replicated), so it is layout-invariant by construction.
The forward reruns here from the refiner's input (as the chain reruns each block): the refiner is
small against the stack (h3lab.model.transformer).
"""

from __future__ import annotations

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.config import NUM_UNITS, H3Config
from h3lab.model.refiner import RefinerSaved, refiner_block_forward
from h3lab.ops.fixed import chain_sum, unit_tree
from h3lab.ops.rows import key_order

F32 = torch.float32


def token_refiner_backward(
    blocks: list[dict[str, Tensor]],
    final_norm_w: Tensor,
    x_RD: Tensor,
    keys_R2: Tensor,
    d_out_RD: Tensor,
    config: H3Config,
    be: Backend,
    *,
    order: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Backward of `token_refiner(blocks, final_norm_w, x_RD, keys_R2, config, be)` given d out
    (`order`: key_order(keys_R2) where the caller holds it already).

    Args:
        blocks: each refiner block's ten tensors, keyed without `token_refiner.refiner_blocks.{j}.`.
        final_norm_w: `token_refiner.final_norm.weight`.
        x_RD: the refiner's input (context_embedder's output), activation dtype.
        keys_R2: the text rows' logical keys (never padding).
        d_out_RD: the gradient at the refiner's output, activation dtype.

    Returns:
        (the gradient at `x_RD` in its dtype, gradients keyed `refiner_blocks.{j}.<name>` and
        `final_norm.weight`, each in its weight's dtype).
    """
    order = key_order(keys_R2) if order is None else order
    assert order.numel() == x_RD.shape[0], "text rows are never padding"
    saved = []
    for p in blocks:
        x_RD, s = refiner_block_forward(p, x_RD, order, config, be)
        saved.append(s)
    act, zeros_RD = x_RD.dtype, torch.zeros_like(x_RD)
    dx, dw_rows, _, _ = be.rms_modulate_bwd(d_out_RD, x_RD, final_norm_w, zeros_RD, config.final_norm_eps)
    grads = {"final_norm.weight": be.round(be.row_sum(dw_rows, order), final_norm_w.dtype)}
    d_RD = be.round(dx, act)
    for j in reversed(range(len(blocks))):
        d_RD, block_grads = refiner_block_backward(blocks[j], saved.pop(), d_RD, order, config, be)
        grads |= {f"refiner_blocks.{j}.{k}": v for k, v in block_grads.items()}
    return d_RD, grads


def refiner_block_backward(
    p: dict[str, Tensor], s: RefinerSaved, d_out_RD: Tensor, order: Tensor, config: H3Config, be: Backend
) -> tuple[Tensor, dict[str, Tensor]]:
    """One refiner block's backward from its records: (d input [R, D] activation dtype, its ten gradients)."""
    dx1, grads = _ffn_backward(p, s, d_out_RD, order, config, be)
    dx, attn_grads = _attention_backward(p, s, dx1, order, config, be)
    return dx, grads | attn_grads


def _ffn_backward(
    p: dict[str, Tensor], s: RefinerSaved, d_out_RD: Tensor, order: Tensor, config: H3Config, be: Backend
) -> tuple[Tensor, dict[str, Tensor]]:
    """ff.net.2, SwiGLU, ff.net.0, norm2 and the second residual: (d x1 FP32, their gradients)."""
    act, F, w0, w2 = s.x.dtype, config.ffn_dim, p["ff.net.0.proj.weight"], p["norm2.weight"]
    g_out = d_out_RD.to(F32)
    dy = d_out_RD  # gate = 1: d y = 1 * d out, already in the activation dtype
    da = be.mm(dy, p["ff.net.2.weight"], act)  # [R, F]
    dh, dg = be.swiglu_bwd(da, s.h, s.g, act)
    dm2 = be.round(be.unit_reduce([(dh, w0[:F]), (dg, w0[F:])], NUM_UNITS), act)  # hidden, then gate
    grads = {
        "ff.net.0.proj.weight": be.row_mm(torch.cat([dh, dg], dim=1), s.m2, order, w0.dtype),  # [2F, D]
        "ff.net.2.weight": be.row_mm(dy, s.a, order, p["ff.net.2.weight"].dtype),  # [D, F]
    }
    dxn2, dw2_rows, _, _ = be.rms_modulate_bwd(dm2, s.x1, w2, torch.zeros_like(s.x1), config.norm_eps)
    grads["norm2.weight"] = be.round(be.row_sum(dw2_rows, order), w2.dtype)
    return g_out + dxn2, grads


def _attention_backward(
    p: dict[str, Tensor], s: RefinerSaved, dx1: Tensor, order: Tensor, config: H3Config, be: Backend
) -> tuple[Tensor, dict[str, Tensor]]:
    """to_out, attention, q/k norm, q/k/v, norm1 and the first residual: (d x [R, D], their gradients)."""
    act, R, eps, w1 = s.x.dtype, s.x.shape[0], config.qk_norm_eps, p["norm1.weight"]
    heads = lambda t: t.view(R, -1, config.attention_head_dim)  # noqa: E731
    scale = 1.0 / config.attention_head_dim**0.5
    w_out = p["attn.to_out.0.weight"]
    do = be.round(dx1, act)  # gate = 1: d o = 1 * d x1
    dO = heads(be.mm(do, w_out, act))  # [R, H, Dh]
    grads = {"attn.to_out.0.weight": be.row_mm(do, s.attn, order, w_out.dtype)}
    delta = be.attention_delta(dO, s.o_ref)  # [H, R]
    stats_c = [t[:, order] for t in s.stats]
    grads_c = be.attention_bwd(s.qr[order], dO[order], stats_c, delta[:, order], s.k_c, s.v_c, scale)
    dq, dk, dv = (g.new_zeros((R, *g.shape[1:])).index_copy_(0, order, g) for g in grads_c)  # padding: 0
    dq, dwq_rows = be.qk_norm_rope_bwd(dq, heads(s.q), p["attn.norm_q.weight"], s.cos, s.sin, eps, act)
    dk, dwk_rows = be.qk_norm_rope_bwd(dk, heads(s.k), p["attn.norm_k.weight"], s.cos, s.sin, eps, act)
    dq, dk, dv = dq.reshape(R, -1), dk.reshape(R, -1), be.round(dv, act).reshape(R, -1)
    wq, wk, wv = (p[f"attn.to_{n}.weight"] for n in "qkv")
    dm1 = be.round(be.unit_reduce([(dq, wq), (dk, wk), (dv, wv)], NUM_UNITS), act)  # q, k, v
    for n, d in (("q", dq), ("k", dk), ("v", dv)):
        grads[f"attn.to_{n}.weight"] = be.row_mm(d, s.m1, order, wq.dtype)  # [A, D]
    dxn1, dw1_rows, _, _ = be.rms_modulate_bwd(dm1, s.x, w1, torch.zeros_like(s.x), config.norm_eps)
    grads["norm1.weight"] = be.round(be.row_sum(dw1_rows, order), w1.dtype)
    for name, per_row in (("attn.norm_q.weight", dwq_rows), ("attn.norm_k.weight", dwk_rows)):
        grads[name] = be.round(_qk_norm_grad(be.row_sum(per_row, order), config), p[name].dtype)
    return be.round(dx1 + dxn1, act), grads


def _qk_norm_grad(per_head_HD: Tensor, config: H3Config) -> Tensor:
    """A q/k-norm weight's gradient from its per-head sums: each unit's heads ascending, then the unit tree
    (the block's order, h3lab.block.backward)."""
    per_unit = chain_sum(per_head_HD.view(NUM_UNITS, config.heads_per_unit, -1).transpose(0, 1))  # [U, Dh]
    return unit_tree(list(per_unit.unbind(0)))
