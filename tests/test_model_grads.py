"""The whole model's backward and one training step's gradients (`model_grads`): parity with diffusers'
autograd in float32, byte-for-byte invariance to row order and padding, the names a rank reports, bad values.

Parity metric: max_rel = max|ours - diffusers| / max|diffusers| per gradient (one misplaced row shows
at full size). Measured over tiny and h16x24 (tests/test_transformer.py's configs) x seeds 0, 1, all
62 / 74 parameters: max_rel <= 1.5e-6, the loss's relative error <= 1.4e-7. Both sides are float32
(unit roundoff 6e-8) in different summation orders: BLAS and SDPA against k-ascending and key-ordered
chains over <= 96 rows and <= 512 columns, trees over the canonical units; a few dozen roundoffs of
growth. Bounds: 1e-5 for the gradients (>= 6x headroom), 1e-6 for the loss (7x); one bf16 rounding
anywhere (unit roundoff 4e-3) or a wrong formula misses them by orders of magnitude.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from h3lab.backend import get_backend
from h3lab.comm import LocalComm
from h3lab.config import H3Config, model_param_shapes, param_dtype
from h3lab.model import InMemoryWeights, SyntheticWeights, model_inputs, shuffle_rows, transformer_forward
from h3lab.model.backward import check_blocks, model_backward, model_forward
from h3lab.model.head import ModelOutput
from h3lab.parallel.layout import Layout
from h3lab.parallel.seqshard import SeqShard
from h3lab.reference.parity import model_velocity
from h3lab.run.trace import TraceRecorder
from h3lab.train.grads import model_grads
from h3lab.train.objective import FlowObjective
from tests.conftest import MODEL_CONFIGS as CONFIGS
from tests.conftest import assert_bitwise, model_in_dtype, random_diffusers_model

GRAD_RTOL, LOSS_RTOL = 1e-5, 1e-6
TINY3 = H3Config.tiny().replace(num_layers=3)
BLOCKS = (1, 2)  # a range that does not start at block 0, two blocks: d temb sums three shares
OBJECTIVE = FlowObjective(weights={"audio": 0.5})
BE = get_backend("torch")


def _diffusers_grads(model, sample, objective: FlowObjective) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same objective written plainly (mean squared error of the generated rows per modality, weighted),
    through diffusers' forward and autograd."""
    i = sample.inputs
    video, audio = model_velocity(model, i)
    nv, na = i.num_condition_video_rows, i.num_condition_audio_rows
    w = objective.weights
    loss = w["video"] * F.mse_loss(video[nv:], sample.target.video[nv:])
    loss = loss + w["audio"] * F.mse_loss(audio[na:], sample.target.audio[na:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(("name", "seed"), [("tiny", 0), ("h16x24", 1)])
def test_every_gradient_matches_diffusers_autograd_in_float32(name, seed):
    config = CONFIGS[name]
    model = model_in_dtype(random_diffusers_model(config, seed), torch.float32)
    weights = InMemoryWeights(config, {k: p.detach().clone() for k, p in model.named_parameters()})
    inputs = model_inputs(config, seed=1000 + seed)
    ours = model_grads(weights, inputs, OBJECTIVE, seed=seed, blocks=range(config.num_layers), backend=BE)
    ref_loss, ref = _diffusers_grads(model, OBJECTIVE.sample(inputs, seed), OBJECTIVE)
    assert abs(float(ours.loss) - float(ref_loss)) <= LOSS_RTOL * float(ref_loss)
    got = ours.assembled()
    assert set(got) == set(ref) == set(model_param_shapes(config))  # every parameter of the trained depth
    for k, g in got.items():
        assert g.dtype == torch.float32 and g.shape == ref[k].shape, k
        err = float((g.double() - ref[k].double()).abs().max() / ref[k].double().abs().max())
        assert err <= GRAD_RTOL, f"{name} seed {seed} {k}: max_rel {err:.3g}"


# ---- determinism and invariances: synthetic mixed-precision weights, blocks 1-2 of 3, 96 packed rows ------
@pytest.fixture(scope="module")
def reference():
    weights, inputs = SyntheticWeights(TINY3, seed=5), model_inputs(TINY3, seed=6)
    recorder = TraceRecorder()
    grads = model_grads(weights, inputs, OBJECTIVE, seed=7, blocks=BLOCKS, trace=recorder, backend=BE)
    return weights, inputs, grads, recorder


def _assert_same_grads(a, b) -> None:
    assert_bitwise(a.loss, b.loss, "loss")
    for m in ("video", "audio"):
        assert_bitwise(a.loss_per_modality[m], b.loss_per_modality[m], f"loss.{m}")
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for k in ta:
        assert_bitwise(ta[k], tb[k], k)


def test_rows_out_of_key_order_change_no_bit_of_the_loss_or_any_gradient(reference):
    weights, inputs, ref, _ = reference
    _assert_same_grads(model_grads(weights, shuffle_rows(inputs, 8), OBJECTIVE, seed=7, blocks=BLOCKS, backend=BE), ref)


def test_padding_rows_change_no_bit_of_the_loss_or_any_gradient(reference):
    weights, inputs, ref, _ = reference
    shard = SeqShard(Layout(cp=5), inputs.num_rows)  # pads 96 rows to 100: keys (-1, j), zero contents
    assert shard.padded_rows == 100
    padded = model_grads(
        weights, inputs, OBJECTIVE, seed=7, blocks=BLOCKS, comm=LocalComm(), rows_shard=shard.pad, backend=BE
    )
    _assert_same_grads(padded, ref)


def test_gradients_keep_the_mixed_precision_and_carry_the_tasks_names(reference):
    _, _, ref, recorder = reference
    full = ref.assembled()
    trained = [k for k in model_param_shapes(TINY3) if not k.startswith("transformer_blocks.0.")]
    assert sorted(full) == sorted(trained)
    for k, g in full.items():  # float32 modules' gradients float32, the bf16 modules' bf16
        assert g.dtype == param_dtype(k) and tuple(g.shape) == model_param_shapes(TINY3)[k], k
    names = ref.tensors("step3.")
    assert {"step3.loss", "step3.loss.video", "step3.dw.proj_in.weight", "step3.block1.dw.norm1.weight"} <= names.keys()
    assert "step3.block2.dw.ff.hidden@u7" in names and "step3.dw.token_refiner.final_norm.weight" in names
    assert_bitwise(names["step3.block2.dw.attn.to_q.weight@u0"], full["transformer_blocks.2.attn.to_q.weight"][:32])
    seen = dict(recorder.order)
    for name in (
        "embed.temb",
        "block1.norm1",
        "head.video",
        "loss",
        "loss.d.audio",
        "d.stack.out",
        "block2.d.ff.net.2",
    ):
        assert name in seen, name
    assert seen["block1.dx"] == "local" and seen["d.stack.in"] == seen["d.temb"] == "replicated"
    order = [n for n, _ in recorder.order]  # forward, loss, then backward: the head's, blocks in reverse, embed's
    assert order.index("head.audio") < order.index("loss") < order.index("block2.dx") < order.index("block1.dx")
    assert order.index("block1.dx") < order.index("d.stack.in") < order.index("d.temb")


def test_the_training_forward_is_the_model_forward(reference):
    weights, inputs, _, _ = reference
    sample = OBJECTIVE.sample(inputs, 7)
    fwd = model_forward(weights, sample.inputs, blocks=BLOCKS, backend=BE)
    ref = transformer_forward(_Only(weights, BLOCKS), sample.inputs, backend=BE)
    assert_bitwise(fwd.output.video, ref.video, "video"), assert_bitwise(fwd.output.audio, ref.audio, "audio")


@dataclasses.dataclass
class _Only:
    """`weights` as a model of only the blocks `blocks` (what transformer_forward runs: all of a model's blocks)."""

    weights: SyntheticWeights
    blocks: tuple[int, ...]

    @property
    def config(self) -> H3Config:
        return self.weights.config.replace(num_layers=len(self.blocks))

    def block(self, index: int):
        return self.weights.block(self.blocks[index])

    def tensor(self, name: str) -> torch.Tensor:
        return self.weights.tensor(name)


def test_in_memory_weights_hand_out_the_tensors_an_optimizer_updates():
    weights = InMemoryWeights.copy_of(SyntheticWeights(TINY3, seed=5), [2])
    assert weights.blocks == (2,)
    weights.tensors["transformer_blocks.2.norm1.weight"].mul_(2)  # an optimizer's in-place write
    weights.tensors["proj_in.bias"].add_(1)
    ref = SyntheticWeights(TINY3, seed=5)
    assert_bitwise(weights.block(2)["norm1.weight"], ref.block(2)["norm1.weight"] * 2)
    assert_bitwise(weights.tensor("proj_in.bias"), ref.tensor("proj_in.bias") + 1)
    with pytest.raises(ValueError, match=r"block 0 is not held; allowed: \[2\]"):
        weights.block(0)
    with pytest.raises(ValueError, match="is not a non-block parameter"):
        weights.tensor("transformer_blocks.2.norm1.weight")


# ---- fail closed ----------------------------------------------------------------------------------
@pytest.mark.parametrize("blocks", [[], [0, 2], [2, 1], [1, 3], [-1, 0], [True]])
def test_a_bad_block_range_fails_naming_the_allowed_range(blocks):
    with pytest.raises(ValueError, match=r"allowed: a non-empty contiguous ascending range A..B within 0..2"):
        check_blocks(blocks, 3)


def test_bad_values_fail_before_any_work():
    weights, inputs = SyntheticWeights(TINY3, seed=5), model_inputs(TINY3, seed=6)
    with pytest.raises(ValueError, match=r"blocks \[3\]; allowed: .* within 0..2"):
        model_grads(weights, inputs, OBJECTIVE, seed=0, blocks=[3], backend=BE)  # past the model
    with pytest.raises(ValueError, match=r"seed=-1; allowed: an int in \[0, 2\*\*64 - 1\]"):
        model_grads(weights, inputs, OBJECTIVE, seed=-1, blocks=[0], backend=BE)
    tensors = {k: weights.tensor(k) for k in model_param_shapes(TINY3, 0)}
    with pytest.raises(ValueError, match=r"missing \['proj_in.bias'\]"):
        InMemoryWeights(TINY3, {k: v for k, v in tensors.items() if k != "proj_in.bias"})
    with pytest.raises(ValueError, match=r"not parameters of this config: \['proj_in.scale'\]"):
        InMemoryWeights(TINY3, tensors | {"proj_in.scale": tensors["proj_in.bias"]})
    with pytest.raises(ValueError, match=r"missing \['transformer_blocks.0.adaln_proj.linear.bias'"):
        InMemoryWeights(TINY3, tensors | {"transformer_blocks.0.norm1.weight": weights.block(0)["norm1.weight"]})
    with pytest.raises(ValueError, match=r"proj_in.bias: torch.float64 \[192\]; allowed: bfloat16 or float32 \[192\]"):
        InMemoryWeights(TINY3, tensors | {"proj_in.bias": tensors["proj_in.bias"].double()})
    with pytest.raises(ValueError, match=r"proj_in.bias: holds inf or NaN; allowed: finite weights"):
        InMemoryWeights(TINY3, tensors | {"proj_in.bias": tensors["proj_in.bias"] / 0})


def test_a_gradient_of_the_wrong_shape_fails_naming_the_head():
    weights, inputs = SyntheticWeights(TINY3, seed=5), model_inputs(TINY3, seed=6, num_frames=1)
    fwd = model_forward(weights, inputs, blocks=[0], backend=BE)
    bad = ModelOutput(video=fwd.output.video[1:], audio=fwd.output.audio)
    with pytest.raises(ValueError, match=r"d_out.video: torch.float32 \[47, 16\]; allowed: torch.float32 \[48, 16\]"):
        model_backward(fwd, bad)
