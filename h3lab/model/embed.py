"""Everything before the block stack: timestep embedding, per-modality input projections, token refiner, packing.

Dimension legend: S packed rows, D hidden, T timesteps, Fq freq_dim, E time_embed_dim, Nv/Na/Nt
video/audio/text rows.

The math is diffusers' `MiniMaxH3Transformer3DModel.forward` (0.42.1) up to the first block:
- video rows -> `proj_in`, audio rows -> `audio_proj_in` (float32 modules, float32 inputs);
- text rows, cast to `context_embedder`'s dtype -> `context_embedder` -> token refiner; the text
  stream's dtype is the packed sequence's (bf16 in the real checkpoint);
- the three streams scattered into a zero buffer of S rows (`index_copy`);
- the sinusoid of the distinct timesteps (flip_sin_to_cos, downscale_freq_shift 0, max_period
  1e4, t unscaled in [0, 1]), then the float32 MLP linear_1 -> SiLU -> linear_2 = temb [T, E].
Arithmetic, per h3lab.contract: every linear is one FP32 chain over k ascending (`chain_mm`, or
the backend's `mm` for bf16 weights), plus the bias in FP32, rounded once to the output dtype;
exp, sin, cos are h3lab's own (elementwise, correctly rounded up to ties). No value depends on how
many rows a call holds, so the embedding is row-invariant; the refiner's attention runs over the
text rows in logical-key order, so permuting rows permutes its output and nothing else.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.batch import ACTIVATION_DTYPES, PackedBatch
from h3lab.contract import check_device, strict_mode
from h3lab.model.inputs import ModelInputs
from h3lab.model.refiner import token_refiner
from h3lab.model.weights import ModelWeights, refiner_tensors
from h3lab.ops.fixed import cos_sin, exp, round_to

MAX_PERIOD = 10_000  # diffusers `Timesteps` default, as MiniMaxH3Transformer3DModel builds it
F32 = torch.float32


@dataclass(frozen=True, eq=False)
class Embedded:
    """The block stack's input (every row, replicated) and what the heads need to select rows."""

    batch: PackedBatch  # hidden_states [S, D], temb [T, E]; grad_out is a zero placeholder (forward only)
    inputs: ModelInputs


@functools.lru_cache(maxsize=8)
def _sinusoid_freqs(half: int, device: torch.device) -> Tensor:
    """[half] float32 exp(-ln(1e4) k / half), k = 0..half-1 (fp32 ops as diffusers', h3lab.ops.fixed.exp):
    a constant of the config, made once per device (callers only read it)."""
    exponent = -math.log(MAX_PERIOD) * torch.arange(half, dtype=F32, device=device)
    return exp(exponent / half)


