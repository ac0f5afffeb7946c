"""The H3 denoising trajectory: diffusers' sampler bit for bit, and a 2-step trajectory that repeats to the byte."""

from __future__ import annotations

import re

import pytest
import torch
from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

from h3lab.backend import get_backend
from h3lab.config import H3Config
from h3lab.metrics import error_stats
from h3lab.model import SyntheticWeights, model_inputs, row_timesteps, transformer_forward
from h3lab.model.trajectory import (
    AUDIO_SHIFT,
    VIDEO_SHIFT,
    digest,
    euler_step,
    flow_sigmas,
    fresh_noise,
    trajectory,
)
from tests.conftest import assert_bitwise

TINY = H3Config.tiny().replace(num_layers=2)
STEPS = 2
BE = get_backend("torch")


@pytest.mark.parametrize(("steps", "shift"), [(2, VIDEO_SHIFT), (2, AUDIO_SHIFT), (8, VIDEO_SHIFT), (30, AUDIO_SHIFT)])
def test_sigmas_and_euler_steps_are_the_diffusers_scheduler_bytes(steps, shift):
    sched = MiniMaxH3Scheduler(shift=shift)
    sched.set_timesteps(steps + 1)  # diffusers counts grid points, terminal 0 included
    sigmas = flow_sigmas(steps, shift)
    assert_bitwise(sigmas, sched.sigmas, "sigmas")
    g = torch.Generator().manual_seed(steps)
    x, v = torch.randn(40, 16, generator=g), torch.randn(40, 16, generator=g)
    for i, t in enumerate(sched.timesteps):  # t = 1 - sigma, from 0 (noise) up
        ref = sched.step(v, t, x, return_dict=False)[0]
        assert_bitwise(euler_step(x, v, t, sigmas[i], sigmas[i + 1]), ref, f"step {i}")
        x = ref


def test_the_velocity_points_at_the_data():
    """x_t = t*x0 + (1-t)*noise has velocity x0 - noise; Euler along it lands on x0 from pure noise."""
    g = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
    sigmas = flow_sigmas(5, VIDEO_SHIFT)
    x = noise.clone()
    for i in range(5):
        x = euler_step(x, x0 - noise, 1 - sigmas[i], sigmas[i], sigmas[i + 1])
    # float32 along 5 steps of O(1) values: a few units of 6e-8; 1e-5 catches a wrong sign (error ~1)
    assert error_stats(x, x0.double())["max_rel"] <= 1e-5


def test_bad_schedules_fail():
    with pytest.raises(ValueError, match="steps must be a positive int"):
        flow_sigmas(0, VIDEO_SHIFT)
    with pytest.raises(ValueError, match="shift must be positive"):
        flow_sigmas(2, 0.0)
    with pytest.raises(ValueError, match="collapses"):
        flow_sigmas(4000, 1e7)  # sigmas near 1 collide in float32
    with pytest.raises(ValueError, match=r"euler_step: x has dtype torch\.bfloat16"):
        euler_step(torch.ones(2, 2).bfloat16(), torch.ones(2, 2), *torch.tensor([0.0, 1.0, 0.5]))


@pytest.fixture(scope="module")
def run():
    weights, inputs = SyntheticWeights(TINY, seed=3), model_inputs(TINY, seed=4)
    return weights, inputs, trajectory(weights, inputs, steps=STEPS, backend=BE)


def test_two_runs_give_identical_latents_and_digests(run):
    _, inputs, ref = run
    again = trajectory(SyntheticWeights(TINY, seed=3), inputs, steps=STEPS, backend=BE)
    assert again.digests == ref.digests
    for a, b in zip(again.latents_per_step, ref.latents_per_step, strict=True):
        assert_bitwise(a.video, b.video, "video")
        assert_bitwise(a.audio, b.audio, "audio")


def test_the_first_step_is_one_forward_and_one_euler_step(run):
    weights, inputs, ref = run
    nv = inputs.num_condition_video_rows
    t_v, t_a = 1 - ref.sigmas_video[0], 1 - ref.sigmas_audio[0]
    assert float(t_v) == float(t_a) == 0.0  # the first step starts from pure noise
    timestep, indices = row_timesteps(inputs, 0.0, 0.0)
    assert timestep.tolist() == [0.0, pytest.approx(0.999)]  # generated rows and text at 0, the keyframe at 0.999
    out = transformer_forward(weights, inputs.replace(timestep=timestep, timestep_indices=indices), backend=BE)
    video = euler_step(inputs.video_rows[nv:], out.video[nv:], t_v, ref.sigmas_video[0], ref.sigmas_video[1])
    audio = euler_step(inputs.audio_rows, out.audio, t_a, ref.sigmas_audio[0], ref.sigmas_audio[1])
    assert_bitwise(ref.latents_per_step[1].video[nv:], video, "video step 1")
    assert_bitwise(ref.latents_per_step[1].audio, audio, "audio step 1")


def test_another_noise_seed_changes_every_step_but_not_the_conditioning(run):
    weights, inputs, ref = run
    other = trajectory(weights, fresh_noise(inputs, seed=1), steps=STEPS, backend=BE)
    assert all(a != b for a, b in zip(other.digests, ref.digests, strict=True))
    nv = inputs.num_condition_video_rows
    assert nv == 24
    for step in (*other.latents_per_step, *ref.latents_per_step):  # the keyframe rows are never written
        assert_bitwise(step.video[:nv], inputs.video_rows[:nv], "keyframe rows")


def test_the_digest_list_has_a_stable_form(run):
    _, inputs, ref = run
    assert len(ref.latents_per_step) == len(ref.digests) == STEPS + 1
    assert all(re.fullmatch(r"[0-9a-f]{64}", d) for d in ref.digests)
    assert len(set(ref.digests)) == STEPS + 1
    assert [digest(s) for s in ref.latents_per_step] == list(ref.digests)
    first = ref.latents_per_step[0]
    assert_bitwise(first.video, inputs.video_rows, "start video")  # entry 0 is the starting noise
    assert_bitwise(first.audio, inputs.audio_rows, "start audio")
    for s in ref.latents_per_step:
        assert s.video.dtype == s.audio.dtype == torch.float32
        assert s.video.shape == inputs.video_rows.shape and s.audio.shape == inputs.audio_rows.shape
    assert float(ref.sigmas_video[-1]) == float(ref.sigmas_audio[-1]) == 0.0
