"""Pieces: the units of training state a rank holds, named, and their one canonical order.

A piece is one tensor the optimizer keeps state for and the clip sums over:
- `Piece(i, grad, u)`: canonical unit u of a unit-sharded weight of block i, by block_step's per-unit
  gradient name (`BlockStep.dw_units` keys: `attn.to_q.weight`, ..., `ff.hidden`, `ff.gate`, ...);
- `Piece(i, param, None)`: a replicated weight of block i (`norm1.weight`, `attn.norm_q.weight`, ...);
- `Piece(None, param, None)`: a non-block parameter by its diffusers name (`proj_in.weight`, ...).

The canonical order is layout-free: parameters in diffusers' order (`model_param_shapes`: the
embedders and refiner, the blocks by index, then norm_out and the heads); inside a block, its
parameters in diffusers' order; a unit-sharded parameter per canonical unit ascending, and inside a
unit its per-unit gradients in row order (`ff.net.0.proj.weight`: hidden, then gate). A rank holds
every replicated and non-block piece and the unit pieces of its TP units (`comm.units`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from torch import Tensor

from h3lab.config import NUM_UNITS, H3Config, block_param_shapes, model_param_shapes
from h3lab.tensorname import TensorName
from h3lab.units import REPLICATED, UNIT_GRAD_FIELDS, UNIT_SHARDED, UnitWeights


class Piece(NamedTuple):
    block: int | None  # transformer block index; None for a non-block parameter
    name: str  # per-unit gradient name, replicated block parameter, or diffusers name
    unit: int | None  # canonical unit; None for a replicated or non-block piece


# unit-sharded parameter -> its per-unit gradient names, in the parameter's row order
UNIT_PARTS: dict[str, tuple[str, ...]] = {
    p: (("ff.hidden", "ff.gate") if p == "ff.net.0.proj.weight" else (p,)) for p in UNIT_SHARDED
}
assert sorted(g for parts in UNIT_PARTS.values() for g in parts) == sorted(UNIT_GRAD_FIELDS)


def canonical_pieces(config: H3Config, blocks: Iterable[int], non_block: Iterable[str]) -> list[Piece]:
    """Every piece of `blocks` (all 8 units) and of the non-block parameters `non_block`, in canonical order.

    Raises:
        ValueError: a non-block name that is not a parameter of `config`, or a negative block index.
    """
    blocks, non_block = sorted(set(blocks)), set(non_block)
    if blocks and blocks[0] < 0:
        raise ValueError(f"block index {blocks[0]} is negative; allowed: 0 and up")
    names = list(model_param_shapes(config, 1))
    first = next(k for k, n in enumerate(names) if n.startswith("transformer_blocks."))
    before = [n for n in names[:first] if n in non_block]
    after = [n for n in names[first:] if n in non_block]
    unknown = sorted(non_block - set(before) - set(after))
    if unknown:
        allowed = sorted(n for n in names if not n.startswith("transformer_blocks."))
        raise ValueError(f"{unknown[:4]} are not non-block parameters of this config; allowed: {allowed}")
    out = [Piece(None, n, None) for n in before]
    for i in blocks:
        for p in block_param_shapes(config):
            if p in REPLICATED:
                out.append(Piece(i, p, None))
            else:
                out += [Piece(i, g, u) for u in range(NUM_UNITS) for g in UNIT_PARTS[p]]
    return out + [Piece(None, n, None) for n in after]


def rank_pieces(config: H3Config, held: Iterable[Piece], units: range) -> list[Piece]:
    """The canonical order of the pieces a rank holding `units` must hold, given the pieces it holds.

    The blocks and non-block parameters are those named in `held`; every rank of a layout must hold
    the same ones (the clip gathers one sum per unit piece from each TP rank).

    Raises:
        ValueError: `held` differs from that set (a missing, unexpected or foreign-unit piece).
    """
    held = set(held)
    blocks = {p.block for p in held if p.block is not None}
    order = canonical_pieces(config, blocks, {p.name for p in held if p.block is None})
    want = [p for p in order if p.unit is None or p.unit in units]
    position = {p: k for k, p in enumerate(order)}  # foreign units in canonical order, unknown names last
    missing = [p for p in want if p not in held]
    extra = sorted(held - set(want), key=lambda p: (position.get(p, len(order)), str(p)))
    if missing or extra:
        raise ValueError(
            f"pieces for units {list(units)}: missing {[piece_label(p) for p in missing[:4]]}"
            f"{' ...' if len(missing) > 4 else ''}, unexpected {[piece_label(p) for p in extra[:4]]}"
            f"{' ...' if len(extra) > 4 else ''}; allowed: every replicated and non-block piece of the "
            f"blocks and parameters held, and the unit pieces of units {list(units)}"
        )
    return want


def piece_label(piece: Piece, kind: str = "") -> str:
    """The runner's tensor name: `block{i}.{kind}.<grad>@u{u}`, `block{i}.{kind}.<param>`, `{kind}.<param>`.

    `kind` "w" names updated weights (as "dw" names gradients); "" gives the bare label.
    """
    return str(TensorName(f"{kind}.{piece.name}" if kind else piece.name, block=piece.block, unit=piece.unit))


def block_grad_pieces(
    index: int, dw_units: Mapping[str, Mapping[int, Tensor]], dw_replicated: Mapping[str, Tensor]
) -> dict[Piece, Tensor]:
    """Block `index`'s gradients as a rank holds them (`BlockStep.dw_units`, `.dw_replicated`), by piece."""
    out = {Piece(index, g, u): t for g, per in dw_units.items() for u, t in per.items()}
    return out | {Piece(index, p, None): t for p, t in dw_replicated.items()}


def block_weight_pieces(index: int, uw: UnitWeights) -> dict[Piece, Tensor]:
    """Block `index`'s weights as a rank reads them (views of its units; the optimizer writes into them)."""
    out = {Piece(index, g, u): getattr(uw, field)[u] for g, field in UNIT_GRAD_FIELDS.items() for u in uw.units}
    return out | {Piece(index, p, None): t for p, t in uw.replicated.items()}


def non_block_pieces(tensors: Mapping[str, Tensor]) -> dict[Piece, Tensor]:
    """Non-block parameters (or their gradients) by diffusers name, as pieces."""
    return {Piece(None, n, None): t for n, t in tensors.items()}
