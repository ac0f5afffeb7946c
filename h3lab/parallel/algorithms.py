"""Which algorithm a deterministic collective runs, and which tree it evaluates: the choice is data
(`CollectiveDecision`, recorded per call site), never arithmetic. Every algorithm evaluates the same
`balanced_tree` over the members in member order (h3lab.parallel.collectives), so a choice changes
bytes and time, not a bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

ALGORITHMS = ("auto", "gather_tree", "scatter_tree", "hierarchical")
# auto: gather_tree below, scatter_tree at or above these sizes of one member's partial. scatter_tree
# saves (P-1)(P-2)/P*S received bytes but pays a second collective (latency a), so it wins above
# S* = a*B*P/((P-1)(P-2)) (B = bandwidth). gloo: measured with `collective_check --bench`, P=8 on the
# 2-core box (oversubscribed, a ~ 5 ms): gather_tree vs scatter_tree 8.9 vs 10.7 ms at 64 KiB,
# 12.6 vs 13.4 ms at 256 KiB, 27.6 vs 17.2 ms at 1 MiB -> 256 KiB. NCCL on NVLink: a ~ 15 us,
# B ~ 370 GB/s busBw -> S* ~ 1 MiB at P=8 (estimate until the 8-GPU bench replaces it). At P=2
# both move S bytes, so gather_tree (one collective) always.
AUTO_SCATTER_MIN_BYTES = {"gloo": 256 << 10, "nccl": 1 << 20}


def tree_string(labels: Sequence[str]) -> str:
    """The `balanced_tree` expression over `labels`, e.g. "((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7))"."""
    if not labels:
        raise ValueError("tree_string needs at least one label")
    if len(labels) == 1:
        return labels[0]
    mid = (len(labels) + 1) // 2
    sides = [tree_string(labels[:mid]), tree_string(labels[mid:])]
    return "+".join(f"({s})" if "+" in s else s for s in sides)


def hierarchical_tree_string(labels: Sequence[str], local_size: int) -> str:
    """The nested tree: `tree_string` over groups of `local_size` consecutive labels, then over the groups."""
    return tree_string([tree_string(labels[i : i + local_size]) for i in range(0, len(labels), local_size)])


def hierarchical_local_sizes(num_members: int) -> list[int]:
    """Local sizes L whose nested tree (L-trees, then a tree over the groups) is the flat balanced tree."""
    labels = [f"r{i}" for i in range(num_members)]
    divisors = [d for d in range(1, num_members + 1) if num_members % d == 0]
    return [d for d in divisors if hierarchical_tree_string(labels, d) == tree_string(labels)]


@dataclass(frozen=True)
class CollectiveDecision:
    """What one call site of a collective ran, and why (recorded at its first call)."""

    site: str
    op: str  # "all_reduce" | "reduce_scatter" | "all_gather"
    algorithm: str  # "gather_tree" | "scatter_tree" | "hierarchical" | "copy" | "identity"
    reason: str
    tree: str  # the expression over members' global ranks ("copy" for all_gather)
    group: dict  # {"ranks": [...], "groups": [[...], ...], "local_size": L or None}
    dtype: str
    numel: int
    bytes_sent: int  # per member, what this member asked the backend to move (payload, padding included)
    bytes_received: int
    transport: str
    bytes_local: int = 0  # bytes read from other members' /dev/shm frames (no backend involved)

    def to_dict(self) -> dict:
        return asdict(self)


def choose_algorithm(
    op: str,
    requested: str,
    *,
    nbytes: int,
    num_members: int,
    local_size: int | None,
    transport: str,
    then: bool = False,
) -> tuple[str, str]:
    """(algorithm, reason) for one call; `local_size` is None unless the hierarchical tree is allowed;
    `then`: the caller's elementwise function runs on the reduced values before they are shared."""
    P = num_members
    if op == "all_gather":
        return "copy", "all_gather is a copy: one backend all-gather in member order, no arithmetic"
    if P == 1:
        return "identity", "one member: the tree is the member's tensor"
    if requested != "auto":
        return requested, f"requested {requested!r}"
    L = local_size
    if L is not None and L < P:
        return "hierarchical", (
            f"auto: local_size {L} < {P} members: tree over {L} node-local partials, "
            f"then an all-gather of {P // L} group partials per lane"
        )
    if op == "reduce_scatter":
        return "scatter_tree", "auto: reduce_scatter is scatter_tree's first half ((P-1)/P*S received, not (P-1)*S)"
    key = "nccl" if transport == "nccl" else "gloo"
    threshold = AUTO_SCATTER_MIN_BYTES[key]
    if P == 2 and then and nbytes >= threshold:
        return "scatter_tree", (
            f"auto: P=2, {nbytes} B >= {threshold} B ({key}) finished before sharing: the owner's half is "
            "finished, then gathered (S/2 + what the finish leaves of S/2 received, not S)"
        )
    if P == 2:
        return "gather_tree", "auto: P=2: gather_tree and scatter_tree both receive S; one collective beats two"
    if nbytes < threshold:
        return "gather_tree", f"auto: {nbytes} B < {threshold} B ({key}): latency-bound, one collective"
    return "scatter_tree", f"auto: {nbytes} B >= {threshold} B ({key}): bandwidth-bound, 2(P-1)/P*S received"
