"""`clip_grad_norm_(model, max_norm)`: the global gradient norm of a parallelized model, in the canonical order.

The norm is h3lab's training step's (h3lab.train.clip): each piece's sum of squares (a parameter, a
block weight per canonical unit) by a fixed tree, the other TP positions' unit sums gathered, all
pieces added in the canonical order, never the ranks'; so it has the same bits on every rank of every
layout. The coefficient min(1, max_norm / (norm + 1e-6)) is not multiplied into `.grad` (a bf16
gradient would round once more): the model keeps it for the next `h3lab.optim.AdamW.step`, which
applies it inside its FP32 update, as h3lab's training step does. That step (or `zero_grad`) must
come before the next forward that records for autograd, and no gradient may change in between: both
are refused otherwise, so a coefficient is never lost or applied to other gradients.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from h3lab.nn.state import ParallelState, PendingClip, require_state, split_name
from h3lab.train.adamw import clipped_norm
from h3lab.train.pieces import Piece, block_weight_pieces, non_block_pieces
from h3lab.units import shard_unit_weights


def clip_grad_norm_(model: nn.Module, max_norm: float) -> Tensor:
    """The global norm of `model`'s gradients (0-d float32, before clipping); the coefficient is held for
    the optimizer (module docstring). Every rank of the layout calls it together (it gathers unit sums).

    Raises:
        ValueError: `model` not parallelized, `max_norm` not a number in (0, inf], no gradients, or a
            block whose gradients are there for some of its parameters only.
        NonFiniteGradError: the norm is NaN or Inf (nothing is held; h3lab.train.adamw).
    """
    state = require_state(model, "clip_grad_norm_")
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0 or math.isnan(max_norm):
        raise ValueError(f"max_norm {max_norm!r}; allowed: a number in (0, inf]")
    params = dict(zip(state.names, state.params(model), strict=True))
    grads = {n: p.grad for n, p in params.items() if p.grad is not None}
    if not grads:
        raise ValueError("clip_grad_norm_: no parameter has a gradient; allowed: after a backward")
    gn, coef = clipped_norm(
        grad_pieces(state, grads),
        comm=state.comm,
        config=state.config,
        backend=state.backend,
        max_norm=float(max_norm),
        at="clip_grad_norm_",
    )
    pending = {n: (g, g._version) for n, g in grads.items()}
    state.clip = PendingClip(coef=coef, norm=gn.norm, grads=pending, names={id(p): n for n, p in params.items()})
    return gn.norm


def grad_pieces(state: ParallelState, grads: dict[str, Tensor]) -> dict[Piece, Tensor]:
    """The gradients by piece (h3lab.train.pieces), views of the tensors: a block's unit-sharded
    gradients per canonical unit this rank holds."""
    per_block: dict[int, dict[str, Tensor]] = {}
    out = non_block_pieces({n: g for n, g in grads.items() if split_name(n)[0] is None})
    for name, g in grads.items():
        block, rest = split_name(name)
        if block is not None:
            per_block.setdefault(block, {})[rest] = g
    for i, tensors in sorted(per_block.items()):
        try:
            uw = shard_unit_weights(state.config, tensors, state.comm.units)
        except ValueError as err:
            raise ValueError(
                f"block {i}: {err}; allowed: gradients of all its parameters, or of none (a frozen block)"
            ) from None
        out |= block_weight_pieces(i, uw)
    return out
