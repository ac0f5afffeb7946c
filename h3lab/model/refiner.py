"""The token refiner: `num_refiner_layers` plain pre-norm blocks over the text rows, then a final RMSNorm.

Dimension legend: R text rows, D hidden, A attention width, F SwiGLU width, H heads, Dh head_dim.

diffusers' `MiniMaxH3TokenRefinerBlock`: x + attn(norm1(x)), then x + ff(norm2(x)); no AdaLN, no
RoPE, full attention over the text rows only. It runs through the same backend methods as the
canonical block, so the refiner's arithmetic is the block's op for op, with three identities in
place of what it lacks, each exact in floating point:
- no modulation: scale = shift = +0, and (xhat * w) * (1 + 0) + 0 = xhat * w;
- no RoPE: cos = 1, sin = 0 on the block's rotary channels, and q * 1 + rot(q) * 0 = q;
- no gate: gate = 1, and x + 1 * y = x + y.
(Each identity can at most turn a -0 into +0, which no later sum can see.) to_out and ff.net.2
reduce over the 8 canonical units' partials in the contract's tree, as in the block, so a
tensor-parallel refiner could reproduce these bits; here every rank computes it in full.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.config import NUM_UNITS, H3Config
from h3lab.ops.rows import key_order


class RefinerSaved(NamedTuple):
    """What a refiner block's backward (h3lab.model.refiner_grad) reads of its forward."""

    x: Tensor  # [R, D] the block's input
    m1: Tensor  # [R, D] norm1's output
    q: Tensor  # [R, A] to_q's output
    k: Tensor  # [R, A] to_k's output
    v: Tensor  # [R, H, Dh]
    qr: Tensor  # [R, H, Dh] queries after q norm (RoPE is the identity here)
    kr: Tensor  # [R, H, Dh] keys after k norm
    k_c: Tensor  # [R, H, Dh] the keys in canonical order
    v_c: Tensor
    o_ref: Tensor  # the attention's output as the backend's delta reads it
    stats: tuple[Tensor, ...]  # per-(head, query) [H, R]
    attn: Tensor  # [R, A] the attention's output, to_out's input
    x1: Tensor  # [R, D] the first residual's output
    m2: Tensor  # [R, D] norm2's output
    h: Tensor  # [R, F] ff.net.0's hidden half
    g: Tensor  # [R, F] its gate half
    a: Tensor  # [R, F] SwiGLU's output
    cos: Tensor  # [R, rotary_dim] FP32 ones: no RoPE
    sin: Tensor  # [R, rotary_dim] FP32 zeros


def refiner_block(p: dict[str, Tensor], x_RD: Tensor, order: Tensor, config: H3Config, be: Backend) -> Tensor:
    """One refiner block on the text rows `x_RD` (activation dtype); `order` = key order of the rows."""
    return refiner_block_forward(p, x_RD, order, config, be)[0]


def refiner_block_forward(
    p: dict[str, Tensor], x_RD: Tensor, order: Tensor, config: H3Config, be: Backend
) -> tuple[Tensor, RefinerSaved]:
    """`refiner_block` and what its backward reads: (out [R, D], the block's records)."""
    c, act = config, x_RD.dtype
    R, D, Dh, F = x_RD.shape[0], c.hidden_size, c.attention_head_dim, c.ffn_dim
    zeros_RD = torch.zeros(R, D, dtype=act, device=x_RD.device)
    ones_RD = torch.ones(R, D, dtype=act, device=x_RD.device)
    cos = torch.ones(R, c.rotary_dim, dtype=torch.float32, device=x_RD.device)
    sin = torch.zeros(R, c.rotary_dim, dtype=torch.float32, device=x_RD.device)
    heads = lambda t: t.view(R, -1, Dh)  # noqa: E731

    m1 = be.rms_modulate_fwd(x_RD, p["norm1.weight"], zeros_RD, zeros_RD, c.norm_eps, act)
    q = be.mm(m1, p["attn.to_q.weight"].t(), act)  # [R, A]
    k = be.mm(m1, p["attn.to_k.weight"].t(), act)
    v = heads(be.mm(m1, p["attn.to_v.weight"].t(), act))
    qn = be.qk_norm_rope_fwd(heads(q), p["attn.norm_q.weight"], cos, sin, c.qk_norm_eps, act)
    kn = be.qk_norm_rope_fwd(heads(k), p["attn.norm_k.weight"], cos, sin, c.qk_norm_eps, act)
    k_c, v_c = kn[order], v[order]  # keys in canonical order
    attn3, o_ref, stats = be.attention_fwd(qn, k_c, v_c, 1.0 / Dh**0.5, act)
    attn = attn3.reshape(R, -1)
    o = be.round(be.unit_reduce([(attn, p["attn.to_out.0.weight"].t())], NUM_UNITS), act)
    x1 = be.gated_residual(x_RD, ones_RD, o, act)

    m2 = be.rms_modulate_fwd(x1, p["norm2.weight"], zeros_RD, zeros_RD, c.norm_eps, act)
    w0 = p["ff.net.0.proj.weight"]  # [2F, D]: hidden rows, then gate rows
    h, g = be.mm(m2, w0[:F].t(), act), be.mm(m2, w0[F:].t(), act)
    a = be.swiglu_fwd(h, g, act)
    y = be.round(be.unit_reduce([(a, p["ff.net.2.weight"].t())], NUM_UNITS), act)
    out = be.gated_residual(x1, ones_RD, y, act)
    return out, RefinerSaved(x_RD, m1, q, k, v, qn, kn, k_c, v_c, o_ref, stats, attn, x1, m2, h, g, a, cos, sin)


def token_refiner(
    blocks: list[dict[str, Tensor]],
    final_norm_w: Tensor,
    x_RD: Tensor,
    keys_R2: Tensor,
    config: H3Config,
    be: Backend,
    *,
    order: Tensor | None = None,
) -> Tensor:
    """The refiner blocks in order, then `final_norm` (eps = final_norm_eps); rows keep their order
    (`order`: key_order(keys_R2) where the caller holds it already)."""
    order = key_order(keys_R2) if order is None else order
    assert order.numel() == x_RD.shape[0], "text rows are never padding"
    for p in blocks:
        x_RD = refiner_block(p, x_RD, order, config, be)
    zeros_RD = torch.zeros_like(x_RD)
    return be.rms_modulate_fwd(x_RD, final_norm_w, zeros_RD, zeros_RD, config.final_norm_eps, x_RD.dtype)
