"""The parallelized model's forward, and its backward behind a `torch.autograd.Function`.

The arithmetic is h3lab's training step's, not a second implementation: the forward is
`h3lab.model.backward.model_forward` through every block (keeping each block's input rows), the
backward `h3lab.model.backward.model_backward` from the gradient at the two heads' outputs, which
autograd hands in from whatever loss the caller computed (`h3lab.train.grads.model_grads` calls the
same two functions around the rectified-flow loss). So under every layout the output, and every
parameter's gradient for a given output gradient, have the bytes of the single process.

- The output is the same on every rank (the stack's output is gathered before the heads), so a loss
  the caller computes from it the same way on every rank has the same bits and the same gradient.
- Gradients go to the parameters as this rank holds them (h3lab.nn.state): shards of the unit-sharded
  weights, whole tensors elsewhere, each in its parameter's dtype. Several backwards before an
  optimizer step add into `.grad` in call order: autograd's elementwise add, one rounding to the
  parameter's dtype per backward, the same on every rank.
- One backward per forward (`retain_graph=True` and a second backward raise: the forward's stored
  rows go as the blocks are done). Gradients flow to the parameters only, never to the inputs.
- Where grad is disabled (`torch.no_grad()`, `torch.inference_mode()`) or no parameter requires it,
  the forward is `h3lab.model.transformer_forward`, which keeps nothing for a backward (its output
  has the same bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from h3lab.contract import check_strict_flags
from h3lab.model.backward import ModelForward, ModelGradients, model_backward, model_forward
from h3lab.model.head import ModelOutput
from h3lab.model.inputs import ModelInputs
from h3lab.model.transformer import transformer_forward
from h3lab.nn.state import ParallelState
from h3lab.units import assemble_unit_grads


@dataclass(frozen=True, eq=False)
class _Call:
    """What one forward call's Function needs beside the parameter tensors."""

    state: ParallelState
    inputs: ModelInputs


def velocity(state: ParallelState, params: list[Tensor], inputs: ModelInputs) -> tuple[Tensor, Tensor]:
    """(video [Nv, Cv], audio [Na, Ca]) float32 for `inputs`, recorded for autograd where grad is enabled
    and a parameter requires it (module docstring)."""
    check_strict_flags()
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return _ModelFunction.apply(_Call(state, inputs), *params)
    weights = state.weights([p.detach() for p in params])
    out = transformer_forward(weights, inputs, backend=state.backend, comm=state.comm, rows_shard=state.rows_shard)
    return out.video, out.audio


class _ModelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *params: Tensor) -> tuple[Tensor, Tensor]:
        s = call.state
        fwd = model_forward(
            s.weights(list(params)),
            call.inputs,
            blocks=range(s.config.num_layers),
            backend=s.backend,
            comm=s.comm,
            rows_shard=s.rows_shard,
        )
        ctx.call, ctx.fwd = call, fwd
        s.laps["forward_s"] = fwd.timings
        ctx.save_for_backward(*params)  # autograd refuses the backward if a parameter changed in place since
        # copies: the record holds its output, and an output held by its own ctx is a cycle through
        # autograd's C++ graph that Python's collector cannot see (the graph would outlive its last use)
        return fwd.output.video.clone(), fwd.output.audio.clone()

    @staticmethod
    def backward(ctx: Any, d_video: Tensor, d_audio: Tensor) -> tuple[Tensor | None, ...]:
        params = ctx.saved_tensors
        fwd: ModelForward | None = ctx.fwd
        if fwd is None:
            raise ValueError("a second backward through one forward; allowed: one backward per forward")
        ctx.fwd = None  # the stored rows go with the record (model_backward uses them up)
        check_strict_flags()
        grads = model_backward(fwd, ModelOutput(video=d_video.contiguous(), audio=d_audio.contiguous()))
        ctx.call.state.laps["backward_s"] = grads.timings
        return (None, *_param_grads(ctx.call.state, grads, params))


def _param_grads(state: ParallelState, grads: ModelGradients, params: tuple[Tensor, ...]) -> list[Tensor]:
    """The gradients by parameter, shaped as this rank holds each (`names` order)."""
    by_name = dict(grads.replicated)
    for i, per_unit in grads.units.items():
        shards = assemble_unit_grads(per_unit, state.comm.units)
        by_name |= {f"transformer_blocks.{i}.{k}": v for k, v in shards.items()}
    out = [by_name[n] for n in state.names]
    for name, g, p in zip(state.names, out, params, strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype, (name, g.shape, p.shape, g.dtype, p.dtype)
    return out
