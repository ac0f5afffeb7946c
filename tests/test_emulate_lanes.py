"""h3lab.emulate.lanes: the attention kernels' row sums in the order the H200 showed.

The trees and the delta kernel's outputs come from an H200 probe (h3lab.bench.tree_probe), kept in
tests/data/emulate_sm90_vectors.json (h3lab.bench.emulate_vectors derives it); the delta rows'
inputs are redrawn from the probe's seeds (h3lab.bench.probe_rng: the same bits on any device).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from h3lab.bench.mma_cases import values
from h3lab.bench.probe_rng import Stream
from h3lab.emulate import floats, lanes
from h3lab.emulate import tree as trees

VECTORS = json.loads((Path(__file__).parent / "data" / "emulate_sm90_vectors.json").read_text())
LAYOUTS = {"fwd32": lanes.mma(32), "fwd128": lanes.mma(128), "delta32": lanes.blocked(32, 8)}
LAYOUTS["delta128"] = lanes.blocked(128, 8)


def _tree(t):
    return t if isinstance(t, int) else (_tree(t[0]), _tree(t[1]))


@pytest.mark.parametrize("key", sorted(LAYOUTS))
def test_each_layouts_order_is_the_tree_the_gpu_showed(key):
    assert trees.same_tree(lanes.tree(LAYOUTS[key]), _tree(VECTORS["trees"][key]))


@pytest.mark.parametrize("key", sorted(LAYOUTS))
def test_row_sum_adds_in_its_trees_order(key):
    layout = LAYOUTS[key]
    x = values(Stream(3), (64, layout.width), -20, 20, torch.float32)  # spreads where the order shows
    assert torch.equal(floats.bits(lanes.row_sum(x, layout)), floats.bits(trees.tree_sum(x, lanes.tree(layout))))


@pytest.mark.parametrize("key", ["delta32", "delta128"])
def test_row_dot_gives_the_delta_kernels_bits(key):
    rec = VECTORS["delta_rows"][key]
    s = Stream(rec["seed"])  # tree_probe.run_probe's draws, in its order: O's rows, then dO's
    o = values(s, (rec["random_rows"], rec["n"]), -12, 12, torch.float32)
    do = values(s, (rec["random_rows"], rec["n"]), -3, 3, torch.bfloat16)
    n = len(rec["bits"])
    got = lanes.row_dot(do[:n].float(), o[:n], LAYOUTS[key])
    assert floats.bits(got).tolist() == rec["bits"]


def test_layouts_refuse_what_no_kernel_has():
    with pytest.raises(ValueError, match="multiple of 8"):
        lanes.mma(12)
    with pytest.raises(ValueError, match="2\\^k lanes"):
        lanes.RowLayout(((0, 1), (2, 3), (4, 5)))
