"""The rectified-flow objective: its convention against H3's sampler, what a seed draws, the loss and its
gradient against autograd through a plain PyTorch objective, invariance to row order, bad values.

Loss and gradient tolerance: the plain objective (`F.mse_loss`, autograd) sums the squared errors in
torch's own order and scales the gradient in its own sequence of float32 operations; ours sums by
trees in key order and scales by one rounded constant. Both are float32 over <= 48 x 16 elements:
the sums agree to a few roundoffs of the total (unit roundoff 6e-8), the gradient elements to 2-3
roundoffs each. Bound 1e-6 relative (> 10x those), far below any wrong factor or a missed row.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from h3lab.config import H3Config
from h3lab.model import model_inputs
from h3lab.model.head import ModelOutput
from h3lab.model.trajectory import AUDIO_SHIFT, VIDEO_SHIFT, euler_step
from h3lab.train.objective import MODALITIES, FlowObjective
from tests.conftest import assert_bitwise

TINY = H3Config.tiny()
RTOL = 1e-6


@pytest.fixture(scope="module")
def inputs():
    return model_inputs(TINY, seed=3)  # 24 keyframe rows + 48 generated video rows, 12 audio rows, 12 text


def _prediction(inputs, seed: int) -> ModelOutput:
    g = torch.Generator().manual_seed(seed)
    return ModelOutput(
        video=torch.randn(inputs.video_rows.shape, generator=g), audio=torch.randn(inputs.audio_rows.shape, generator=g)
    )


def test_the_target_is_the_velocity_h3s_sampler_steps_along(inputs):
    """x_sigma + sigma * v = data: one Euler step of the sampler from t = 1 - sigma to sigma = 0 lands on the data."""
    sample = FlowObjective().sample(inputs, seed=11)
    for m in MODALITIES:
        nc = getattr(inputs, f"num_condition_{m}_rows")
        x, v = getattr(sample.inputs, f"{m}_rows")[nc:], getattr(sample.target, m)[nc:]
        sigma = torch.tensor(sample.sigmas[m])
        x0 = euler_step(x, v, 1 - sigma, sigma, torch.tensor(0.0))
        data = getattr(inputs, f"{m}_rows")[nc:]
        # float32 values O(1): a few roundoffs of 6e-8; "noise - data" would miss by ~2 |data - noise|
        assert float((x0 - data).abs().max()) <= 1e-5, m
        walked_away = euler_step(x, -v, 1 - sigma, sigma, torch.tensor(0.0))
        assert float((walked_away - data).abs().max()) > 1.0, m


def test_a_seed_draws_shifted_sigmas_and_noises_only_the_generated_rows(inputs):
    obj = FlowObjective()
    sample = obj.sample(inputs, seed=11)
    u = torch.rand(2, generator=torch.Generator().manual_seed(11), dtype=torch.float32)  # video, then audio
    for i, (m, s) in enumerate(zip(MODALITIES, (VIDEO_SHIFT, AUDIO_SHIFT), strict=True)):
        assert sample.sigmas[m] == float(s * u[i] / (1 + (s - 1) * u[i]))  # flow_sigmas' map of a uniform draw
    nv = inputs.num_condition_video_rows
    assert nv == 24 and inputs.num_condition_audio_rows == 0
    assert_bitwise(sample.inputs.video_rows[:nv], inputs.video_rows[:nv], "keyframe rows")
    assert_bitwise(sample.inputs.text_rows, inputs.text_rows, "text rows")
    assert not torch.equal(sample.inputs.video_rows[nv:], inputs.video_rows[nv:])
    assert not bool(sample.target.video[:nv].any())  # conditioning rows have no target
    t = {m: 1 - torch.tensor(sample.sigmas[m]) for m in MODALITIES}
    tags, idx = sample.inputs.token_tags, sample.inputs.timestep_indices
    row_t = sample.inputs.timestep[idx]
    assert bool((row_t[inputs.video_indices[nv:]] == t["video"]).all()) and bool((row_t[tags == 1] == t["video"]).all())
    assert bool((row_t[inputs.audio_indices] == t["audio"]).all())
    assert bool((row_t[inputs.video_indices[:nv]] == max(float(t["video"]), 0.999)).all())  # keyframes
    again, other = obj.sample(inputs, seed=11), obj.sample(inputs, seed=12)
    assert_bitwise(again.inputs.video_rows, sample.inputs.video_rows, "same seed")
    assert not torch.equal(other.inputs.audio_rows, sample.inputs.audio_rows)


def test_loss_and_gradient_match_autograd_through_a_plain_objective(inputs):
    obj = FlowObjective(weights={"video": 2.0, "audio": 0.25})
    sample = obj.sample(inputs, seed=5)
    pred = _prediction(inputs, 6)
    ours = obj.loss(sample, pred)
    pv, pa = pred.video.clone().requires_grad_(), pred.audio.clone().requires_grad_()
    nv = inputs.num_condition_video_rows
    per = {"video": F.mse_loss(pv[nv:], sample.target.video[nv:]), "audio": F.mse_loss(pa, sample.target.audio)}
    ref = 2.0 * per["video"] + 0.25 * per["audio"]
    ref.backward()
    ref, per = ref.detach(), {m: v.detach() for m, v in per.items()}
    assert ours.total.dtype == torch.float32 and ours.total.shape == ()
    assert abs(float(ours.total) - float(ref)) <= RTOL * float(ref)
    for m in MODALITIES:
        assert abs(float(ours.per_modality[m]) - float(per[m])) <= RTOL * float(per[m]), m
    for m, g in (("video", pv.grad), ("audio", pa.grad)):
        got = getattr(ours.grad, m)
        assert got.dtype == torch.float32 and got.shape == g.shape
        assert float((got - g).abs().max()) <= RTOL * float(g.abs().max()), m
    assert_bitwise(ours.grad.video[:nv], torch.zeros_like(ours.grad.video[:nv]), "conditioning rows: +0")


def test_the_loss_follows_the_keys_not_the_row_order(inputs):
    """Generated rows permuted (with their keys): every row keeps its noise, the loss keeps its bits."""
    obj = FlowObjective()
    nv, n = inputs.num_condition_video_rows, inputs.video_rows.shape[0]
    q = torch.cat([torch.arange(nv), nv + torch.randperm(n - nv, generator=torch.Generator().manual_seed(1))])
    shuffled = inputs.replace(video_rows=inputs.video_rows[q], video_indices=inputs.video_indices[q])
    a, b = obj.sample(inputs, seed=2), obj.sample(shuffled, seed=2)
    assert_bitwise(b.inputs.video_rows, a.inputs.video_rows[q], "noised rows")
    pred = _prediction(inputs, 3)
    la = obj.loss(a, pred)
    lb = obj.loss(b, ModelOutput(video=pred.video[q], audio=pred.audio))
    assert_bitwise(lb.total, la.total, "loss")
    assert_bitwise(lb.grad.video, la.grad.video[q], "gradient")


def test_a_modality_without_generated_rows_scores_zero(inputs):
    only_references = inputs.replace(num_condition_audio_rows=inputs.audio_rows.shape[0])
    obj = FlowObjective()
    sample = obj.sample(only_references, seed=4)
    assert_bitwise(sample.inputs.audio_rows, inputs.audio_rows, "reference audio")
    loss = obj.loss(sample, _prediction(inputs, 5))
    assert float(loss.per_modality["audio"]) == 0.0 and not bool(loss.grad.audio.any())
    assert_bitwise(loss.total, loss.per_modality["video"], "loss = video's")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights": {"text": 1.0}}, r"weights: unknown modality 'text'; allowed: \['video', 'audio'\]"),
        ({"weights": {"audio": -0.5}}, r"weights\['audio'\]=-0.5; allowed: a finite number >= 0"),
        ({"weights": {"video": math.nan}}, r"weights\['video'\]=nan; allowed: a finite number >= 0"),
        ({"weights": {"video": True}}, r"weights\['video'\]=True; allowed"),
        ({"weights": [1.0, 1.0]}, r"weights=\[1.0, 1.0\]; allowed: a mapping"),
        ({"video_shift": 0.0}, r"video_shift=0.0; allowed: a finite number > 0"),
        ({"audio_shift": math.inf}, r"audio_shift=inf; allowed: a finite number > 0"),
    ],
)
def test_bad_objective_parameters_fail_naming_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FlowObjective(**kwargs)


def test_bad_seeds_and_predictions_fail(inputs):
    obj = FlowObjective()
    assert obj.weights == {"video": 1.0, "audio": 1.0}  # missing modalities weigh 1
    with pytest.raises(ValueError, match=r"seed=2\.5; allowed: an int"):
        obj.sample(inputs, seed=2.5)
    sample = obj.sample(inputs, seed=1)
    pred = _prediction(inputs, 2)
    with pytest.raises(ValueError, match=r"output.audio: torch.bfloat16 \[12, 8\]; allowed: torch.float32 \[12, 8\]"):
        obj.loss(sample, ModelOutput(video=pred.video, audio=pred.audio.bfloat16()))
