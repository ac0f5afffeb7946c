"""The FP64 oracle: one MiniMax-H3 block, forward and backward, with no intermediate rounding.

Dimension legend: S packed rows, D hidden_size, H heads, K head_dim, A = H*K inner_dim, F ffn_dim,
T timesteps, E time_embed_dim, R = 3T AdaLN table rows, X = 6D AdaLN columns per row, f rope_freq_dim,
P = 6f rotated head channels, k = K - P channels RoPE passes through.

The same math as diffusers' `MiniMaxH3TransformerBlock.forward` (0.42.1), in plain torch ops on
float64 copies of every weight, temb and hidden state; autograd gives the backward. It is the
specification the fast paths are measured against, so it favours the obvious over the fast.

Padding (h3lab's contract, not diffusers'): rows whose first logical key is negative are never
attention keys and their `out` and `dx` rows are exact zeros, so their upstream gradient is
ignored. Their inputs are zeroed before use: no padding content, even inf or NaN, reaches an active row.

Long sequences: the plain attention holds [H, S, S] float64 scores (112 GiB at 16384 rows, 56 heads);
`score_bytes` computes it in query chunks whose scores fit that many bytes instead, forward and
backward (`chunked_attention`): the same function in float64, another summation order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from h3lab.batch import PackedBatch
from h3lab.block.result import BlockResult
from h3lab.config import NUM_ADALN_CHUNKS, H3Config
from h3lab.weights import BlockWeights

f64 = torch.float64


def rope_cos_sin(position_ids_S3: Tensor, config: H3Config) -> tuple[Tensor, Tensor]:
    """cos, sin [S, P] of diffusers' `MiniMaxH3RotaryPosEmbed`, computed in float64 (diffusers uses float32)."""
    f = config.rope_freq_dim
    exponents_f = torch.arange(0, 2 * f, 2, dtype=f64, device=position_ids_S3.device) / (2 * f)
    inv_freq_f = 1.0 / config.rope_theta**exponents_f
    angles_S3f = position_ids_S3.to(f64)[:, :, None] * inv_freq_f
    angles_SP = angles_S3f.flatten(1).repeat(1, 2)  # (t, h, w) blocks side by side, then the whole again
    return angles_SP.cos(), angles_SP.sin()


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def _apply_rope(x_SHK: Tensor, cos_SP: Tensor, sin_SP: Tensor) -> Tensor:
    P = cos_SP.shape[-1]
    x_SHP, pass_SHk = x_SHK[..., :P], x_SHK[..., P:]  # only the first P channels rotate
    x1, x2 = x_SHP.chunk(2, dim=-1)
    rotated_SHP = torch.cat((-x2, x1), dim=-1)  # rotate-half convention
    return torch.cat((x_SHP * cos_SP[:, None] + rotated_SHP * sin_SP[:, None], pass_SHk), dim=-1)


class _ChunkedAttention(torch.autograd.Function):
    """softmax(q k^T * scale, keys masked) v over query chunks; the backward recomputes each chunk's
    probabilities. Dimension legend as the module's; `rows` query rows per chunk."""

    @staticmethod
    def forward(ctx, q_SHK: Tensor, k_SHK: Tensor, v_SHK: Tensor, is_key_S: Tensor, scale: float, rows: int) -> Tensor:
        o_SHK = torch.empty_like(q_SHK)
        for lo in range(0, q_SHK.shape[0], rows):
            p_HqS = _chunk_probs(q_SHK[lo : lo + rows], k_SHK, is_key_S, scale)
            o_SHK[lo : lo + rows] = torch.einsum("hqs,shk->qhk", p_HqS, v_SHK)
        ctx.save_for_backward(q_SHK, k_SHK, v_SHK, is_key_S, o_SHK)
        ctx.scale, ctx.rows = scale, rows
        return o_SHK

    @staticmethod
    def backward(ctx, do_SHK: Tensor) -> tuple[Tensor | None, ...]:
        q_SHK, k_SHK, v_SHK, is_key_S, o_SHK = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q_SHK), torch.zeros_like(k_SHK), torch.zeros_like(v_SHK)
        delta_SH = (do_SHK * o_SHK).sum(-1)
        for lo in range(0, q_SHK.shape[0], ctx.rows):
            part = slice(lo, lo + ctx.rows)
            p_HqS = _chunk_probs(q_SHK[part], k_SHK, is_key_S, ctx.scale)
            dv += torch.einsum("hqs,qhk->shk", p_HqS, do_SHK[part])
            dp_HqS = torch.einsum("qhk,shk->hqs", do_SHK[part], v_SHK)
            ds_HqS = p_HqS * (dp_HqS - delta_SH[part].T.unsqueeze(-1)) * ctx.scale
            dq[part] = torch.einsum("hqs,shk->qhk", ds_HqS, k_SHK)
            dk += torch.einsum("hqs,qhk->shk", ds_HqS, q_SHK[part])
        return dq, dk, dv, None, None, None


def _chunk_probs(q_qHK: Tensor, k_SHK: Tensor, is_key_S: Tensor, scale: float) -> Tensor:
    scores_HqS = torch.einsum("qhk,shk->hqs", q_qHK, k_SHK) * scale
    return scores_HqS.masked_fill(~is_key_S, -math.inf).softmax(dim=-1)


