"""Everything after the block stack: `norm_out` and the two float32 output heads, then the row selection.

Dimension legend: S packed rows, D hidden, T timesteps, Nv/Na video/audio rows, Cv/Ca their channels.

diffusers' `MiniMaxH3AdaLayerNormOut` + `proj_out` / `audio_proj_out` (0.42.1):
- table = linear(silu(temb) cast to the linear's dtype) [T, 2D]; shift = first half, scale = second;
- n = RMSNorm(x; norm_out.norm, final_norm_eps) * (1 + scale[timestep_indices]) + shift[...],
  at the block stack's dtype;
- n cast to float32, both heads (float32 linears), then the video / audio rows selected.
Here the modulation is one FP32 op rounded once to the stack dtype (the block's `rms_modulate_fwd`),
and the heads run only on the rows they keep: both are row-local, so selecting first changes no bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.contract import strict_mode
from h3lab.model.embed import Embedded, linear_f32
from h3lab.model.weights import ModelWeights
from h3lab.ops.elementwise import silu
from h3lab.ops.fixed import round_to


@dataclass(frozen=True, eq=False)
class ModelOutput:
    """The velocity the model predicts, float32, in `video_indices` / `audio_indices` order."""

    video: Tensor  # [Nv, Cv]
    audio: Tensor  # [Na, Ca]


def norm_out_table(weights: ModelWeights, temb_TE: Tensor, backend: Backend) -> tuple[Tensor, Tensor]:
    """(shift [T, D], scale [T, D]) in `norm_out.linear`'s dtype: silu in FP32, one cast, one FP32 chain."""
    be = backend
    w, b = (weights.tensor(f"norm_out.linear.{n}").to(temb_TE.device) for n in ("weight", "bias"))
    st = round_to(silu(temb_TE), w.dtype)
    table = round_to(be.mm(st, w.t()) + b.to(torch.float32), w.dtype)
    D = weights.config.hidden_size
    return table[:, :D], table[:, D:]  # shift first, then scale (diffusers' chunk order)


def output_rows(
    weights: ModelWeights,
    module: str,
    x_RD: Tensor,
    timestep_indices_R: Tensor,
    shift_TD: Tensor,
    scale_TD: Tensor,
    *,
    backend: Backend,
) -> Tensor:
    """norm_out then the head `module` ("proj_out" / "audio_proj_out") on some rows: [R, C] float32, row-local."""
    be, dev = backend, x_RD.device
    w = lambda n: weights.tensor(n).to(dev)  # noqa: E731
    t = timestep_indices_R
    eps = weights.config.final_norm_eps
    n = be.rms_modulate_fwd(x_RD, w("norm_out.norm.weight"), scale_TD[t], shift_TD[t], eps, x_RD.dtype)
    return linear_f32(n, w(f"{module}.weight"), w(f"{module}.bias"), be)


def head(weights: ModelWeights, hidden_SD: Tensor, emb: Embedded, *, backend: Backend) -> ModelOutput:
    """norm_out and both heads on the sequence rows `hidden_SD` (all S rows, packed order, no padding)."""
    inputs, c = emb.inputs, weights.config
    if tuple(hidden_SD.shape) != (inputs.num_rows, c.hidden_size):
        raise ValueError(f"hidden_SD has shape {list(hidden_SD.shape)}; expected [{inputs.num_rows}, {c.hidden_size}]")
    with strict_mode(), torch.no_grad():
        shift_TD, scale_TD = norm_out_table(weights, emb.batch.temb, backend)
        out = {
            name: output_rows(
                weights, module, hidden_SD[rows], inputs.timestep_indices[rows], shift_TD, scale_TD, backend=backend
            )
            for name, rows, module in (
                ("video", inputs.video_indices, "proj_out"),
                ("audio", inputs.audio_indices, "audio_proj_out"),
            )
        }
    return ModelOutput(**out)
