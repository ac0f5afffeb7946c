"""The backward of everything after the block stack: the two float32 heads and `norm_out`.

Dimension legend: S packed rows, D hidden, T timesteps, E time_embed_dim, R one modality's rows,
C its channels.

Replicated (every rank computes it in full from the same stack output), so layout-invariant by
construction. Given the gradient at each head's output (float32, the loss's):
- a head (`proj_out`, `audio_proj_out`, float32 modules): its weight and bias gradients are FP32
  chains over its rows in ascending logical-key order (`f32_row_mm`, `row_sum`: the torch chains'
  bits on the contract backends, as the forward's float32 modules use `chain_mm`; the baseline sums
  its own way), FP32 results; the
  gradient at its input n is one FP32 chain over its C output channels, rounded once to n's dtype
  (the stack's);
- `norm_out.norm` (the block's modulated RMSNorm backward, `rms_modulate_bwd`): the gradient at the
  stack's output for the video and audio rows (text rows reach no head: +0), and per row the
  weight's, scale's and shift's shares; the weight's gradient is the chain over the video and audio
  rows together in key order, the AdaLN table's [T, 2D] gradient the chain per timestep over its
  rows in key order (`segment_sum`);
- `norm_out.linear` (the stack's dtype): weight gradient over the timesteps in index order
  (`mm_few_k`), bias gradient `chain_sum` over them, the gradient at silu(temb) one FP32 chain over
  the table's 2D columns ascending, then silu's backward: norm_out's share of d temb, FP32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.contract import strict_mode
from h3lab.model.embed import Embedded, f32_row_mm
from h3lab.model.head import ModelOutput, norm_out_table
from h3lab.model.weights import ModelWeights
from h3lab.ops.elementwise import silu
from h3lab.ops.fixed import chain_sum, round_to
from h3lab.ops.rows import key_order

F32 = torch.float32


@dataclass(frozen=True, eq=False)
class HeadGrads:
    d_hidden: Tensor  # [S, D] the gradient at the stack's output, all rows in packed order, its dtype; text rows +0
    grads: dict[str, Tensor]  # norm_out.*, proj_out.*, audio_proj_out.*: each in its parameter's dtype
    dtemb: Tensor  # [T, E] float32: norm_out's share of d temb


def head_backward(
    weights: ModelWeights, hidden_SD: Tensor, emb: Embedded, d_out: ModelOutput, *, backend: Backend
) -> HeadGrads:
    """Backward of `head(weights, hidden_SD, emb)` given the gradient at its output.

    Args:
        hidden_SD: the stack's output, all S rows in packed order (what `head` read).
        emb: the forward's `Embedded` (temb, the rows of each modality, their keys and timesteps).
        d_out: float32 gradients shaped as the head's output (video [Nv, Cv], audio [Na, Ca]).

    Raises:
        ValueError: a gradient of another shape or dtype than the head's output.
    """
    inputs = emb.inputs
    for name, d, rows, module in (
        ("video", d_out.video, inputs.video_rows, "proj_out"),
        ("audio", d_out.audio, inputs.audio_rows, "audio_proj_out"),
    ):
        want = [rows.shape[0], weights.tensor(f"{module}.weight").shape[0]]
        if list(d.shape) != want or d.dtype != F32:
            raise ValueError(f"d_out.{name}: {d.dtype} {list(d.shape)}; allowed: torch.float32 {want}, the head's")
    be = backend
    with strict_mode(), torch.no_grad():
        shift_TD, scale_TD = norm_out_table(weights, emb.batch.temb, backend)
        d_hidden, grads, shares = torch.zeros_like(hidden_SD), {}, []
        for module, idx, d in (
            ("proj_out", inputs.video_indices, d_out.video),
            ("audio_proj_out", inputs.audio_indices, d_out.audio),
        ):
            t, keys = inputs.timestep_indices[idx], inputs.logical_keys[idx]
            dx, share, module_grads = _rows_backward(
                weights, module, hidden_SD[idx], shift_TD[t], scale_TD[t], keys, d, be
            )
            d_hidden[idx] = dx
            grads |= module_grads
            shares.append((share, t, keys))
        norm_grads, dtemb = _norm_out_backward(weights, emb.batch.temb, shares, be)
    return HeadGrads(d_hidden=d_hidden, grads=grads | norm_grads, dtemb=dtemb)


def _rows_backward(
    weights: ModelWeights,
    module: str,
    x_RD: Tensor,
    shift_RD: Tensor,
    scale_RD: Tensor,
    keys_R2: Tensor,
    d_RC: Tensor,
    be: Backend,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor], dict[str, Tensor]]:
    """One head and norm_out's RMSNorm on its rows: (d x [R, D] in the stack's dtype, norm_out's per-row
    shares (weight, shift, scale: FP32 [R, D] each), the head's weight and bias gradients)."""
    w = lambda n: weights.tensor(n).to(x_RD.device)  # noqa: E731
    act, eps, wn = x_RD.dtype, weights.config.final_norm_eps, w("norm_out.norm.weight")
    n_RD = be.rms_modulate_fwd(x_RD, wn, scale_RD, shift_RD, eps, act)  # the head's input, as the forward made it
    order = key_order(keys_R2)
    grads = {f"{module}.weight": f32_row_mm(be, d_RC, n_RD, order), f"{module}.bias": be.row_sum(d_RC, order)}
    dn = be.round(be.chain_mm(d_RC, w(f"{module}.weight")), act)  # [R, D]: k = C ascending, one rounding
    dx, dwn_rows, d_scale, d_shift = be.rms_modulate_bwd(dn, x_RD, wn, scale_RD, eps)
    return be.round(dx, act), (dwn_rows, d_shift, d_scale), grads


def _norm_out_backward(
    weights: ModelWeights,
    temb_TE: Tensor,
    shares: list[tuple[tuple[Tensor, Tensor, Tensor], Tensor, Tensor]],
    be: Backend,
) -> tuple[dict[str, Tensor], Tensor]:
    """norm_out's weight and AdaLN linear from the per-row shares of both heads' rows (each with its
    timestep indices and keys): (their gradients, norm_out's share of d temb [T, E] FP32)."""
    dev, T = temb_TE.device, temb_TE.shape[0]
    wn, w_lin, b_lin = (
        weights.tensor(f"norm_out.{n}").to(dev) for n in ("norm.weight", "linear.weight", "linear.bias")
    )
    cat = lambda j: torch.cat([s[j] for s, _, _ in shares])  # noqa: E731
    segments, keys = torch.cat([t for _, t, _ in shares]), torch.cat([k for _, _, k in shares])
    order = key_order(keys)  # video and audio rows together, ascending keys
    (dwn,), (d_shift, d_scale) = be.chain_sums([cat(0)], [cat(1), cat(2)], segments, T, order)
    d_table = torch.cat([d_shift, d_scale], dim=1)  # [T, 2D]: shift first, as the table is laid out
    st = round_to(silu(temb_TE), w_lin.dtype)  # the table's input, as norm_out_table made it
    grads = {
        "norm_out.norm.weight": be.round(dwn, wn.dtype),
        "norm_out.linear.weight": be.mm_few_k(d_table, st, w_lin.dtype),  # [2D, E]: timesteps in index order
        "norm_out.linear.bias": be.round(chain_sum(d_table), b_lin.dtype),
    }
    dst = be.mm(d_table, w_lin, F32)  # [T, E]: one FP32 chain over the 2D table columns ascending
    return grads, be.silu_bwd(dst, temb_TE)
