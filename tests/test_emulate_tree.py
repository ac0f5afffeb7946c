"""Reduction trees (h3lab.emulate.tree): a probe of a known tree reads the tree back, whatever its shape."""

from __future__ import annotations

import random

import pytest
import torch

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
