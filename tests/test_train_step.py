"""One rank's training loop (`h3lab.train.step.Trainer`): each step is `model_grads` on the weights the
previous update left, from the step's own seed, then `AdamW.step`; the names it reports; bad values.
Layouts, row order and padding: tests/test_train_run.py."""

from __future__ import annotations

import pytest
import torch

from h3lab.config import H3Config, model_param_shapes
from h3lab.model import InMemoryWeights, SyntheticWeights, model_inputs
from h3lab.train.adamw import AdamW, AdamWHyper
from h3lab.train.grads import model_grads
from h3lab.train.objective import FlowObjective
from h3lab.train.pieces import block_weight_pieces, non_block_pieces
from h3lab.train.step import PHASES, Trainer, derived_seed, step_seed
from h3lab.units import unit_weights
from tests.conftest import assert_bitwise

# tiny's structure at a fraction of its width (tests/test_train_adamw.py): a step takes a second, not ten
CONFIG = H3Config.tiny().replace(
    attention_head_dim=16,
    rope_freq_dim=2,
    hidden_size=36,
    ffn_dim=72,
    text_dim=24,
    freq_dim=16,
    time_embed_hidden_dim=40,
    time_embed_dim=20,
    num_layers=3,
    num_refiner_layers=1,
)
BLOCKS = (1, 2)
HYPER = AdamWHyper(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
SEED = 31


def _trainer() -> Trainer:
    return Trainer(
        SyntheticWeights(CONFIG, seed=8), model_inputs(CONFIG, seed=9), blocks=BLOCKS, hyper=HYPER, seed=SEED
    )


def test_each_step_is_model_grads_on_the_updated_weights_then_adamw():
    trainer = _trainer()
    weights = InMemoryWeights.copy_of(SyntheticWeights(CONFIG, seed=8), BLOCKS)  # the same steps, by hand
    opt = AdamW(_pieces(weights), config=CONFIG, comm=trainer.comm, hyper=HYPER)
    inputs, objective = model_inputs(CONFIG, seed=9), FlowObjective()
    before = trainer.weights.block(2)["attn.to_q.weight"].clone()
    for k in (1, 2):
        step = trainer.step(k)
        if k == 1:  # the optimizer wrote into the trainer's weights, which step 2 reads (and so does `ref`)
            after, rows = trainer.weights.block(2)["attn.to_q.weight"], before.shape[0] // 8
            assert not torch.equal(before, after)  # lr 1e-3 moves bf16 weights of size ~0.1 by more than a ULP
            assert_bitwise(step.tensors()["step1.block2.w.attn.to_q.weight@u3"], after[3 * rows : 4 * rows], "u3")
        ref = model_grads(weights, inputs, objective, seed=step_seed(SEED, k), blocks=BLOCKS)
        record = opt.step(ref.pieces())
        assert_bitwise(step.loss, ref.loss, f"step {k} loss")
        assert_bitwise(step.grad_norm, record.grad_norm, f"step {k} norm")
        assert_bitwise(step.clip_coef, record.clip_coef, f"step {k} clip")
        got, want = step.tensors(), ref.tensors(f"step{k}.") | _named(opt, k)
        assert got.keys() == want.keys() | {f"step{k}.grad_norm", f"step{k}.clip_coef"}
        for name, t in want.items():
            assert_bitwise(got[name], t, name)
        assert set(step.timings) == set(PHASES) and all(v >= 0 for v in step.timings.values())
    assert float(step.clip_coef) < 1  # the norm was clipped: the clip's path ran


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
        Trainer(SyntheticWeights(CONFIG, seed=8), model_inputs(CONFIG, seed=9), blocks=(2, 1), hyper=HYPER, seed=1)
    assert trainer.steps_taken == 0
