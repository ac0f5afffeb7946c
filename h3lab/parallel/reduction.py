"""Each algorithm of the deterministic collectives (h3lab.parallel.collectives) as it runs on one member:
the bytes it moves (h3lab.parallel.transport) and the tree over the members' partials it evaluates
(`balanced_tree` in member order, whatever the algorithm: the same bits from each).

`start_reduce` queues an all_reduce's or reduce_scatter's first backend call and returns its finish;
`gather` is all_gather's copy; `signatures` exchanges every member's (dtype, shape).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.ops.fixed import balanced_tree
from h3lab.parallel.transport import (
    SHM_DIR,
    Bytes,
    Finish,
    Group,
    SharedFrames,
    all_to_all,
    chunk_numels,
    gather_rows,
    pipelined_scatter_all_reduce,
    start_all_to_all,
    start_gather_rows,
)

REDUCE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
WIRE_DTYPES = (*REDUCE_DTYPES, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_NDIM = 10  # shape signatures carry up to 10 dims; the block's tensors have at most 4


@dataclass
class Members:
    """One member's view of a collective: the members in order, its own index among them, and the
    process groups its algorithms run over."""

    members: list[int]
    index: int | None  # this rank's place in `members` (None: not a member, the algorithms never run)
    flat: Group | None  # all members (None for one member)
    intra: Group | None  # this member's node group (hierarchical)
    lane: Group | None  # the members of this member's local index, one per node group (hierarchical)
    nested_size: int | None  # L, the node groups' size of the hierarchical tree; None: that tree is not the flat one
    segment_bytes: int | None  # scatter_tree's pipelined segments, None for one piece
    gather_group: Group | None  # a pipelined all_reduce's second communicator
    shm: SharedFrames | None = None  # the /dev/shm frames of a CPU node group, made at first use


def signatures(m: Members, x: Tensor, transport: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every member, by one small all-gather."""
    if x.dim() > _MAX_NDIM:
        raise ValueError(f"x has {x.dim()} dims; allowed: at most {_MAX_NDIM}")
    sig = torch.full((2 + _MAX_NDIM,), -1, dtype=torch.int64, device=x.device)
    sig[0], sig[1] = WIRE_DTYPES.index(x.dtype), x.dim()
    sig[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    rows = gather_rows(m.flat, sig, transport, Bytes()).cpu().tolist()
    return [(str(WIRE_DTYPES[r[0]]), tuple(r[2 : 2 + r[1]])) for r in rows]


def start_reduce(
    m: Members, x: Tensor, alg: str, moved: Bytes, transport: str, *, scatter: bool, then: Finish
) -> tuple[Callable[[], Tensor], str]:
    """The reduction begun: the first backend call is queued, the returned function finishes it
    (`then` on the reduced values: before the gather where one follows)."""
    P, me = len(m.members), m.index
    done = lambda out: lambda: out  # noqa: E731
    if alg == "identity" or x.numel() == 0:  # nothing to add (numel agrees on all members)
        return done(then(torch.tensor_split(x, P, dim=0)[me].clone() if scatter else x.clone())), "none"
    if alg == "hierarchical":
        out, used = hierarchical(m, x, moved, transport, scatter=scatter)
        return done(then(out)), used
    if alg == "gather_tree":
        gathered = start_gather_rows(m.flat, x, transport, moved)

        def tree() -> Tensor:
            out = balanced_tree(list(gathered().unbind(0))).view(x.shape)
            return then(torch.tensor_split(out, P, dim=0)[me].clone() if scatter else out)

        return tree, transport
    assert alg == "scatter_tree", alg
    if scatter:  # the owner of chunk j (dim-0 rows, tensor_split) receives chunk j of every member
        rows = chunk_numels(x.shape[0], P)
        numels = [r * (x.numel() // x.shape[0]) for r in rows]
        got = start_all_to_all(m.flat, x.reshape(-1), numels, [numels[me]] * P, transport, moved)

        def owner_tree() -> Tensor:
            return then(balanced_tree(list(got().view(P, numels[me]).unbind(0))).view(rows[me], *x.shape[1:]))

        return owner_tree, transport
    seg = segment_numel(m, x)
    if seg:
        group = m.gather_group or m.flat
        return done(pipelined_scatter_all_reduce(m.flat, group, x, seg, transport, moved, then)), transport
    # all_reduce: any chunking of the flat tensor gives the same elementwise tree; equal chunks of
    # c = ceil(numel/P) elements (zero padding) let both steps use even splits
    c = -(-x.numel() // P)
    flat = x.reshape(-1)
    if P * c != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(P * c - flat.numel())])
    got = start_all_to_all(m.flat, flat, [c] * P, [c] * P, transport, moved)

    def finish() -> Tensor:
        mine = then(balanced_tree(list(got().view(P, c).unbind(0))))
        out = gather_rows(m.flat, mine, transport, moved).reshape(-1)[: x.numel()]
        return out.view(x.shape)

    return finish, transport


def segment_numel(m: Members, x: Tensor) -> int:
    """Elements per segment of a pipelined scatter_tree all_reduce, 0 for the plain one: segments
    need `segment_bytes`, a message of at least two segments, and members in group-rank order."""
    if not m.segment_bytes or m.flat is None or not m.flat.identity:
        return 0
    P = len(m.members)
    seg = m.segment_bytes // x.element_size() // P * P
    return seg if seg and x.numel() >= 2 * seg else 0


def hierarchical(m: Members, x: Tensor, moved: Bytes, transport: str, *, scatter: bool) -> tuple[Tensor, str]:
    P, me = len(m.members), m.index
    L = m.nested_size
    G, local_index, group_id = P // L, me % L, me // L
    if L == 1:
        part, intra = x, "none"
    elif x.device.type == "cpu" and SHM_DIR.is_dir():
        if m.shm is None:
            first = m.members[group_id * L]
            m.shm = SharedFrames(m.intra, L, group_id, first)
        part, intra = m.shm.tree(x, moved), f"{SHM_DIR} frames"
    else:
        part = balanced_tree(list(gather_rows(m.intra, x, transport, moved).unbind(0))).view(x.shape)
        intra = transport
    lanes = "none" if G == 1 else transport
    used = f"intra-group: {intra}; lanes: {lanes}"
    if not scatter:
        if G == 1:
            return (part.clone() if L == 1 else part), used
        out = balanced_tree(list(gather_rows(m.lane, part, transport, moved).unbind(0)))
        return out.view(x.shape), used
    rows = chunk_numels(x.shape[0], P)
    row_numel = x.numel() // x.shape[0]
    numels = [r * row_numel for r in rows]
    offsets = [sum(numels[:j]) for j in range(P)]
    flat = part.reshape(-1)
    if G == 1:
        return flat[offsets[me] : offsets[me] + numels[me]].clone().view(rows[me], *x.shape[1:]), used
    # lane member g (member g*L + local_index) owns chunk g*L + local_index of every group partial
    owned = [g * L + local_index for g in range(G)]
    send = torch.cat([flat[offsets[j] : offsets[j] + numels[j]] for j in owned])
    got = all_to_all(m.lane, send, [numels[j] for j in owned], [numels[me]] * G, transport, moved)
    out = balanced_tree(list(got.view(G, numels[me]).unbind(0)))
    return out.view(rows[me], *x.shape[1:]), used


def gather(m: Members, x: Tensor, dim: int, sizes: Sequence[int] | None, moved: Bytes, transport: str):
    P = len(m.members)
    if P == 1:
        return x.clone(), "none"
    if sizes is None:
        sigs = signatures(m, x, transport)
        rest = {(dt, s[:dim] + s[dim + 1 :], len(s)) for dt, s in sigs}
        if len(rest) > 1:
            raise ValueError(
                f"all_gather along dim {dim}: members disagree on dtype or other dims: "
                f"{dict(zip(m.members, sigs, strict=True))}"
            )
        sizes = [s[dim] for _, s in sigs]
    elif len(sizes) != P:
        raise ValueError(f"all_gather: {len(sizes)} sizes given; allowed: one per member ({P})")
    top = max(sizes)
    out_shape = [*x.shape[:dim], sum(sizes), *x.shape[dim + 1 :]]
    if math.prod(out_shape) == 0:  # nothing to move (and gloo refuses empty all-gathers)
        return x.new_empty(out_shape), "none"
    padded = x
    if x.shape[dim] < top:  # gloo's all-gather needs equal sizes: pad to the largest, trim after
        pad_shape = list(x.shape)
        pad_shape[dim] = top - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    rows = gather_rows(m.flat, padded, transport, moved)
    pieces = [rows[j].view(padded.shape).narrow(dim, 0, sizes[j]) for j in range(P)]
    return torch.cat(pieces, dim=dim), transport
