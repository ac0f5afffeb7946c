"""One rank's training loop (`h3lab.train.step.Trainer`): each step is `model_grads` on the weights the
previous update left, from the step's own seed, then `AdamW.step`; the names it reports; bad values.
Row order and padding in one process here; layouts: tests/test_train_run.py."""

from __future__ import annotations

import pytest
import torch

from h3lab.backend import get_backend
from h3lab.comm import LocalComm
from h3lab.config import model_param_shapes
from h3lab.model import InMemoryWeights, ModelInputs, SyntheticWeights, model_inputs, shuffle_rows
from h3lab.parallel.layout import Layout
from h3lab.parallel.seqshard import SeqShard
from h3lab.train.adamw import AdamW, AdamWHyper
from h3lab.train.grads import model_grads
from h3lab.train.objective import FlowObjective
from h3lab.train.pieces import block_weight_pieces, non_block_pieces
from h3lab.train.step import PHASES, Trainer, TrainStep, derived_seed, step_seed
from h3lab.units import unit_weights
from tests.conftest import assert_bitwise
from tests.train_ranks import NARROW

CONFIG = NARROW.replace(num_layers=3)
BLOCKS = (1, 2)
HYPER = AdamWHyper(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
SEED = 31
BE = get_backend("torch")


def _trainer(inputs: ModelInputs | None = None, rows_shard=None, recompute: bool = True) -> Trainer:
    inputs = model_inputs(CONFIG, seed=9) if inputs is None else inputs
    weights = SyntheticWeights(CONFIG, seed=8)
    return Trainer(
        weights, inputs, blocks=BLOCKS, hyper=HYPER, seed=SEED, rows_shard=rows_shard, backend=BE, recompute=recompute
    )


@pytest.fixture(scope="module")
def reference() -> tuple[list[TrainStep], list[dict[str, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """Two steps of the packed request: the steps, copies of their tensors, block 2's to_q before and after step 1."""
    trainer = _trainer()
    before = trainer.weights.block(2)["attn.to_q.weight"].clone()
    steps, tensors = [], []
    for k in (1, 2):
        steps.append(trainer.step(k))
        tensors.append({n: t.clone() for n, t in steps[-1].tensors().items()})
        if k == 1:
            after = trainer.weights.block(2)["attn.to_q.weight"].clone()
    return steps, tensors, before, after


def test_each_step_is_model_grads_on_the_updated_weights_then_adamw(reference):
    steps, tensors, before, after = reference
    weights = InMemoryWeights.copy_of(SyntheticWeights(CONFIG, seed=8), BLOCKS)  # the same steps, by hand
    opt = AdamW(_pieces(weights), config=CONFIG, comm=LocalComm(), hyper=HYPER, backend=BE)
    inputs, objective = model_inputs(CONFIG, seed=9), FlowObjective()
    for k, (step, got) in enumerate(zip(steps, tensors, strict=True), start=1):
        ref = model_grads(weights, inputs, objective, seed=step_seed(SEED, k), blocks=BLOCKS, backend=BE)
        record = opt.step(ref.pieces())
        assert_bitwise(got[f"step{k}.loss"], ref.loss, f"step {k} loss")
        assert_bitwise(got[f"step{k}.grad_norm"], record.grad_norm, f"step {k} norm")
        assert_bitwise(got[f"step{k}.clip_coef"], record.clip_coef, f"step {k} clip")
        want = ref.tensors(f"step{k}.") | _named(opt, k)
        assert got.keys() == want.keys() | {f"step{k}.grad_norm", f"step{k}.clip_coef"}
        for name, t in want.items():
            assert_bitwise(got[name], t, name)
        assert step.step == k and set(step.timings) == set(PHASES) and all(v >= 0 for v in step.timings.values())
    assert float(steps[0].clip_coef) < 1  # the norm was clipped: the clip's path ran
    # the optimizer wrote into the trainer's own weights, which step 2 read: lr 1e-3 moves bf16 weights of
    # size ~0.1 by more than a ULP, and a unit's updated weight is its view of the held tensor
    rows = after.shape[0] // 8
    assert not torch.equal(before, after)
    assert_bitwise(tensors[0]["step1.block2.w.attn.to_q.weight@u3"], after[3 * rows : 4 * rows], "unit 3")


def test_rows_out_of_key_order_and_padding_change_no_bit_of_any_step(reference):
    _, tensors, _, _ = reference
    shuffled = shuffle_rows(model_inputs(CONFIG, seed=9), seed=10)
    keys = shuffled.logical_keys[:, 1]
    assert not bool((keys[1:] > keys[:-1]).all())  # the packed rows are out of key order
    pad = SeqShard(Layout(cp=5), shuffled.num_rows)  # pads 96 rows to 100: keys (-1, j), zero contents
    assert pad.padded_rows == 100
    trainer = _trainer(shuffled, rows_shard=pad.pad)
    for k, want in enumerate(tensors, start=1):
        got = trainer.step(k).tensors()
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert_bitwise(got[name], t, name)


def test_steps_that_keep_the_blocks_forwards_give_the_recomputing_steps_bytes(reference):
    _, tensors, _, _ = reference
    trainer = _trainer(recompute=False)
    for k, want in enumerate(tensors, start=1):
        got = trainer.step(k).tensors()
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert_bitwise(got[name], t, name)


def _pieces(weights: InMemoryWeights) -> dict:
    """The optimizer's pieces (all 8 units) as views of `weights`."""
    out = non_block_pieces({n: weights.tensor(n) for n in model_param_shapes(CONFIG, 0)})
    for i in BLOCKS:
        out |= block_weight_pieces(i, unit_weights(weights.block(i)))
    return out


def _named(opt: AdamW, k: int) -> dict[str, torch.Tensor]:
    return {f"step{k}.{name}": t for name, t in opt.named_weights("w").items()}


def test_seeds_are_documented_and_distinct():
    assert step_seed(SEED, 1) == derived_seed(SEED, "step1")
    seeds = {derived_seed(s, w) for s in (0, 1, 2**64 - 1) for w in ("step1", "step2", "rows")}
    assert len(seeds) == 9 and all(0 <= s < 2**64 for s in seeds)
    with pytest.raises(ValueError, match=r"seed=-1; allowed: an int in \[0, 2\*\*64 - 1\]"):
        step_seed(-1, 1)


def test_steps_run_in_order_from_one():
    trainer = _trainer()
    with pytest.raises(ValueError, match=r"step 2; allowed: 1, the next step"):
        trainer.step(2)
    with pytest.raises(ValueError, match=r"blocks \[2, 1\]; allowed: a non-empty contiguous ascending range"):
        Trainer(
            SyntheticWeights(CONFIG, seed=8),
            model_inputs(CONFIG, seed=9),
            blocks=(2, 1),
            hyper=HYPER,
            seed=1,
            backend=BE,
        )
    assert trainer.steps_taken == 0


def test_an_error_inside_a_later_step_names_the_step_and_the_weights_that_grew():
    """--lr 1e30 --max-grad-norm inf: step 1's update leaves every weight near 1e30, all finite, and step 2's
    time embedding overflows. Its error said "temb: 288 values hold NaN or Inf": no step, no weight."""
    weights = SyntheticWeights(CONFIG, seed=8)
    hyper = AdamWHyper(lr=1e30, max_grad_norm=float("inf"))
    trainer = Trainer(weights, model_inputs(CONFIG, seed=9), blocks=BLOCKS, hyper=hyper, seed=SEED, backend=BE)
    trainer.step(1)
    with pytest.raises(ValueError) as err:
        trainer.step(2)
    message = str(err.value)
    assert message.startswith("step 2: temb: ") and "hold NaN or Inf" in message, message
    assert "; after step 1's update (lr 1e+30) the weights hold |w| up to 1." in message and "e+30 in " in message
    assert trainer.steps_taken == 1
