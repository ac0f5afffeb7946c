"""The global gradient norm, summed in one canonical order, and the clip coefficient.

norm = sqrt(total), total = the sum of squares of every gradient element of the model:
1. each piece's own sum (h3lab.train.pieces) is a fixed function of its elements alone,
   h3lab.ops.squares.sum_of_squares (FP32 squares in row-major order, in row blocks of ROW_BLOCK
   elements, each block summed by a balanced tree, then the blocks' sums by one), computed by the
   backend's `sums_of_squares` (the Triton kernel has the reference's bits);
2. a rank sums the pieces it holds; the unit pieces' sums of the other TP positions arrive through
   `comm.gather_units` (bytes only, one [8, C] FP32 tensor), so every rank holds all of them;
3. the pieces' sums in the canonical piece order (never the ranks' order), by a balanced tree.
Each step is IEEE FP32 mul, add or correctly rounded sqrt (`sqrt_f32`), so the norm has the same
bits for any split of the 8 units into contiguous TP ranges and in a single process (LocalComm).
Finite gradients whose squares overflow FP32 (elements above ~1.8e19) give an infinite total, as a
NaN or Inf gradient does.

The clip coefficient is torch.nn.utils.clip_grad_norm_'s, min(1, max_norm / (norm + 1e-6)), in FP32
with one IEEE division (torch's `max_norm / tensor` is a reciprocal and a multiply).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.comm import BlockComm
from h3lab.config import NUM_UNITS, H3Config
from h3lab.host import to_device
from h3lab.ops.fixed import pair_sum, sqrt_f32
from h3lab.train.pieces import Piece, canonical_pieces, rank_pieces

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s; its FP32 rounding is used
SITE = "train.clip.sum_of_squares"


@dataclass(frozen=True, eq=False)
class GradNorm:
    """The global norm and what it was summed from, identical on every rank."""

    norm: Tensor  # 0-d float32
    total: Tensor  # 0-d float32: the sum of squares
    piece_sums: Tensor  # [P] float32: every piece's sum of squares, in `order`
    order: list[Piece]  # every piece of the model (all 8 units), canonical order

    def nonfinite_pieces(self) -> list[Piece]:
        """The pieces whose sum of squares is NaN or Inf, in canonical order (a host sync)."""
        bad = (~torch.isfinite(self.piece_sums)).nonzero().flatten().tolist()
        return [self.order[k] for k in bad]


def unit_piece_sums(grads: Mapping[Piece, Tensor], columns: list[tuple[int, str]], units: range, be: Backend) -> Tensor:
    """[len(units), C] float32: the sum of squares of piece (block, grad) of unit u at [u - units.start, c]."""
    sums = be.sums_of_squares([grads[Piece(b, g, u)] for u in units for b, g in columns])
    return sums.view(len(units), len(columns))


def global_grad_norm(grads: Mapping[Piece, Tensor], comm: BlockComm, config: H3Config, be: Backend) -> GradNorm:
    """The global norm of the gradients every rank of a layout holds together (module docstring).

    Every rank calls it with its own pieces (`rank_pieces`: the same blocks and non-block parameters on
    every rank, the unit pieces of `comm.units`) at the same point: it makes one `gather_units` call.
    `be` computes the sums of squares; every backend gives the same bits.

    Raises:
        ValueError: no gradients, or pieces that differ from what a rank holding `comm.units` holds.
    """
    if not grads:
        raise ValueError("global_grad_norm: no gradients; allowed: a rank's pieces (h3lab.train.pieces)")
    rank_pieces(config, grads, comm.units)
    order = canonical_pieces(
        config, {p.block for p in grads if p.block is not None}, {p.name for p in grads if p.block is None}
    )
    columns = [(p.block, p.name) for p in order if p.unit == 0]
    own = [p for p in order if p.unit is None]
    device = next(iter(grads.values())).device
    sources = []
    if own:
        sources.append(be.sums_of_squares([grads[p] for p in own]))
    if columns:
        gathered = comm.gather_units(unit_piece_sums(grads, columns, comm.units, be), SITE, dim=0)
        assert gathered.shape == (NUM_UNITS, len(columns)), (gathered.shape, len(columns))
        sources.append(gathered.reshape(-1))
    slot = {p: k for k, p in enumerate(own)}
    col = {c: k for k, c in enumerate(columns)}
    index = [slot[p] if p.unit is None else len(own) + p.unit * len(columns) + col[(p.block, p.name)] for p in order]
    piece_sums = torch.cat(sources).index_select(0, to_device(index, torch.int64, device))  # no host sync
    total = pair_sum(piece_sums)
    return GradNorm(norm=sqrt_f32(total), total=total, piece_sums=piece_sums, order=order)


def to_f32(x: float) -> float:
    """`x` rounded to the nearest float32 (ties to even), as a Python float; beyond FP32's range, +-inf."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # struct refuses only finite values that round to +-inf
        return math.copysign(math.inf, x)


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """min(1, max_norm / (norm + 1e-6)) in float32 (max_norm and 1e-6 rounded to FP32 first).

    max_norm = inf gives 1 for every finite norm (no clipping); a NaN norm gives NaN.

    Raises:
        ValueError: max_norm not a positive number.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_grad_norm {max_norm!r} not allowed; allowed: a number in (0, inf]")
    denom = norm + to_f32(CLIP_EPS)
    return torch.clamp(torch.full_like(denom, to_f32(float(max_norm))) / denom, max=1.0)
