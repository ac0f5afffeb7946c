"""The unit-tree GEMM: per canonical unit one FP32 chain over its blocks, then the contract's tree.

The torch backend's `unit_reduce`, and the reference of h3lab.triton.unit_gemm (and of its few-row
form, h3lab.triton.few_rows.unit_mm_few_rows). Dimension legend: M rows, U units, Kp a unit's
columns of a piece, N columns.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from h3lab.ops.chain import chain_mm
from h3lab.ops.fixed import unit_tree

# Operands of a unit-tree GEMM: pieces (a [M, U*Kp], b [U*Kp, N]); unit i is column block i of
# every piece's a and row block i of its b. Each unit is one chain over its blocks, pieces in order
# (q,k,v / hidden,gate), then the balanced tree over the U units.
Pieces = Sequence[tuple[Tensor, Tensor]]


def unit_mm(pieces: Pieces, num_units: int) -> Tensor:
    """FP32 [M, N]: per unit one chain over its blocks (pieces in order), then `unit_tree` over the units."""
    partials = []
    for i in range(num_units):
        acc = None
        for a, b in pieces:
            kp = a.shape[1] // num_units
            acc = chain_mm(a[:, i * kp : (i + 1) * kp], b[i * kp : (i + 1) * kp], acc)
        partials.append(acc)
    return unit_tree(partials)
