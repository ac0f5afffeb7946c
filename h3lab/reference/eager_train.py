"""The training step people run instead of h3lab's: diffusers' `MiniMaxH3Transformer3DModel` (0.42.1) of
the trained depth, autograd, the rectified-flow loss in plain PyTorch, `torch.nn.utils.clip_grad_norm_`
and `torch.optim.AdamW`. The reference point of the training step's timings (h3lab.bench.train_step).

Mixed precision as apex's O2 and Megatron-LM keep it ("master weights"): the model holds the
checkpoint's dtypes (bf16 block stack, context embedder, token refiner and norm_out; float32 patch
projections, time MLP and heads), so forward and backward run in those dtypes and a bf16 parameter's
gradient is bf16. Every bf16 parameter has an FP32 master copy that the optimizer owns; a float32
parameter is its own master. One step:
1. forward (`set_to_none` gradients first), the loss: per modality the mean squared error of the
   generated rows (those after the leading conditioning rows) against the target, weighted, summed;
2. backward (autograd);
3. each bf16 gradient widened into its master's FP32 `.grad` (buffers made once), then
   `clip_grad_norm_` over the masters' gradients;
4. `AdamW.step()` on the masters (`fused=True` on CUDA, `foreach=True` on CPU), then each master
   rounded into its bf16 parameter (`copy_`: round to nearest even).
Attention goes through diffusers' dispatch, torch SDPA, which picks its own backend. Nothing here
fixes a reduction order: its bits are torch's and the device's.

Dimension legend: Nv/Na video/audio rows, Cv/Ca their channels.

diffusers is an optional dependency: `pip install -e ".[parity]"`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from h3lab.config import BLOCK_PREFIX, H3Config, model_param_shapes
from h3lab.model.head import ModelOutput
from h3lab.model.inputs import ModelInputs
from h3lab.model.weights import ModelWeights
from h3lab.reference.parity import diffusers_module, model_velocity

PHASES = ("forward", "backward", "clip", "update")  # `mark` receives each name as its phase ends


def depth_state(weights: ModelWeights, blocks: Sequence[int]) -> dict[str, Tensor]:
    """Copies (clones) of the parameters of the depth `blocks` under the names of a model that has only
    those blocks: block blocks[j] becomes `transformer_blocks.{j}`; every non-block parameter as it is.

    Raises:
        ValueError: a block the provider does not have (the provider's own refusal).
    """
    out = {k: weights.tensor(k).detach().clone() for k in model_param_shapes(weights.config, 0)}
    for j, i in enumerate(blocks):
        out |= {f"{BLOCK_PREFIX}{j}.{k}": t.detach().clone() for k, t in weights.block(i).items()}
    return out


@dataclass(frozen=True, eq=False)
class EagerStep:
    loss: Tensor  # [] float32, the weighted loss
    loss_per_modality: dict[str, Tensor]  # "video", "audio": [] float32, unweighted means
    grad_norm: Tensor  # [] float32: clip_grad_norm_'s total norm, before clipping


class EagerTrainer:
    """diffusers' model of `config.num_layers` blocks holding `tensors` (as `depth_state` names them, in
    their own dtypes and on their device) and torch's AdamW on FP32 masters (module docstring)."""

    def __init__(
        self,
        config: H3Config,
        tensors: Mapping[str, Tensor],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        max_grad_norm: float,
        loss_weights: Mapping[str, float],
    ) -> None:
        """Raises ValueError naming a tensor that is missing, unexpected or of another shape (the model's
        `load_state_dict`, strict), or tensors on several devices."""
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"tensors on devices {sorted(map(str, devices))}; allowed: one device")
        self.device = devices.pop()
        dm = diffusers_module()
        with torch.device("meta"):  # no init, no memory: every parameter is assigned below
            model = dm.MiniMaxH3Transformer3DModel(**config.to_dict())
        try:
            model.load_state_dict(dict(tensors), strict=True, assign=True)  # the tensors themselves, their dtypes
        except RuntimeError as err:
            why = " ".join(str(err).split())  # torch's message spans lines
            raise ValueError(
                f"tensors do not fit a model of {config.num_layers} blocks: {why}; allowed: model_param_shapes(config)"
            ) from None
        model.rope = dm.MiniMaxH3RotaryPosEmbed(config.rope_freq_dim, config.rope_theta).to(self.device)  # a buffer
        self.model, self.config, self.max_grad_norm = model.train(), config, max_grad_norm
        self.loss_weights = {m: float(loss_weights.get(m, 1.0)) for m in ("video", "audio")}
        self.params = [p for p in model.parameters()]
        self.low = [(p, p.detach().float()) for p in self.params if p.dtype != torch.float32]  # (bf16, master)
        for _, master in self.low:
            master.grad = torch.empty_like(master)
        self.masters = [p for p in self.params if p.dtype == torch.float32] + [mst for _, mst in self.low]
        fast = {"fused": True} if self.device.type == "cuda" else {"foreach": True}
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **fast)

    def step(self, inputs: ModelInputs, target: ModelOutput, mark: Callable[[str], None] | None = None) -> EagerStep:
        """One training step on `inputs` (noised) against `target` (module docstring); `mark(phase)` is
        called as each of PHASES ends (a timer's hook)."""
        mark = mark or (lambda phase: None)
        for p in self.params:
            p.grad = None
        with torch.enable_grad():
            video, audio = model_velocity(self.model, inputs)
            per = {
                "video": _mse(video, target.video, inputs.num_condition_video_rows),
                "audio": _mse(audio, target.audio, inputs.num_condition_audio_rows),
            }
            loss = self.loss_weights["video"] * per["video"] + self.loss_weights["audio"] * per["audio"]
            mark("forward")
            loss.backward()
        mark("backward")
        with torch.no_grad():
            for p, master in self.low:
                master.grad.copy_(p.grad)
            norm = torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm)
            mark("clip")
            self.optimizer.step()
            for p, master in self.low:
                p.copy_(master)
        mark("update")
        return EagerStep(loss.detach(), {k: v.detach() for k, v in per.items()}, norm)

    def named_parameters(self) -> dict[str, Tensor]:
        """The model's parameters (after a step: the masters rounded to each parameter's dtype)."""
        return {k: p.detach() for k, p in self.model.named_parameters()}


def _mse(pred_NC: Tensor, target_NC: Tensor, num_condition: int) -> Tensor:
    """The mean squared error of the generated rows; +0 where there are none (as the canonical loss)."""
    if pred_NC.shape[0] == num_condition:
        return pred_NC.new_zeros(())
    return F.mse_loss(pred_NC[num_condition:], target_NC[num_condition:])