def timestep_sinusoid(t_T: Tensor, freq_dim: int) -> Tensor:
    """[T, Fq] float32 [cos | sin] of t * exp(-ln(1e4) k / (Fq/2)), k = 0..Fq/2-1 (diffusers' Timesteps),
    for t in [0, 1] as ModelInputs checks it: every angle is within [0, 1], so none is read back."""
    freqs = _sinusoid_freqs(freq_dim // 2, t_T.device)
    cos, sin = cos_sin(t_T.to(F32)[:, None] * freqs[None, :], max_abs=1.0)
    return torch.cat([cos, sin], dim=-1)  # flip_sin_to_cos=True


def linear_f32(x_MK: Tensor, w_NK: Tensor, b_N: Tensor, be: Backend) -> Tensor:
    """x @ w^T + b for a float32 module: one FP32 chain over k ascending (`chain_mm`'s bits on every
    backend), then the bias."""
    if w_NK.dtype != F32:
        raise ValueError(f"linear_f32 is for float32 modules; got weight dtype {w_NK.dtype}; allowed: torch.float32")
    return be.chain_mm(x_MK.to(F32), w_NK.t()) + b_N.to(F32)


def f32_row_mm(be: Backend, a_RN: Tensor, b_RK: Tensor, order: Tensor) -> Tensor:
    """A float32 module's weight gradient: FP32 [N, K] = sum over rows r in `order` of a[r]^T b[r], one
    chain over the rows in that order (h3lab.ops.rows.row_mm's bits at FP32, on every backend)."""
    return be.chain_mm(a_RN.index_select(0, order).t(), b_RK.index_select(0, order))


def time_embedding(weights: ModelWeights, t_T: Tensor, be: Backend) -> Tensor:
    """temb [T, E] float32: the sinusoid, then linear_1 -> SiLU -> linear_2 (float32 `time_embedder`)."""
    w = lambda n: weights.tensor(f"time_embedder.{n}").to(t_T.device)  # noqa: E731
    h = linear_f32(timestep_sinusoid(t_T, weights.config.freq_dim), w("linear_1.weight"), w("linear_1.bias"), be)
    return linear_f32(be.silu(h, F32), w("linear_2.weight"), w("linear_2.bias"), be)


def project_rows(weights: ModelWeights, module: str, rows: Tensor, act: torch.dtype, be: Backend) -> Tensor:
    """`proj_in` / `audio_proj_in` (float32) on latent rows, rounded once to the sequence dtype."""
    w, b = (weights.tensor(f"{module}.{n}").to(rows.device) for n in ("weight", "bias"))
    return round_to(linear_f32(rows, w, b, be), act)


def context_rows(weights: ModelWeights, text_rows: Tensor, be: Backend) -> Tensor:
    """`context_embedder` on the text rows, in its dtype (which sets the sequence's): the refiner's input."""
    w, b = (weights.tensor(f"context_embedder.{n}").to(text_rows.device) for n in ("weight", "bias"))
    act = w.dtype
    if act not in ACTIVATION_DTYPES:
        raise ValueError(f"context_embedder dtype {act} sets the sequence dtype; allowed: {list(ACTIVATION_DTYPES)}")
    return round_to(be.mm(text_rows.to(act), w.t()) + b.to(F32), act)


def refiner_weights(weights: ModelWeights, device: torch.device) -> tuple[list[dict[str, Tensor]], Tensor]:
    """(each refiner block's tensors, keyed without `token_refiner.refiner_blocks.{j}.`; the final norm's weight)."""
    n = weights.config.num_refiner_layers
    blocks = [{k: t.to(device) for k, t in refiner_tensors(weights, j).items()} for j in range(n)]
    return blocks, weights.tensor("token_refiner.final_norm.weight").to(device)


def text_stream(
    weights: ModelWeights, text_rows: Tensor, keys_R2: Tensor, be: Backend, *, order: Tensor | None = None
) -> Tensor:
    """`context_embedder` (its dtype sets the sequence's), then the token refiner and its final norm."""
    blocks, final = refiner_weights(weights, text_rows.device)
    x_RD = context_rows(weights, text_rows, be)
    return token_refiner(blocks, final, x_RD, keys_R2, weights.config, be, order=order)


def embed(weights: ModelWeights, inputs: ModelInputs, *, backend: Backend) -> Embedded:
    """The packed sequence the first block reads, with temb; computed in full (replicated under a layout).

    Raises:
        ValueError: inputs that do not fit the config, an unsupported device or dtype, TF32 on.
    """
    inputs.check_config(weights.config)
    check_device(inputs.device)
    be = backend
    with strict_mode(), torch.no_grad():
        keys = inputs.logical_keys[inputs.text_indices]
        text = text_stream(weights, inputs.text_rows, keys, be, order=inputs.key_order("text"))
        act, (S, D) = text.dtype, (inputs.num_rows, weights.config.hidden_size)
        x_SD = torch.zeros(S, D, dtype=act, device=inputs.device)
        x_SD[inputs.text_indices] = text
        x_SD[inputs.video_indices] = project_rows(weights, "proj_in", inputs.video_rows, act, be)
        x_SD[inputs.audio_indices] = project_rows(weights, "audio_proj_in", inputs.audio_rows, act, be)
        temb = time_embedding(weights, inputs.timestep, be)
    batch = PackedBatch(
        hidden_states=x_SD,
        temb=temb,
        adaln_indices=inputs.adaln_indices,
        position_ids=inputs.position_ids,
        logical_keys=inputs.logical_keys,
        grad_out=torch.zeros((), dtype=act, device=inputs.device).expand(S, D),  # no memory; forward only
    )
    return Embedded(batch=batch, inputs=inputs)
