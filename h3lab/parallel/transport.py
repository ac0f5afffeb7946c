"""How the deterministic collectives (h3lab.parallel.collectives) move bytes: a process group in
member order, flat uint8 views on the wire, begun all-gathers and all-to-alls whose finish waits
for the bytes, scatter_tree's segment pipeline, and the node-local /dev/shm frames of the
hierarchical tree. Everything here moves or lays out bytes; the arithmetic is `balanced_tree`'s.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from h3lab.ops.fixed import balanced_tree

Finish = Callable[[Tensor], Tensor]  # an elementwise function of the reduced values (see all_reduce)
SHM_DIR = Path("/dev/shm")
# torch 2.13 renamed all_gather_into_tensor (now a deprecated alias); GPU nodes may bring torch 2.11
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SHM_MIN_CAPACITY = 1 << 20  # frames start at 1 MiB and at least double: 10 re-maps up to 1 GiB


@dataclass
class Bytes:
    """What one call moved, per member: sent and received through the backend, read from peers' frames."""

    sent: int = 0
    received: int = 0
    local: int = 0


@dataclass(frozen=True)
class Group:
    """A process group seen in member order: torch numbers a group's ranks in sorted global order."""

    pg: dist.ProcessGroup
    order: tuple[int, ...]  # order[j]: group rank of the j-th member (member order)
    me: int  # this rank's position in member order

    @classmethod
    def make(cls, ranks: list[int], rank: int) -> Group | None:
        """Every rank of the world calls this for every group, in the same order (dist.new_group)."""
        pg = dist.new_group(ranks)
        if rank not in ranks:
            return None
        return cls(pg, tuple(dist.get_group_rank(pg, q) for q in ranks), ranks.index(rank))

    @property
    def identity(self) -> bool:
        return self.order == tuple(range(len(self.order)))


def transport_of(device: torch.device, group: Group) -> str:
    backend = str(dist.get_backend(group.pg)).lower()
    if device.type == "cuda" and "nccl" in backend:
        return "nccl"
    if "gloo" in backend:
        return "gloo" if device.type == "cpu" else "gloo (staged through CPU)"
    allowed = "cpu/cuda tensors on gloo, cuda tensors on nccl"
    raise ValueError(f"no transport for {device.type} tensors on backend {backend!r}; allowed: {allowed}")


def wire_bytes(t: Tensor, transport: str) -> Tensor:
    """Flat contiguous uint8 bytes where the backend can move them (CPU for gloo)."""
    t = t.reshape(-1).contiguous()
    if transport != "nccl":
        t = t.cpu()
    return t.view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def gather_rows(group: Group, flat: Tensor, transport: str, moved: Bytes) -> Tensor:
    """All-gather one flat tensor per member: [n, numel] on `flat`'s device, member order."""
    return start_gather_rows(group, flat, transport, moved)()


def start_gather_rows(group: Group, flat: Tensor, transport: str, moved: Bytes) -> Callable[[], Tensor]:
    """`gather_rows` begun: the backend moves the bytes while the caller queues other work; the
    returned function waits for them (on NCCL the current stream waits, the host does not)."""
    n = len(group.order)
    wire = wire_bytes(flat, transport)
    out = wire.new_empty(n * wire.numel())
    work = all_gather_single(out, wire, group=group.pg, async_op=True)
    moved.sent += (n - 1) * wire.numel()
    moved.received += (n - 1) * wire.numel()

    def finish() -> Tensor:
        work.wait()
        rows = out.view(flat.dtype).view(n, flat.numel())
        if not group.identity:
            rows = rows[list(group.order)]
        return rows.to(flat.device)

    return finish


def all_to_all(
    group: Group, flat: Tensor, in_numels: list[int], out_numels: list[int], transport: str, moved: Bytes
) -> Tensor:
    """Member j receives `flat`'s j-th piece (sizes `in_numels`, member order); returns what this member
    received from members 0..n-1 (sizes `out_numels`), concatenated in member order."""
    return start_all_to_all(group, flat, in_numels, out_numels, transport, moved)()


