"""A layout's groups (`Layout.groups()`) created in a torch.distributed world, as one rank sees them.

Creating a group is collective: every rank of the world creates every group, in the same order,
also a rank that belongs to none of them (a world larger than the layout, as a benchmark that runs
several layouts in one launch has). `new_groups` is that order: each kind asked for, in the order
asked, each of its groups of more than one rank once, in index order; a group whose ranks an
earlier kind of the same call already created is that group again (under SP without CP the row
group is the TP group).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch.distributed as dist

from h3lab.parallel.layout import GROUP_KINDS, Layout

G = TypeVar("G")


@dataclass(frozen=True, eq=False)
class RankGroups(Generic[G]):
    """The groups of each kind that this rank belongs to (None: it belongs to none of that kind, a
    group of one rank, or a kind not created), and their ranks in member order."""

    layout: Layout
    rank: int
    made: Mapping[str, G | None]  # kind -> this rank's group
    members: Mapping[str, tuple[int, ...]]  # kind -> its ranks (this rank alone for a group of one)

    @property
    def tp(self) -> G | None:
        return self.made.get("tp")

    @property
    def cp(self) -> G | None:
        return self.made.get("cp")

    @property
    def rows(self) -> G | None:
        return self.made.get("rows")


def new_groups(
    layout: Layout, make: Mapping[str, Callable[[list[int]], G]], *, rank: int | None = None
) -> RankGroups[G]:
    """Create the groups of each kind of `make` (`make[kind](ranks)` creates one: `dist.new_group`,
    or a deterministic collective) and return this rank's. Every rank of the world calls this with
    the same arguments, in the same order. `rank`: this rank (default: torch.distributed's).

    Raises:
        ValueError: a kind that is not one of GROUP_KINDS.
    """
    bad = [k for k in make if k not in GROUP_KINDS]
    if bad:
        raise ValueError(f"group kinds {bad}; allowed: {list(GROUP_KINDS)}")
    rank = dist.get_rank() if rank is None else rank
    groups = layout.groups()
    created: dict[tuple[int, ...], G] = {}
    made: dict[str, G | None] = {}
    members: dict[str, tuple[int, ...]] = {}
    for kind, fn in make.items():
        for ranks in getattr(groups, kind):
            if len(ranks) > 1 and ranks not in created:
                created[ranks] = fn(list(ranks))
        if rank < layout.world:
            mine = groups.of(kind, rank)
            made[kind], members[kind] = created.get(mine), mine
    return RankGroups(layout, rank, made, members)
