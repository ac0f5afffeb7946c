"""Which ranks own each part of a layout's result, and the ranks' shards put back into the full tensor.

A tensor a rank holds sits in the canonical one in one of these spaces (the block's trace names
them, h3lab.block.forward.Trace):
  local       this rank's local rows (its row shard, `SeqShard.local_rows`): padded rows, row order
  tp_units    its CP group's rows x its units' columns, unit-major
  units       a stack [U_local, ...] of its canonical units
  unit        one canonical unit's tensor (every rank holding the unit holds the same bytes)
  replicated  the same on every rank
Owners: the ranks of `Layout.groups().rows[0]` hold every row once, in row order; the TP ranks of CP
group 0 hold every canonical unit once, in unit order (`unit_owners`); the other ranks hold replicas
that must have the same bytes (`replica_source`). Pure functions of validated data: no process group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from h3lab.config import NUM_UNITS
from h3lab.contract import units_of_rank
from h3lab.metrics import bitwise_equal
from h3lab.parallel.layout import Layout

SPACES = ("local", "tp_units", "units", "unit", "replicated")


def units_of(layout: Layout, rank: int) -> range:
    """The canonical units `rank` holds (those of its TP index: contiguous, the same in every CP group)."""
    return units_of_rank(layout.coords(rank)[1], layout.tp)


def unit_owners(layout: Layout, cp_index: int = 0) -> tuple[int, ...]:
    """The rank of CP group `cp_index` holding each canonical unit: `unit_owners(layout)[u]` for unit
    u in range(NUM_UNITS). Every CP group holds every unit once; CP group 0's are the owners."""
    tp = layout.groups().tp[cp_index]
    return tuple(tp[u // (NUM_UNITS // layout.tp)] for u in range(NUM_UNITS))


def row_shard(layout: Layout, rank: int) -> int:
    """The index of `rank`'s local rows among the row shards (0 .. row_shards - 1, row order)."""
    return layout.groups().of("rows", rank).index(rank)


def replica_source(layout: Layout, rank: int, space: str) -> int:
    """The owner whose copy of a `space` tensor `rank`'s copy must equal byte for byte (itself when
    no other rank holds those bytes)."""
    if space in ("local", "tp_units"):
        return layout.groups().rows[0][row_shard(layout, rank)] if space == "local" else rank
    if space in ("units", "unit"):
        return layout.groups().tp[0][layout.coords(rank)[1]]  # the same TP index in CP group 0
    if space == "replicated":
        return 0
    raise ValueError(f"space {space!r}; allowed: {list(SPACES)}")


def full_tensor(parts: Sequence[Tensor], layout: Layout, space: str, num_rows: int | None = None) -> Tensor:
    """The canonical tensor from every rank's part (`parts[r]`: rank r's), rows trimmed to `num_rows`
    (None: all, padding rows included). A "unit" tensor has no parts to join: see `full_tensors`."""
    if len(parts) != layout.world:
        raise ValueError(f"{len(parts)} parts for layout {layout.name}; allowed: one per rank ({layout.world})")
    groups = layout.groups()
    if space == "replicated":
        return parts[0]
    if space == "local":
        return torch.cat([parts[r] for r in groups.rows[0]])[:num_rows]
    if space == "units":
        return torch.cat([parts[r] for r in groups.tp[0]])
    if space == "tp_units":  # columns over each CP group's TP ranks, then rows over the CP groups
        return torch.cat([torch.cat([parts[r] for r in tp], dim=1) for tp in groups.tp])[:num_rows]
    raise ValueError(f"space {space!r}; allowed: {[s for s in SPACES if s != 'unit']}")


def full_tensors(
    parts: Sequence[Mapping[str, Tensor]],
    layout: Layout,
    space_of: Callable[[str], str],
    num_rows: int | None = None,
) -> dict[str, Tensor]:
    """Every named tensor of the ranks (`parts[r]`: rank r's, by name) in its canonical form; a "unit"
    tensor is taken from the TP rank of CP group 0 that holds it. Names in the order first seen."""
    out = {}
    for name in dict.fromkeys(k for p in parts for k in p):
        space = space_of(name)
        if space == "unit":
            out[name] = next(parts[r][name] for r in layout.groups().tp[0] if name in parts[r])
        else:
            out[name] = full_tensor([p[name] for p in parts], layout, space, num_rows)
    return out


def replicas_agree(parts: Sequence[Mapping[str, Tensor]], layout: Layout, space_of: Callable[[str], str]) -> bool:
    """Whether every rank's tensor has the bytes of its replica source's (`replica_source`)."""
    return all(
        bitwise_equal(t, parts[replica_source(layout, r, space_of(name))][name])
        for r, p in enumerate(parts)
        for name, t in p.items()
    )