def start_all_to_all(
    group: Group, flat: Tensor, in_numels: list[int], out_numels: list[int], transport: str, moved: Bytes
) -> Callable[[], Tensor]:
    """`all_to_all` begun; the returned function waits for the bytes (see `start_gather_rows`)."""
    item, me = flat.element_size(), group.me
    by_grank = sorted(range(len(group.order)), key=lambda j: group.order[j])  # member positions, group-rank order
    if not group.identity:
        pieces = torch.split(flat, in_numels)
        flat = torch.cat([pieces[j] for j in by_grank]) if flat.numel() else flat
    wire = wire_bytes(flat, transport)
    out = wire.new_empty(sum(out_numels) * item)
    work = dist.all_to_all_single(
        out,
        wire,
        output_split_sizes=[out_numels[j] * item for j in by_grank],
        input_split_sizes=[in_numels[j] * item for j in by_grank],
        group=group.pg,
        async_op=True,
    )
    moved.sent += (sum(in_numels) - in_numels[me]) * item
    moved.received += (sum(out_numels) - out_numels[me]) * item

    def finish() -> Tensor:
        work.wait()
        got = (out.view(flat.dtype) if out.numel() else flat.new_empty(0)).to(flat.device)
        if not group.identity and got.numel():
            pieces = dict(zip(by_grank, torch.split(got, [out_numels[j] for j in by_grank]), strict=True))
            got = torch.cat([pieces[j] for j in range(len(group.order))])
        return got

    return finish


