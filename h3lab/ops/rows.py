"""Cross-row reductions in logical-key order: weight gradients, norm weights, AdaLN table rows.

Dimension legend: R rows (any order, any sharding), N/K columns, G table rows (3 x timesteps).
The canonical order of rows is ascending `logical_keys` (lexicographic), padding (first key < 0)
dropped; so permuting, padding or sharding rows can never change a weight gradient's bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from h3lab.ops.chain import chain_mm
from h3lab.ops.fixed import round_to


def _lexsort(keys_R2: Tensor) -> Tensor:
    """Indices sorting the rows by (key0, key1) ascending (two stable sorts)."""
    order = torch.argsort(keys_R2[:, 1], stable=True)
    return order[torch.argsort(keys_R2[order, 0], stable=True)]


def has_duplicate_rows(keys_R2: Tensor) -> Tensor:
    """0-d bool on the keys' device: whether two rows of `keys_R2` are equal (no host sync)."""
    s = keys_R2[_lexsort(keys_R2)]
    return (s[1:] == s[:-1]).all(dim=1).any()


def first_duplicate_row(keys_R2: Tensor) -> list[int]:
    """The first row (in ascending key order) that another row of `keys_R2` equals; one must exist."""
    s = keys_R2[_lexsort(keys_R2)]
    return s[int((s[1:] == s[:-1]).all(dim=1).nonzero()[0, 0])].tolist()


def key_order(keys_R2: Tensor) -> Tensor:
    """Indices of the active rows, sorted by (key0, key1) ascending. Raises on duplicate active keys."""
    active = (keys_R2[:, 0] >= 0).nonzero().flatten()
    k = keys_R2[active]
    order = _lexsort(k)
    sorted_keys = k[order]
    if sorted_keys.shape[0] > 1 and bool((sorted_keys[1:] == sorted_keys[:-1]).all(dim=1).any()):
        raise ValueError(f"logical_keys: duplicate active key {first_duplicate_row(k)}; allowed: each active key once")
    return active[order]


def _take(x: Tensor, order: Tensor) -> Tensor:
    # rows already in canonical order are used in place (no gather), as the GPU path does
    if order.numel() == x.shape[0] and bool((order == torch.arange(x.shape[0], device=order.device)).all()):
        return x
    return x.index_select(0, order)


def row_mm(a_RN: Tensor, b_RK: Tensor, order: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """sum over rows r in `order` of a[r]^T b[r]: [N, K] (a weight gradient dY^T X), FP32 then one rounding."""
    return round_to(chain_mm(_take(a_RN, order).t(), _take(b_RK, order)), out_dtype)


def row_sum(x_RN: Tensor, order: Tensor) -> Tensor:
    """sum over rows in `order` of x[r], one FP32 chain: [N...]."""
    x = _take(x_RN, order).to(torch.float32)
    acc = torch.zeros(x.shape[1:], dtype=torch.float32, device=x.device)
    for r in range(x.shape[0]):
        acc.add_(x[r])
    return acc


def segment_sum(x_RN: Tensor, segment_R: Tensor, num_segments: int, order: Tensor) -> Tensor:
    """For each segment g, the chain over its rows in `order`: [G, N...] float32.

    Vectorised over segments: rows are laid out [G, longest segment] in key order and the chain
    runs over the second axis; short segments are padded with +0, which leaves a chain unchanged.
    """
    x = _take(x_RN, order).to(torch.float32)
    seg = _take(segment_R, order)
    counts = torch.bincount(seg, minlength=num_segments)
    slot = torch.zeros_like(seg)
    for g in range(num_segments):  # position of each row within its segment, in key order
        mask = seg == g
        slot[mask] = torch.arange(int(counts[g]), device=seg.device)
    width = int(counts.max()) if counts.numel() else 0
    grid = x.new_zeros((num_segments, width, *x.shape[1:]))
    grid[seg, slot] = x
    acc = x.new_zeros((num_segments, *x.shape[1:]))
    for j in range(width):
        acc.add_(grid[:, j])
    return acc
