"""h3lab's own objective as a loss autograd can differentiate: `flow_matching_loss`.

`h3lab.train.objective.FlowObjective.loss` computes the rectified-flow loss and its gradient in
closed form, in a fixed order (h3lab's training step backpropagates that gradient). Here the same
function is a `torch.autograd.Function`: its value is `FlowObjective.loss(...).total` and its
backward hands the model's heads `FlowObjective.loss(...).grad` times the incoming gradient (1 for
`loss.backward()`: an exact multiply). So a script that trains a parallelized model on
`flow_matching_loss` with `h3lab.optim` gives, step for step, the bytes of `h3lab run --train-steps`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from h3lab.model.head import ModelOutput
from h3lab.train.objective import FlowObjective, FlowSample


def flow_matching_loss(objective: FlowObjective, sample: FlowSample, video: Tensor, audio: Tensor) -> Tensor:
    """The objective's weighted loss ([] float32) of the predictions `video` [Nv, Cv], `audio` [Na, Ca]
    (float32, in `sample.inputs`' row order) on `sample`, differentiable with respect to both.

    Raises:
        ValueError: predictions of other shapes or dtypes than the sample's targets.
    """
    return _FlowLoss.apply(objective, sample, video, audio)


class _FlowLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, objective: FlowObjective, sample: FlowSample, video: Tensor, audio: Tensor) -> Tensor:
        loss = objective.loss(sample, ModelOutput(video=video.detach(), audio=audio.detach()))
        ctx.grad = loss.grad
        return loss.total

    @staticmethod
    def backward(ctx: Any, d_total: Tensor) -> tuple[None, None, Tensor, Tensor]:
        g: ModelOutput = ctx.grad
        return None, None, g.video * d_total, g.audio * d_total
