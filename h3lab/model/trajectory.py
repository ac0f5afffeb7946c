"""A short MiniMax-H3 denoising trajectory: rectified-flow Euler steps through the whole canonical transformer.

Dimension legend: Nv/Na video/audio rows, Cv/Ca their channels, N steps.

The sampler is diffusers' `MiniMaxH3Scheduler` (0.42.1) as the H3 pipeline drives it
(`MiniMaxH3SetTimestepsStep`, `MiniMaxH3LoopSchedulerStep`):
- one schedule per modality, sigma = s*b / (1 + (s-1)*b) on b = linspace(1, 0, N+1) in float32,
  shift s = 12 for video, 3 for audio; the model sees t = 1 - sigma (t = 0 noise, t = 1 clean);
- step i evaluates the model once with the generated video rows at t_video[i], text rows at the
  same t, generated audio rows at t_audio[i], keyframe rows at max(t_video[i], 0.999) and audio
  reference rows at 1.0; conditioning rows and the text are never written;
- the model predicts a data-ward velocity v: x0 = x + (1 - t) * v (note the +), then
  x' = r*x + (1 - r)*x0 with r = sigma[i+1] / sigma[i].
The step is fixed-order elementwise FP32 (single IEEE operations, no reduction), so given the same
velocity it gives diffusers' scheduler's bytes; every other bit comes from `transformer_forward`.
Under a layout every rank runs the same trajectory: the model's output is replicated after the
stack, so the latents, their digests and the next step's inputs are the same on every rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.comm import BlockComm
from h3lab.metrics import sha256_tensor
from h3lab.model.inputs import ModelInputs
from h3lab.model.packing import row_timesteps
from h3lab.model.transformer import RowsShard, transformer_forward
from h3lab.model.weights import ModelWeights

VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0  # the released checkpoints' flow shifts (diffusers pipeline)
F32 = torch.float32


@dataclass(frozen=True, eq=False)
class StepLatents:
    video: Tensor  # [Nv, Cv] float32, every video row (conditioning rows unchanged)
    audio: Tensor  # [Na, Ca] float32


@dataclass(frozen=True, eq=False)
class Trajectory:
    """Entry 0 is the starting noise, entry i the latents after step i (N+1 entries)."""

    latents_per_step: tuple[StepLatents, ...]
    digests: tuple[str, ...]  # sha256 of each entry: video bytes then audio bytes (float32, little-endian)
    sigmas_video: Tensor  # [N+1] float32, ending at 0
    sigmas_audio: Tensor


def flow_sigmas(steps: int, shift: float) -> Tensor:
    """[steps+1] float32 sigmas from 1 to 0: `MiniMaxH3Scheduler(shift).set_timesteps(steps + 1).sigmas`.

    Raises:
        ValueError: steps < 1, shift <= 0, or a shift so strong that two float32 sigmas collide
            (diffusers would silently drop a step).
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be positive, got {shift!r}")
    base = torch.linspace(1.0, 0.0, steps + 1, dtype=F32)  # on CPU, as diffusers builds it
    sigmas = torch.unique_consecutive(shift * base / (1 + (shift - 1) * base))
    if sigmas.numel() != steps + 1:
        raise ValueError(f"shift {shift} collapses {steps + 1} float32 sigmas to {sigmas.numel()}; use fewer steps")
    return sigmas


def euler_step(x: Tensor, v: Tensor, t: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """One H3 Euler step (eta 0) in float32, the same operations as `MiniMaxH3Scheduler.step`.

    x, v [rows, C] float32; t, sigma, sigma_next 0-d float32. The denoised estimate uses 1 - t (the
    timestep the model saw), the blend ratio the sigma grid; they differ in the last bit below 0.5.
    """
    for name, a in (("x", x), ("v", v), ("t", t), ("sigma", sigma), ("sigma_next", sigma_next)):
        if a.dtype != F32:
            raise ValueError(f"euler_step: {name} has dtype {a.dtype}; allowed: torch.float32")
    denoised = x + (1 - t) * v
    ratio = sigma_next / sigma
    return ratio * x + (1.0 - ratio) * denoised


def digest(latents: StepLatents) -> str:
    """sha256 over the video bytes, then the audio bytes."""
    h = hashlib.sha256()
    for t in (latents.video, latents.audio):
        h.update(bytes.fromhex(sha256_tensor(t.contiguous())))
    return h.hexdigest()


def fresh_noise(inputs: ModelInputs, seed: int) -> ModelInputs:
    """`inputs` with the generated (non-conditioning) rows replaced by N(0, 1) noise: video first, then audio."""
    gen = torch.Generator().manual_seed(seed)
    nv, na = inputs.num_condition_video_rows, inputs.num_condition_audio_rows
    rows = []
    for x, n in ((inputs.video_rows, nv), (inputs.audio_rows, na)):
        noise = torch.randn(x.shape[0] - n, x.shape[1], generator=gen, dtype=F32).to(x.device)
        rows.append(torch.cat([x[:n], noise]))
    return inputs.replace(video_rows=rows[0], audio_rows=rows[1])


def trajectory(
    weights: ModelWeights,
    inputs: ModelInputs,
    *,
    steps: int,
    backend: Backend,
    comm: BlockComm | None = None,
    rows_shard: RowsShard | None = None,
    video_shift: float = VIDEO_SHIFT,
    audio_shift: float = AUDIO_SHIFT,
) -> Trajectory:
    """`steps` Euler steps from the generated rows of `inputs` (the noise) towards clean latents.

    Args:
        weights, backend, comm, rows_shard: as `h3lab.model.transformer_forward` (one forward per step).
        inputs: the packed request; its generated video/audio rows are the starting noise, its
            timestep fields are replaced at every step by the schedule's.
        steps: model evaluations (the sigma grid has steps + 1 points).
        video_shift, audio_shift: the two schedules' flow shifts.

    Returns:
        `Trajectory` with steps + 1 latents (entry 0 = the noise) and their digests.
    """
    sv, sa = flow_sigmas(steps, video_shift), flow_sigmas(steps, audio_shift)
    tv, ta = 1.0 - sv[:-1], 1.0 - sa[:-1]  # t = 1 - sigma, as the scheduler exposes it
    nv, na = inputs.num_condition_video_rows, inputs.num_condition_audio_rows
    x_v, x_a = inputs.video_rows.to(F32).clone(), inputs.audio_rows.to(F32).clone()
    per_step = [StepLatents(x_v.clone(), x_a.clone())]
    dev = inputs.device
    for i in range(steps):
        timestep, indices = row_timesteps(inputs, float(tv[i]), float(ta[i]))
        step_in = inputs.replace(video_rows=x_v, audio_rows=x_a, timestep=timestep, timestep_indices=indices)
        out = transformer_forward(weights, step_in, backend=backend, comm=comm, rows_shard=rows_shard)
        on = lambda s, j: s[j].to(dev)  # noqa: E731
        x_v = torch.cat([x_v[:nv], euler_step(x_v[nv:], out.video[nv:], on(tv, i), on(sv, i), on(sv, i + 1))])
        x_a = torch.cat([x_a[:na], euler_step(x_a[na:], out.audio[na:], on(ta, i), on(sa, i), on(sa, i + 1))])
        per_step.append(StepLatents(x_v.clone(), x_a.clone()))
    return Trajectory(tuple(per_step), tuple(digest(s) for s in per_step), sv, sa)
