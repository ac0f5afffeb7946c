"""`full_state_dict(model)`: a parallelized model's parameters whole, under diffusers' names, on every rank.

A unit-sharded weight is gathered over the rank's TP group (`BlockComm.gather_units`: bytes only)
and its shards joined in unit order (h3lab.units.join_shards); every other parameter is copied. The
result loads into a plain diffusers model (`load_state_dict`), or saves and compares as it is. Every
rank of the layout must call it together (under TP it is collective), in the same order.
"""

from __future__ import annotations

from torch import Tensor, nn

from h3lab.nn.state import is_sharded, require_state, split_name
from h3lab.units import join_shards


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter of `model` whole (new tensors, detached), in `named_parameters` order.

    Raises:
        ValueError: `model` is not parallelized.
    """
    state = require_state(model, "full_state_dict")
    out = {}
    for name, p in zip(state.names, state.params(model), strict=True):
        if not is_sharded(name, state):
            out[name] = p.detach().clone()
            continue
        gathered = state.comm.gather_units(p.detach().contiguous(), f"full_state_dict.{name}", dim=0)
        out[name] = join_shards(split_name(name)[1], list(gathered.chunk(state.layout.tp)))
    return out
