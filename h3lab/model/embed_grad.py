"""The backward of everything before the block stack: input projections, context embedder and token
refiner, the time MLP.

Dimension legend: S packed rows, D hidden, T timesteps, F freq_dim, E time_embed_dim, H
time_embed_hidden_dim (no heads here), R one stream's rows, C its channels.

Replicated (every rank computes it in full from the stack's input gradient, gathered to all S rows
in packed order, and the summed d temb), so layout-invariant by construction. The inputs are data:
only parameters get gradients.
- `proj_in`, `audio_proj_in` (float32): weight and bias gradients are FP32 chains over the
  stream's rows in ascending logical-key order (`f32_row_mm`, `row_sum`: the torch chains' bits on
  the contract backends, as the forward's float32 modules use `chain_mm`; the baseline sums its own
  way); the forward's rounding to the sequence dtype passes the gradient on unchanged, as
  autograd's cast does.
- the text stream: the token refiner's backward (h3lab.model.refiner_grad), then
  `context_embedder` (the sequence's dtype) through the backend's row GEMM and row sum, in key order.
- `time_embedder` (float32): linear_2 and linear_1's weight and bias gradients are FP32 chains over
  the timesteps in index order (ascending values, as `row_timesteps` gives them); the gradient at
  silu(h) is one FP32 chain over E ascending, then silu's backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.contract import strict_mode
from h3lab.model.embed import context_rows, f32_row_mm, linear_f32, refiner_weights, timestep_sinusoid
from h3lab.model.inputs import ModelInputs
from h3lab.model.refiner_grad import token_refiner_backward
from h3lab.model.weights import ModelWeights
from h3lab.ops.rows import key_order
from h3lab.rowplan import know_facts

F32 = torch.float32


def embed_backward(
    weights: ModelWeights, inputs: ModelInputs, d_hidden_SD: Tensor, dtemb_TE: Tensor, *, backend: Backend
) -> dict[str, Tensor]:
    """Gradients of every parameter `embed` reads, by diffusers name, each in its parameter's dtype.

    Args:
        inputs: the request `embed` read (its rows, keys and timesteps).
        d_hidden_SD: the gradient at the stack's input, all S rows in packed order, the sequence dtype.
        dtemb_TE: the gradient at temb [T, E], float32 (every AdaLN's share, summed).

    Raises:
        ValueError: a gradient of another shape or dtype than what `embed` made.
    """
    c, S, T = weights.config, inputs.num_rows, inputs.timestep.shape[0]
    act = weights.tensor("context_embedder.weight").dtype  # the sequence's dtype, as `embed` sets it
    if tuple(d_hidden_SD.shape) != (S, c.hidden_size) or d_hidden_SD.dtype != act:
        raise ValueError(
            f"d_hidden_SD: {d_hidden_SD.dtype} {list(d_hidden_SD.shape)}; allowed: {act} [{S}, {c.hidden_size}]"
        )
    if tuple(dtemb_TE.shape) != (T, c.time_embed_dim) or dtemb_TE.dtype != F32:
        raise ValueError(
            f"dtemb_TE: {dtemb_TE.dtype} {list(dtemb_TE.shape)}; allowed: torch.float32 [{T}, {c.time_embed_dim}]"
        )
    be, keys = backend, inputs.logical_keys
    with strict_mode(), torch.no_grad():
        grads = {}
        for module, rows, idx, part in (
            ("proj_in", inputs.video_rows, inputs.video_indices, "video"),
            ("audio_proj_in", inputs.audio_rows, inputs.audio_indices, "audio"),
        ):
            order = inputs.key_order(part)
            d_RD = d_hidden_SD[idx]
            grads[f"{module}.weight"] = f32_row_mm(be, d_RD, rows, order)  # [D, C] FP32
            grads[f"{module}.bias"] = be.row_sum(d_RD, order)
        ti = inputs.text_indices
        order = inputs.key_order("text")
        grads |= text_stream_backward(weights, inputs.text_rows, keys[ti], d_hidden_SD[ti], be, order=order)
        grads |= time_embedding_backward(weights, inputs.timestep, dtemb_TE, be)
    return grads


def text_stream_backward(
    weights: ModelWeights,
    text_rows_RC: Tensor,
    keys_R2: Tensor,
    d_RD: Tensor,
    be: Backend,
    *,
    order: Tensor | None = None,
) -> dict[str, Tensor]:
    """`context_embedder` and the token refiner's gradients, given d of `text_stream`'s output
    (`order`: key_order(keys_R2) where the caller holds it already)."""
    order = key_order(keys_R2) if order is None else order
    w, b = (weights.tensor(f"context_embedder.{n}").to(d_RD.device) for n in ("weight", "bias"))
    blocks, final = refiner_weights(weights, d_RD.device)
    x_RD = context_rows(weights, text_rows_RC, be)  # the refiner's input, as the forward made it
    dx_RD, refiner = token_refiner_backward(blocks, final, x_RD, keys_R2, d_RD, weights.config, be, order=order)
    grads = {f"token_refiner.{k}": v for k, v in refiner.items()}
    grads["context_embedder.weight"] = be.row_mm(dx_RD, text_rows_RC.to(w.dtype), order, w.dtype)  # [D, Ct]
    grads["context_embedder.bias"] = be.round(be.row_sum(dx_RD, order), b.dtype)
    return grads


def time_embedding_backward(weights: ModelWeights, t_T: Tensor, dtemb_TE: Tensor, be: Backend) -> dict[str, Tensor]:
    """The float32 `time_embedder`'s four gradients given d temb (the sinusoid has no parameters)."""
    w = lambda n: weights.tensor(f"time_embedder.{n}").to(t_T.device)  # noqa: E731
    sinusoid_TF = timestep_sinusoid(t_T, weights.config.freq_dim)
    h_TH = linear_f32(sinusoid_TF, w("linear_1.weight"), w("linear_1.bias"), be)
    steps = torch.arange(t_T.shape[0], device=t_T.device)  # the rows of these chains: timesteps in index order
    if t_T.shape[0]:  # an arange: its row reductions need not read it back
        know_facts(steps, (0, t_T.shape[0] - 1, True))
    grads = {
        "time_embedder.linear_2.weight": f32_row_mm(be, dtemb_TE, be.silu(h_TH, F32), steps),  # [E, H]
        "time_embedder.linear_2.bias": be.row_sum(dtemb_TE, steps),
    }
    dh_TH = be.silu_bwd(be.chain_mm(dtemb_TE, w("linear_2.weight")), h_TH)  # k = E ascending
    grads["time_embedder.linear_1.weight"] = f32_row_mm(be, dh_TH, sinusoid_TF, steps)  # [H, F]
    grads["time_embedder.linear_1.bias"] = be.row_sum(dh_TH, steps)
    return grads
