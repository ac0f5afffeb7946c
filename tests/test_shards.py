"""A rank's shards of a block's unit-sharded weights (h3lab.units.unit_shards): views of its units as
`unit_weights` gives them from the whole block, and the whole tensor again from every TP rank's shard."""

from __future__ import annotations

import pytest
import torch

from h3lab.units import UNIT_SHARDED, join_shards, shard_unit_weights, unit_shards, unit_weights
from h3lab.weights import synthetic_block
from tests.conftest import MODEL_CONFIGS, assert_bitwise


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_every_tp_ranks_shards_view_its_units_and_join_back_whole(tp):
    config = MODEL_CONFIGS["h16x24"]
    block = synthetic_block(config, 0, seed=4)
    per = 8 // tp
    parts: dict[str, list[torch.Tensor]] = {p: [] for p in UNIT_SHARDED}
    for r in range(tp):
        units = range(r * per, (r + 1) * per)
        shards = unit_shards(block, units)
        got, want = shard_unit_weights(config, dict(block.items()) | shards, units), unit_weights(block, units)
        for field in ("q", "k", "v", "out", "hidden", "gate", "down", "adaln_w", "adaln_b"):
            assert all(torch.equal(getattr(got, field)[u], getattr(want, field)[u]) for u in units), field
        for p in UNIT_SHARDED:
            parts[p].append(shards[p])
    for p in UNIT_SHARDED:
        assert_bitwise(join_shards(p, parts[p]), block[p], p)


def test_sharded_weights_hand_out_a_ranks_units_and_refuse_other_shapes():
    from h3lab.config import model_param_shapes
    from h3lab.model.weights import ShardedWeights, SyntheticWeights, block_units

    config = MODEL_CONFIGS["tiny"]
    full = SyntheticWeights(config, seed=2)
    units = range(2, 4)  # tp4, rank 1
    tensors = {k: full.tensor(k) for k in model_param_shapes(config, 0)}
    for i in range(config.num_layers):
        block = full.block(i)
        tensors |= {
            f"transformer_blocks.{i}.{k}": v for k, v in (dict(block.items()) | unit_shards(block, units)).items()
        }
    sharded = ShardedWeights(config, tensors, units)
    got, want = block_units(sharded, 1, units, torch.device("cpu")), unit_weights(full.block(1), units)
    assert all(torch.equal(got.down[u], want.down[u]) and torch.equal(got.gate[u], want.gate[u]) for u in units)
    assert sharded.tensor("proj_in.weight") is tensors["proj_in.weight"]
    with pytest.raises(ValueError, match=r"block 1: these weights hold units \[2, 3\] of each block"):
        sharded.block(1)
    with pytest.raises(ValueError, match=r"units \[0, 1\] of block 1; allowed: the units held, \[2, 3\]"):
        sharded.unit_block(1, range(2))
    bad = tensors | {"transformer_blocks.0.ff.net.2.weight": full.block(0)["ff.net.2.weight"]}
    with pytest.raises(
        ValueError, match=r"transformer_blocks.0.ff.net.2.weight: shape \[192, 512\]; allowed: \[192, 128\]"
    ):
        ShardedWeights(config, bad, units)
