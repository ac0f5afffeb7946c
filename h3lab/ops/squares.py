"""Sums of squares for the clip's global norm, a fixed function of each tensor's elements alone.

The reference of h3lab.triton.squares, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from h3lab.ops.fixed import pair_sum

ROW_BLOCK = 1024  # elements per row block of `sum_of_squares`; a power of two: a block's tree needs no padding
_SQUARES_CHUNK = 4096  # row blocks squared at once: 16 MiB of FP32 temporaries whatever the tensor's size


def sum_of_squares(g: Tensor) -> Tensor:
    """The sum of squares of every element (0-d float32), a fixed function of the elements alone.

    FP32 squares of the elements in row-major order (a strided view is read in that order), in row
    blocks of ROW_BLOCK elements (the last padded with +0), each block summed by `pair_sum`, then the
    blocks' sums by `pair_sum`. h3lab.triton.squares computes the block sums as one kernel.
    """
    flat = g.reshape(-1)
    num_blocks = max(1, -(-flat.numel() // ROW_BLOCK))
    block_sums = []
    for b0 in range(0, num_blocks, _SQUARES_CHUNK):
        x = flat[b0 * ROW_BLOCK : (b0 + _SQUARES_CHUNK) * ROW_BLOCK].to(torch.float32)
        sq = x * x
        pad = -sq.numel() % ROW_BLOCK
        if pad or not sq.numel():
            sq = torch.cat([sq, sq.new_zeros(pad or ROW_BLOCK)])
        block_sums.append(pair_sum(sq.view(-1, ROW_BLOCK)))  # each row's tree depends on that row alone
    return pair_sum(torch.cat(block_sums))


def sums_of_squares(xs: Sequence[Tensor]) -> Tensor:
    """[len(xs)] float32: `sum_of_squares` of each tensor, in order."""
    return torch.stack([sum_of_squares(x) for x in xs])