def chunk_numels(numel: int, parts: int) -> list[int]:
    """Element counts of `torch.tensor_split(x, parts)` pieces: the first numel % parts get one more."""
    return [numel // parts + (j < numel % parts) for j in range(parts)]


def pipelined_scatter_all_reduce(
    group: Group, gather_group: Group, x: Tensor, seg: int, transport: str, moved: Bytes, then: Finish
) -> Tensor:
    """scatter_tree's all_reduce over consecutive segments of `seg` elements (a multiple of P) of the
    flat tensor, each reduced as the plain algorithm reduces a whole tensor (owner j adds chunk j of
    the segment): the same elementwise tree, so the same bits. Segment k+1's all-to-all is queued
    before segment k's tree; the gathers go through `gather_group` (a second communicator of the
    same members, in the same order), so a segment's gather, the next one's tree and the one after's
    all-to-all can run at once; a full segment is gathered straight into the output. `then` runs on
    each owner's chunk before its gather. Members must be in group-rank order."""
    P = len(group.order)
    flat = x.reshape(-1)
    N = flat.numel()
    bounds = [(lo, min(lo + seg, N)) for lo in range(0, N, seg)]
    outs: list[Tensor] = []  # allocated at the first gather, in the dtype `then` gives
    direct = transport in ("nccl", "gloo")  # the backend writes into `out` itself (no staging copy)

    def scatter(k: int) -> tuple[Callable[[], Tensor], int]:
        lo, hi = bounds[k]
        c = -(-(hi - lo) // P)
        piece = flat[lo:hi]
        if P * c != hi - lo:  # only a last, short segment is padded
            piece = torch.cat([piece, piece.new_zeros(P * c - (hi - lo))])
        return start_all_to_all(group, piece, [c] * P, [c] * P, transport, moved), c

    def gather(k: int, mine: Tensor) -> Callable[[], None]:
        lo, hi = bounds[k]
        if not outs:
            outs.append(flat.new_empty(N, dtype=mine.dtype))
        out = outs[0]
        if direct and mine.numel() * P == hi - lo:
            work = all_gather_single(
                wire_bytes(out[lo:hi], transport), wire_bytes(mine, transport), group=gather_group.pg, async_op=True
            )
            moved.sent += (P - 1) * mine.numel() * mine.element_size()
            moved.received += (P - 1) * mine.numel() * mine.element_size()
            return work.wait
        gathered = start_gather_rows(gather_group, mine, transport, moved)
        return lambda: out[lo:hi].copy_(gathered().reshape(-1)[: hi - lo])

    waits: list[Callable[[], object]] = []
    pending = scatter(0)
    for k in range(len(bounds)):
        got, c = pending
        if k + 1 < len(bounds):
            pending = scatter(k + 1)
        waits.append(gather(k, then(balanced_tree(list(got().view(P, c).unbind(0))))))
    for wait in waits:
        wait()
    return outs[0].view(x.shape)


class SharedFrames:
    """Double-buffered per-member frames in /dev/shm for one node group (the node-local IPC path).

    Call k writes frame k % 2, then one barrier, then every member reads all L frames. A member
    writing call k+2 into the same frame has passed call k+1's barrier, which every member reached
    only after its call-k reads: two frames need one barrier per call, not two.
    Files are unlinked once every member has mapped them, so a killed process leaks nothing.
    """

    def __init__(self, group: Group, local_size: int, group_id: int, first_rank: int) -> None:
        self.group, self.me, self.L, self.group_id = group.pg, group.me, local_size, group_id
        token = [uuid.uuid4().hex]  # one name for the group, from its first member
        dist.broadcast_object_list(token, src=first_rank, group=self.group)
        self.token, self.generation, self.capacity, self.calls = token[0], 0, 0, 0
        self.frames: list[Tensor] = []

    def _path(self, member: int) -> Path:
        return SHM_DIR / f"h3lab-{self.token}-g{self.group_id}-v{self.generation}-m{member}"

    def _map(self, capacity: int) -> None:
        self.generation += 1
        self.frames = []
        own = self._path(self.me)
        need = self.L * 2 * capacity  # every member's frames of this group, on this host
        try:  # the file is sparse until written; a full tmpfs would SIGBUS the first write, so check first
            own_frames = torch.from_file(str(own), shared=True, size=2 * capacity, dtype=torch.uint8)
            dist.barrier(group=self.group)
            missing = sum(not self._path(m).exists() for m in range(self.L))
            stat = os.statvfs(SHM_DIR)
            short = stat.f_bavail * stat.f_frsize < need
            flags = torch.tensor([missing, short], dtype=torch.uint8)
            seen = torch.empty(2 * self.L, dtype=torch.uint8)
            all_gather_single(seen, flags, group=self.group)  # every member sees every verdict: all raise
            missing_by, short_by = seen.view(self.L, 2).t().tolist()
            if any(missing_by):
                raise ValueError(
                    f"node group {self.group_id}: members cannot see each other's {SHM_DIR} frames (missing per "
                    f"member: {missing_by}); allowed: local_size grouping processes of one host"
                )
            if any(short_by):
                raise ValueError(
                    f"node group {self.group_id}: {SHM_DIR} lacks {need} B free for {self.L} x 2 frames of "
                    f"{capacity} B (short on members {short_by}); enlarge it (docker --shm-size) or use CUDA tensors"
                )
            peers = {
                m: torch.from_file(str(self._path(m)), shared=True, size=2 * capacity, dtype=torch.uint8)
                for m in range(self.L)
                if m != self.me
            }
            dist.barrier(group=self.group)  # everyone mapped everything: the names can go
        finally:
            own.unlink(missing_ok=True)
        peers[self.me] = own_frames
        self.frames = [peers[m].view(2, capacity) for m in range(self.L)]
        self.capacity = capacity

    def tree(self, x: Tensor, moved: Bytes) -> Tensor:
        """balanced_tree over the L members' `x` (same shape and dtype on every member)."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.capacity:  # every member sees the same nbytes, so all re-map together
            self._map(-(-max(nbytes, 2 * self.capacity, SHM_MIN_CAPACITY) // 64) * 64)
        frame = self.calls % 2
        self.calls += 1
        self.frames[self.me][frame, :nbytes].copy_(wire_bytes(x, "gloo"))
        dist.barrier(group=self.group)
        parts = [self.frames[m][frame, :nbytes].view(x.dtype).view(x.shape) for m in range(self.L)]
        moved.local += (self.L - 1) * nbytes
        return balanced_tree(parts)

    def close(self) -> None:
        self.frames = []  # the mappings go with the last reference
