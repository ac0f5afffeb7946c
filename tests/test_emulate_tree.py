"""Reduction trees (h3lab.emulate.tree): a probe of a known tree reads the tree back, whatever its shape;
the attention kernels' trees are the ones the H200 gave, and sum its rows to its bits."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from h3lab.bench.mma_cases import values
from h3lab.bench.probe_rng import Stream
from h3lab.bench.tree_probe import RANDOM_ROWS
from h3lab.emulate import floats
from h3lab.emulate import tree as t


def _random_tree(leaves: list[int], rng: random.Random) -> t.Tree:
    if len(leaves) == 1:
        return leaves[0]
    cut = rng.randint(1, len(leaves) - 1)
    return (_random_tree(leaves[:cut], rng), _random_tree(leaves[cut:], rng))


def _layout_tree(n: int, lanes: int) -> t.Tree:
    """A tl.sum-like tree: each lane chains its columns (2 of every 2 * lanes), then butterflies."""
    per_lane = [t.chain_tree([c for c in range(n) if (c // 2) % lanes == q]) for q in range(lanes)]
    while len(per_lane) > 1:
        half = len(per_lane) // 2
        per_lane = [(per_lane[i], per_lane[i + half]) for i in range(half)]
    return per_lane[0]


@pytest.mark.parametrize("n", [2, 3, 32, 128])
def test_a_probe_of_a_tree_reads_it_back(n):
    rng = random.Random(n)
    shapes = [_random_tree(list(range(n)), rng), t.chain_tree(list(range(n)))]
    if n % 8 == 0:
        shapes.append(_layout_tree(n, 4))
    for tree in shapes:
        rows, pairs = t.probe_rows(n)
        sums = t.tree_sum(rows, tree)
        found = t.tree_from_lca_sizes(t.lca_sizes(sums, pairs, n))
        assert t.same_tree(found, tree)
        assert t.lca_size_table(tree) == t.lca_sizes(sums, pairs, n)


def test_the_tree_decides_the_sum():
    x = torch.tensor([[2.0**24, 1.0, 1.0, -(2.0**24)]])
    assert t.tree_sum(x, t.chain_tree([0, 1, 2, 3])).item() == 0.0  # 2^24 + 1 rounds back to 2^24
    assert t.tree_sum(x, ((1, 2), (0, 3))).item() == 2.0


def test_children_order_does_not_matter_but_shape_does():
    assert t.same_tree(((0, 1), 2), (2, (1, 0)))
    assert not t.same_tree(((0, 1), 2), (0, (1, 2)))


def test_sizes_that_fit_no_tree_are_refused():
    sizes = {(0, 1): 3, (0, 2): 3, (1, 2): 3}  # three leaves meeting at once
    with pytest.raises(ValueError, match="fit no binary tree"):
        t.tree_from_lca_sizes(sizes)
    _, pairs = t.probe_rows(4)
    with pytest.raises(ValueError, match=r"probe row \(0, 1\) summed to 2.5"):
        t.lca_sizes(torch.full((len(pairs),), 2.5), pairs, 4)


# ---- the kernels' trees, as the H200 answered them (h3lab.bench.tree_probe) ---------

PROBED = json.loads((Path(__file__).parent / "data" / "sm90_probe_vectors.json").read_text())["trees"]


def _as_tree(x) -> t.Tree:
    return x if isinstance(x, int) else (_as_tree(x[0]), _as_tree(x[1]))


def _saved(words: str) -> torch.Tensor:
    return torch.tensor([int(w, 16) for w in words.split()], dtype=torch.int64)


def _kernel_tree(name: str) -> t.Tree:
    n = int(name.removeprefix("fwd").removeprefix("delta"))
    return t.wgmma_row_tree(n) if name.startswith("fwd") else t.blocked_row_tree(n)


@pytest.mark.parametrize("name", sorted(PROBED))
def test_the_kernels_trees_are_the_ones_the_h200_gave(name):
    assert t.same_tree(_kernel_tree(name), _as_tree(PROBED[name]["tree"]))


@pytest.mark.parametrize("name", sorted(PROBED))
def test_the_probes_random_rows_sum_to_the_h200s_bits(name):
    # the probe's rows (tree_probe.run_probe) redrawn from its seed: the first 32 of each saved set
    entry, n = PROBED[name], int(name.removeprefix("fwd").removeprefix("delta"))
    s = Stream(entry["seed"])
    x = values(s, (RANDOM_ROWS, n), -12, 12, torch.bfloat16 if name.startswith("fwd") else torch.float32)[:32]
    tree = _kernel_tree(name)
    assert torch.equal(floats.bits(t.tree_sum(x, tree)), _saved(entry["random"]))
    if "random_do" in entry:  # attention_delta with products that round: the contraction decides
        do = values(s, (RANDOM_ROWS, n), -3, 3, torch.bfloat16)[:32]
        want = _saved(entry["random_do"])
        assert torch.equal(floats.bits(t.contracted_sum(do, x, tree)), want)
        assert not torch.equal(floats.bits(t.tree_sum(do.float() * x, tree)), want)


def test_kernel_trees_refuse_shapes_they_do_not_have():
    with pytest.raises(ValueError, match=r"a wgmma row of 20 columns; allowed: a multiple of 8"):
        t.wgmma_row_tree(20)
    with pytest.raises(ValueError, match=r"a row of 48 over 8 per thread; allowed: n / per_thread a power of two"):
        t.blocked_row_tree(48)
    with pytest.raises(ValueError, match=r"butterfly over 3 threads; allowed: a power of two"):
        t.butterfly([0, 1, 2])
