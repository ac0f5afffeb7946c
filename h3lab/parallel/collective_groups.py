"""`new_collective`: a `DeterministicCollective` over global ranks and the process groups it runs on.

Every rank of the world calls it in the same order with the same arguments; it refuses bad arguments
before any group exists, then makes the flat group, for the hierarchical tree the node groups and the
lanes, and for a pipelined all_reduce a second communicator (h3lab.parallel.collectives).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from h3lab.parallel.algorithms import ALGORITHMS, hierarchical_local_sizes, hierarchical_tree_string, tree_string
from h3lab.parallel.collectives import DeterministicCollective
from h3lab.parallel.transport import Group


def new_collective(
    ranks: list[int],
    *,
    algorithm: str = "auto",
    local_size: int | None = None,
    device: torch.device | None = None,
    segment_bytes: int | None = None,
) -> DeterministicCollective:
    """A deterministic collective over global `ranks` (member order = list order).

    Every rank of the world must call this, in the same order with the same arguments: it creates
    the process groups (flat, and for hierarchical the node groups and lanes). Non-members get an
    object that raises ValueError when used. `segment_bytes` pipelines scatter_tree's all_reduce of
    messages of at least two segments (the same bits, see transport.pipelined_scatter_all_reduce).

    Raises:
        ValueError: unknown algorithm, bad ranks, a segment_bytes below 1, a local size that does not
            divide the members or (for "hierarchical") whose nested tree differs from the flat balanced
            tree, torch.distributed not initialised.
    """
    nested_ok = _check_arguments(ranks, algorithm, local_size, segment_bytes)
    rank = _world_rank(ranks)
    P = len(ranks)
    flat = Group.make(ranks, rank) if P > 1 else None
    intra = lane = None
    if nested_ok and algorithm in ("auto", "hierarchical") and P > 1:
        intra, lane = _nested_groups(ranks, rank, local_size, flat)
    # a pipelined all_reduce gathers on a second communicator, so its gathers overlap its all-to-alls
    second = Group.make(ranks, rank) if segment_bytes is not None and P > 1 else None
    return DeterministicCollective(
        members=ranks,
        rank=rank,
        algorithm=algorithm,
        local_size=local_size,
        hierarchical=nested_ok,
        device=device,
        flat_group=flat,
        intra_group=intra,
        lane_group=lane,
        segment_bytes=segment_bytes,
        gather_group=second,
    )


def _check_arguments(ranks: list[int], algorithm: str, local_size: int | None, segment_bytes: int | None) -> bool:
    """Refuse bad arguments before any process group exists; returns whether `local_size` allows the
    hierarchical tree (its nested tree is the flat balanced tree)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} not allowed; allowed: {list(ALGORITHMS)}")
    if segment_bytes is not None and segment_bytes < 1:
        raise ValueError(f"segment_bytes {segment_bytes}; allowed: None or a positive byte count")
    P = len(ranks)
    if P == 0 or len(set(ranks)) != P:
        repeated = sorted({q for q in ranks if ranks.count(q) > 1})
        raise ValueError(
            f"ranks {ranks}: need at least one rank, each once; allowed: a non-empty list of distinct ranks"
            + (f" (repeated: {repeated})" if repeated else "")
        )
    if local_size is not None and (local_size < 1 or P % local_size):
        divisors = [d for d in range(1, P + 1) if P % d == 0]
        raise ValueError(f"local_size {local_size} does not split {P} members into equal groups; allowed: {divisors}")
    labels = [f"r{q}" for q in ranks]
    nested_ok = local_size is not None and local_size in hierarchical_local_sizes(P)
    if algorithm == "hierarchical" and not nested_ok:
        if local_size is None:
            raise ValueError(
                f"algorithm 'hierarchical' needs local_size, got None; allowed: {hierarchical_local_sizes(P)} "
                f"for {P} members"
            )
        raise ValueError(
            f"local_size {local_size} with {P} members: nested tree {hierarchical_tree_string(labels, local_size)} "
            f"!= flat {tree_string(labels)}; allowed: {hierarchical_local_sizes(P)} (power-of-two group count, or 1)"
        )
    return nested_ok


def _world_rank(ranks: list[int]) -> int:
    """This process's global rank, once torch.distributed is up and every one of `ranks` is in its world."""
    if not dist.is_initialized():
        raise ValueError(
            "new_collective needs torch.distributed initialised (init_process_group): dist.is_initialized() is "
            "False; allowed: calls after init_process_group"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    outside = [q for q in ranks if not 0 <= q < world]
    if outside:
        raise ValueError(f"ranks {ranks}: {outside} outside the world; allowed: 0..{world - 1} (world size {world})")
    return rank


def _nested_groups(
    ranks: list[int], rank: int, local_size: int, flat: Group | None
) -> tuple[Group | None, Group | None]:
    """(intra, lane): this rank's node group of `local_size` consecutive members and its lane (members
    with the same local index). Every rank creates every group, in the same order: node groups, then
    lanes; one node group (or one-member groups) reuses the flat group."""
    P = len(ranks)
    L, G = local_size, P // local_size
    intra, lane = flat if G == 1 else None, flat if L == 1 else None
    if 1 < L < P:
        for g in range(G):
            intra = Group.make(ranks[g * L : (g + 1) * L], rank) or intra
        for lane_index in range(L):
            lane = Group.make(ranks[lane_index::L], rank) or lane
    return intra, lane
