"""The rectified-flow objective H3 is trained with: noising from a seed, the loss, and its gradient.

Dimension legend: Nv/Na video/audio rows, Cv/Ca their channels, n a modality's generated rows, C its
channels.

The target is v = data - noise, the velocity H3's sampler steps along. H3's convention
(h3lab.model.trajectory): the model sees t = 1 - sigma (t = 0 noise, t = 1 clean) and the sampler's
denoised estimate is x0 = x + (1 - t) * v, a step towards the data along +v. With
x_sigma = (1 - sigma) * data + sigma * noise, the target that agrees with it is v = data - noise:
then x_sigma + sigma * v = data (exactly, in real arithmetic), so the velocity the model learns is
the one its sampler integrates. "noise - data", the common target, belongs to samplers that step
x0 = x - sigma * v (diffusers' FlowMatchEulerDiscreteScheduler); under H3's sampler a model trained
on it would walk away from the data.

One step's sample, from its seed (`FlowObjective.sample`, one CPU torch.Generator, in this order):
- sigma per modality (video, then audio): u ~ U[0, 1) in float32, then the modality's shift s as its
  sampling schedule applies it (`flow_sigmas`): sigma = s u / (1 + (s - 1) u), s = 12 for video and
  3 for audio by default. The sampler's sigmas are this map of a uniform grid, so training draws
  noise levels with the density the sampler visits them.
- noise ~ N(0, 1) in float32, video rows then audio rows, drawn row after row in ascending logical-key
  order of the generated rows, so a row's noise follows its key, not its place in the packing.
- only generated rows are noised and scored. Conditioning rows (the leading `num_condition_*_rows`:
  keyframes, audio references) and the text keep their values, at the timesteps `row_timesteps`
  gives them: text at the video t, keyframes at max(t, 0.999), audio references at 1.

The loss (`FlowObjective.loss`): per modality the mean over its generated rows and channels of
(prediction - target)^2, weighted: loss = w_video * loss_video + w_audio * loss_audio (FP32, video
first). Order: per row a balanced tree over channels (`pair_sum`), then a balanced tree over the
rows in ascending logical-key order, then one IEEE division by the element count (as a float32:
exact up to 2^24 elements). A modality without generated rows scores +0. Its gradient, the model's
upstream gradient (float32, as the heads' output), is elementwise: (prediction - target) * c with
c = 2 w / count rounded once to float32, +0 on rows not scored. The model's output is the same on
every rank and the loss orders rows by key, so loss and gradient are the same bytes under any
layout, row order or padding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.batch import check_seed
from h3lab.model.head import ModelOutput
from h3lab.model.inputs import ModelInputs
from h3lab.model.packing import row_timesteps
from h3lab.model.trajectory import AUDIO_SHIFT, VIDEO_SHIFT
from h3lab.ops.fixed import pair_sum

MODALITIES = ("video", "audio")  # the scored outputs, in the loss's order
F32 = torch.float32


@dataclass(frozen=True, eq=False)
class FlowSample:
    """One noised request: what the model reads and what the loss scores."""

    inputs: ModelInputs  # generated rows noised; timestep / timestep_indices from `row_timesteps`
    target: ModelOutput  # float32 data - noise on the generated rows, +0 on conditioning rows
    sigmas: dict[str, float]  # per modality, as drawn; the model sees t = 1 - sigma (float32)
    scored: dict[str, Tensor]  # per modality, its generated rows (indices into its rows) in ascending key order


@dataclass(frozen=True, eq=False)
class FlowLoss:
    total: Tensor  # [] float32, the weighted sum
    per_modality: dict[str, Tensor]  # [] float32 each, unweighted means
    grad: ModelOutput  # float32 d total / d prediction, shaped as the model's output


@dataclass(frozen=True, kw_only=True, eq=False)
class FlowObjective:
    """The rectified-flow objective's parameters; validated on construction (one ValueError each)."""

    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)  # per modality; missing ones weigh 1
    video_shift: float = VIDEO_SHIFT
    audio_shift: float = AUDIO_SHIFT

    def __post_init__(self) -> None:
        if not isinstance(self.weights, Mapping):
            raise ValueError(
                f"weights={self.weights!r}; allowed: a mapping of modality -> weight, modalities {MODALITIES}"
            )
        for m, w in self.weights.items():
            if m not in MODALITIES:
                raise ValueError(f"weights: unknown modality {m!r}; allowed: {list(MODALITIES)}")
            if not _finite_number(w) or w < 0:
                raise ValueError(f"weights[{m!r}]={w!r}; allowed: a finite number >= 0")
        for name in ("video_shift", "audio_shift"):
            s = getattr(self, name)
            if not _finite_number(s) or s <= 0:
                raise ValueError(f"{name}={s!r}; allowed: a finite number > 0")
        object.__setattr__(self, "weights", {m: float(self.weights.get(m, 1.0)) for m in MODALITIES})

    def sample(self, inputs: ModelInputs, seed: int) -> FlowSample:
        """`inputs` (its video and audio rows the clean data) noised for one step drawn from `seed`.

        Raises:
            ValueError: a seed outside [0, 2**64 - 1].
        """
        gen = torch.Generator().manual_seed(check_seed(seed))
        u = torch.rand(len(MODALITIES), generator=gen, dtype=F32)
        sigmas, rows, targets, scored = {}, {}, {}, {}
        for i, (m, shift) in enumerate(zip(MODALITIES, (self.video_shift, self.audio_shift), strict=True)):
            sigma = shift * u[i] / (1 + (shift - 1) * u[i])  # float32, as flow_sigmas shifts its grid
            data, nc, order = _generated(inputs, m)
            noise = torch.empty_like(data, dtype=F32)
            noise[order] = torch.randn(data.shape, generator=gen, dtype=F32).to(data.device)  # row j: j-th key
            s = torch.full((), float(sigma), dtype=F32, device=data.device)  # a fill: no copy, no host sync
            cond = getattr(inputs, f"{m}_rows")[:nc]
            rows[m] = torch.cat([cond, (1 - s) * data + s * noise])
            targets[m] = torch.cat([torch.zeros_like(cond), data - noise])
            sigmas[m], scored[m] = float(sigma), order
        t = {m: float(1 - torch.tensor(sigmas[m], dtype=F32)) for m in MODALITIES}  # t = 1 - sigma, float32
        timestep, indices = row_timesteps(inputs, t["video"], t["audio"])
        noised = inputs.replace(
            video_rows=rows["video"], audio_rows=rows["audio"], timestep=timestep, timestep_indices=indices
        )
        return FlowSample(noised, ModelOutput(**targets), sigmas, scored)

    def loss(self, sample: FlowSample, output: ModelOutput) -> FlowLoss:
        """The weighted loss of `output` (the model's prediction on `sample.inputs`) and its gradient.

        Raises:
            ValueError: a prediction of another shape or dtype than the target.
        """
        per_modality, grads = {}, {}
        for m in MODALITIES:
            pred, target = getattr(output, m), getattr(sample.target, m)
            if pred.shape != target.shape or pred.dtype != F32:
                raise ValueError(
                    f"output.{m}: {pred.dtype} {list(pred.shape)}; allowed: torch.float32 {list(target.shape)}"
                )
            order = sample.scored[m]
            nc = pred.shape[0] - order.numel()
            e = pred[nc:] - target[nc:]
            count = e.numel()
            grads[m] = torch.zeros_like(pred)
            if count == 0:
                per_modality[m] = torch.zeros((), dtype=F32, device=pred.device)
                continue
            total = pair_sum(pair_sum(e * e, -1)[order], -1)  # channels, then rows in key order
            # the FP32 scalars made on the device (torch.full): a host tensor copied there would wait for the GPU
            per_modality[m] = total / torch.full((), float(count), dtype=F32, device=pred.device)
            grads[m][nc:] = e * torch.full((), 2.0 * self.weights[m] / count, dtype=F32, device=pred.device)
        w = {m: torch.full((), float(self.weights[m]), dtype=F32, device=output.video.device) for m in MODALITIES}
        total = w["video"] * per_modality["video"] + w["audio"] * per_modality["audio"]
        return FlowLoss(total, per_modality, ModelOutput(**grads))


def _generated(inputs: ModelInputs, modality: str) -> tuple[Tensor, int, Tensor]:
    """(the generated rows' clean data, float32; the count of conditioning rows before them; the generated
    rows' indices in ascending logical-key order)."""
    nc = getattr(inputs, f"num_condition_{modality}_rows")
    data = getattr(inputs, f"{modality}_rows")[nc:]
    return data, nc, inputs.key_order(f"{modality}.generated")


def _finite_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
