"""The block's GEMM: c = a @ b as FP32 chains over k ascending, rounded once.

The torch backend's `mm`, and the reference of h3lab.triton.gemm (whose tensor-core tiles add the
same products in their own fixed order: its bits are its own, equal across layouts).
Dimension legend: M rows, K reduced, N columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

from h3lab.ops.chain import chain_mm
from h3lab.ops.fixed import round_to


def mm(a_MK: Tensor, b_KN: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """a @ b: one FP32 chain over k per output element (`chain_mm`), rounded once to `out_dtype`."""
    return round_to(chain_mm(a_MK, b_KN), out_dtype)
