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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from h3lab.batch import PackedBatch
from h3lab.config import NUM_ADALN_CHUNKS, H3Config
from h3lab.result import BlockResult
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


def _block_forward(
    p: dict[str, Tensor],
    x_SD: Tensor,
    temb_TE: Tensor,
    adaln_S: Tensor,
    rope: tuple[Tensor, Tensor],
    is_key_S: Tensor,
    config: H3Config,
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
    scores_HSS = torch.einsum("qhk,shk->hqs", q_SHK, k_SHK) / math.sqrt(K)
    scores_HSS = scores_HSS.masked_fill(~is_key_S, -math.inf)  # padding rows are no query's key
    attn_SHK = torch.einsum("hqs,shk->qhk", scores_HSS.softmax(dim=-1), v_SHK)
    x_SD = x_SD + gate_msa * F.linear(attn_SHK.flatten(1), p["attn.to_out.0.weight"])

    h_SD = _rms_norm(x_SD, p["norm2.weight"], config.norm_eps) * (1.0 + scale_mlp) + shift_mlp
    hidden_SF, gate_SF = F.linear(h_SD, p["ff.net.0.proj.weight"]).chunk(2, dim=-1)  # SwiGLU: value, then gate
    return x_SD + gate_mlp * F.linear(hidden_SF * F.silu(gate_SF), p["ff.net.2.weight"])


def oracle_block(weights: BlockWeights, batch: PackedBatch) -> BlockResult:
    """Forward and backward of one block in float64; every tensor of the result is float64.

    `dw` holds the gradient of every parameter under its diffusers name; `dtemb` the gradient w.r.t. temb.
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
        )
        # zeroing padding rows of `out` also zeroes their upstream gradient on the way back
        out_SD = torch.where(active_S1, out_SD, 0.0)
        dx_SD, dtemb_TE, *dw = torch.autograd.grad(out_SD, [x_SD, temb_TE, *params.values()], batch.grad_out.to(f64))
    return BlockResult(out=out_SD.detach(), dx=dx_SD, dw=dict(zip(params, dw, strict=True)), dtemb=dtemb_TE)
