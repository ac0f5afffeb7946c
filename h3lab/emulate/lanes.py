"""tl.sum over a row of a register tile, in the order its Triton layout fixes on sm90.

Triton lowers a reduction along a tile's row in two stages, read off the compiled PTX of the
attention kernels (Triton 3.6, sm90) and confirmed by the tree probe on an H200
(h3lab.bench.tree_probe; tests/test_emulate_lanes.py holds the trees it recovered):
1. each thread adds the row elements it holds, in register order, one FP32 add each (a chain);
2. butterfly shuffles across the lanes holding the row, the largest lane distance first: after
   the shuffle at distance d each lane holds its sum plus that of lane ^ d (FP32 addition
   commutes, so both lanes of a pair hold the same value).
A `RowLayout` is the first stage's data: lanes[l] = the columns lane l holds, in register order
(a power-of-two number of lanes). The layouts of the kernels:
- `mma(n)`: a row of a wgmma accumulator n columns wide (attention_fwd's tl.sum(p, 1)): lane t of
  a quad holds columns 8j + 2t and 8j + 2t + 1 for j ascending;
- `blocked(n, per_lane)`: per_lane contiguous columns per lane (attention_delta's rows: 8 bf16 per
  16-byte load).
`row_dot` is the delta kernel's sum of products, whose multiply-adds LLVM contracts: each lane's
chain starts from the rounded product of its second element, FMAs the first into it, then FMAs its
third, fourth, ... (the PTX's order), before the same butterfly.

Dimension legend: R rows, N columns (the reduced axis), L lanes, E elements per lane.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.emulate.fma import fma_f32
from h3lab.emulate.tree import Tree, chain_tree


@dataclass(frozen=True)
class RowLayout:
    lanes: tuple[tuple[int, ...], ...]  # lanes[l]: the columns lane l holds, in register order

    def __post_init__(self) -> None:
        n = len(self.lanes)
        sizes = {len(cols) for cols in self.lanes}
        if n < 1 or n & (n - 1) or len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"RowLayout with {n} lanes of sizes {sorted(sizes)}; allowed: 2^k lanes of one size >= 1")
        flat = sorted(c for cols in self.lanes for c in cols)
        if flat != list(range(len(flat))):
            raise ValueError(f"RowLayout columns {flat[:8]}...; allowed: each of 0..{len(flat) - 1} exactly once")

    @property
    def width(self) -> int:
        return len(self.lanes) * len(self.lanes[0])

    def index(self) -> Tensor:
        """int64 [L, E]: the column of each lane's register."""
        return torch.tensor(self.lanes, dtype=torch.int64)


def mma(n: int) -> RowLayout:
    """A wgmma accumulator row of n columns (n a multiple of 8): 4 lanes, pairs every 8 columns."""
    if n < 8 or n % 8:
        raise ValueError(f"mma layout of {n} columns; allowed: a multiple of 8")
    return RowLayout(tuple(tuple(8 * j + 2 * t + i for j in range(n // 8) for i in (0, 1)) for t in range(4)))


def blocked(n: int, per_lane: int) -> RowLayout:
    """per_lane contiguous columns per lane, n / per_lane lanes."""
    if per_lane < 1 or n % per_lane:
        raise ValueError(f"blocked layout of {n} columns by {per_lane}; allowed: per_lane dividing n")
    return RowLayout(tuple(tuple(range(i * per_lane, (i + 1) * per_lane)) for i in range(n // per_lane)))


def _butterfly(v_RL: Tensor) -> Tensor:
    """[R]: the lanes' values added by shuffles, the largest distance first (module docstring)."""
    while v_RL.shape[-1] > 1:
        half = v_RL.shape[-1] // 2
        v_RL = v_RL[..., :half] + v_RL[..., half:]  # lane l and lane l + half (bit `half` of l flipped)
    return v_RL[..., 0]


def _lanes_of(x_RN: Tensor, layout: RowLayout) -> Tensor:
    if x_RN.shape[-1] != layout.width:
        raise ValueError(f"rows of {x_RN.shape[-1]} columns for a layout of {layout.width}; allowed: equal")
    return x_RN[..., layout.index().to(x_RN.device)]  # [..., L, E]


def row_sum(x_RN: Tensor, layout: RowLayout) -> Tensor:
    """FP32 [...]: tl.sum of each row of x (FP32 [..., N]) in `layout`'s order."""
    x = _lanes_of(x_RN.to(torch.float32), layout)
    acc = x[..., 0]
    for e in range(1, x.shape[-1]):
        acc = acc + x[..., e]
    return _butterfly(acc)


def row_dot(x_RN: Tensor, y_RN: Tensor, layout: RowLayout) -> Tensor:
    """FP32 [...]: tl.sum(x * y) of each row with the contracted lane chains (module docstring)."""
    x, y = _lanes_of(x_RN.to(torch.float32), layout), _lanes_of(y_RN.to(torch.float32), layout)
    if x.shape[-1] == 1:
        return _butterfly(x[..., 0] * y[..., 0])
    acc = fma_f32(x[..., 0], y[..., 0], x[..., 1] * y[..., 1])
    for e in range(2, x.shape[-1]):
        acc = fma_f32(x[..., e], y[..., e], acc)
    return _butterfly(acc)


def tree(layout: RowLayout) -> Tree:
    """row_sum's order as an h3lab.emulate.tree Tree (leaves are columns)."""
    nodes: list[Tree] = [chain_tree(list(cols)) for cols in layout.lanes]
    while len(nodes) > 1:
        half = len(nodes) // 2
        nodes = [(nodes[i], nodes[i + half]) for i in range(half)]
    return nodes[0]