def chunked_attention(q_SHK: Tensor, k_SHK: Tensor, v_SHK: Tensor, is_key_S: Tensor, score_bytes: int) -> Tensor:
    """The block's attention (scale 1/sqrt(head_dim), non-keys masked) with at most `score_bytes` of
    scores per query chunk (at least one row); differentiable in q, k, v."""
    if score_bytes < 1:
        raise ValueError(f"score_bytes={score_bytes}; allowed: a positive int")
    S, H, K = q_SHK.shape
    rows = max(1, score_bytes // (H * S * q_SHK.element_size()))
    return _ChunkedAttention.apply(q_SHK, k_SHK, v_SHK, is_key_S, 1.0 / math.sqrt(K), rows)


def _block_forward(
    p: dict[str, Tensor],
    x_SD: Tensor,
    temb_TE: Tensor,
    adaln_S: Tensor,
    rope: tuple[Tensor, Tensor],
    is_key_S: Tensor,
    config: H3Config,
    score_bytes: int | None = None,
) -> Tensor:
    H, K, D = config.num_attention_heads, config.attention_head_dim, config.hidden_size
    table_RX = F.linear(F.silu(temb_TE), p["adaln_proj.linear.weight"], p["adaln_proj.linear.bias"])
    table_RX = table_RX.view(-1, NUM_ADALN_CHUNKS * D)  # [T, 3*6*D] -> [3T, 6D], row t*3 + modality
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        chunk_RD.index_select(0, adaln_S) for chunk_RD in table_RX.chunk(NUM_ADALN_CHUNKS, dim=-1)
    )

    h_SD = _rms_norm(x_SD, p["norm1.weight"], config.norm_eps) * (1.0 + scale_msa) + shift_msa
    q_SHK, k_SHK, v_SHK = (F.linear(h_SD, p[f"attn.to_{n}.weight"]).unflatten(-1, (H, K)) for n in "qkv")
    q_SHK = _apply_rope(_rms_norm(q_SHK, p["attn.norm_q.weight"], config.qk_norm_eps), *rope)
    k_SHK = _apply_rope(_rms_norm(k_SHK, p["attn.norm_k.weight"], config.qk_norm_eps), *rope)
    if score_bytes is None:
        scores_HSS = torch.einsum("qhk,shk->hqs", q_SHK, k_SHK) / math.sqrt(K)
        scores_HSS = scores_HSS.masked_fill(~is_key_S, -math.inf)  # padding rows are no query's key
        attn_SHK = torch.einsum("hqs,shk->qhk", scores_HSS.softmax(dim=-1), v_SHK)
    else:
        attn_SHK = chunked_attention(q_SHK, k_SHK, v_SHK, is_key_S, score_bytes)
    x_SD = x_SD + gate_msa * F.linear(attn_SHK.flatten(1), p["attn.to_out.0.weight"])

    h_SD = _rms_norm(x_SD, p["norm2.weight"], config.norm_eps) * (1.0 + scale_mlp) + shift_mlp
    hidden_SF, gate_SF = F.linear(h_SD, p["ff.net.0.proj.weight"]).chunk(2, dim=-1)  # SwiGLU: value, then gate
    return x_SD + gate_mlp * F.linear(hidden_SF * F.silu(gate_SF), p["ff.net.2.weight"])


def oracle_block(weights: BlockWeights, batch: PackedBatch, *, score_bytes: int | None = None) -> BlockResult:
    """Forward and backward of one block in float64; every tensor of the result is float64.

    `dw` holds the gradient of every parameter under its diffusers name; `dtemb` the gradient w.r.t. temb.
    `score_bytes`: None for the plain [H, S, S] attention, else query chunks of at most that many bytes
    of scores (`chunked_attention`), for long sequences.
    """
    config, device = weights.config, batch.device
    hidden, embed = batch.hidden_states.shape[1], batch.temb.shape[1]
    if hidden != config.hidden_size or embed != config.time_embed_dim:
        raise ValueError(
            f"batch has hidden {hidden}, time_embed_dim {embed}; the weights' config expects "
            f"hidden_size={config.hidden_size}, time_embed_dim={config.time_embed_dim}"
        )
    params = {k: v.detach().to(device, f64).requires_grad_() for k, v in weights.items()}
    x_SD = batch.hidden_states.detach().to(f64).requires_grad_()
    temb_TE = batch.temb.detach().to(f64).requires_grad_()
    active_S1 = batch.active[:, None]
    with torch.enable_grad():
        out_SD = _block_forward(
            params,
            torch.where(active_S1, x_SD, 0.0),
            temb_TE,
            batch.adaln_indices,
            rope_cos_sin(batch.position_ids, config),
            batch.active,
            config,
            score_bytes,
        )
        # zeroing padding rows of `out` also zeroes their upstream gradient on the way back
        out_SD = torch.where(active_S1, out_SD, 0.0)
        dx_SD, dtemb_TE, *dw = torch.autograd.grad(out_SD, [x_SD, temb_TE, *params.values()], batch.grad_out.to(f64))
    return BlockResult(out=out_SD.detach(), dx=dx_SD, dw=dict(zip(params, dw, strict=True)), dtemb=dtemb_TE)
