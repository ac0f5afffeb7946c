"""Deterministic collectives over torch.distributed: the backend only moves bytes, the arithmetic is ours.

Every reduction over the P members of a group is `balanced_tree` over the members' tensors in member
order, evaluated by h3lab on the tensor's device. The input dtype is the accumulation dtype (callers
pass FP32 partials). For P = 2/4/8 this is the contract's tree, so TP ranks handing in subtree roots
get the single-process 8-unit result bit for bit. The backend (gloo, NCCL) only ever sees uint8
views: all-gathers and all-to-alls, never a backend sum. All algorithms evaluate the same tree, so
which one runs (even a size-dependent choice) cannot change a bit; it only changes bytes and time.

Algorithms for all_reduce, per member, S = bytes of one member's partial:
- gather_tree: all-gather every partial, add the tree locally; (P-1)*S received.
- scatter_tree: all-to-all of P chunks of the flattened tensor (owner j gets all P partials of chunk
  j), the owner adds them, then an all-gather of the reduced chunks; 2(P-1)/P*S received, a ring
  all-reduce's volume (chunks padded to ceil(numel/P) elements: at most 2(P-1) elements more).
- hierarchical: G = P/L node groups of L consecutive members; the tree over the L local partials
  (CPU: through /dev/shm frames, no backend; CUDA: a process-group all-gather), then an all-gather
  of the G group partials along "lanes" (members with the same local index), then the tree over
  the G partials. Allowed only where that nested tree is the flat tree: G a power of two (or L = 1),
  so 2x4 gives ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)) and 2x3 ((r0+r1)+r2)+((r3+r4)+r5); 3x2 is refused.
Metadata exchanges (shape signatures, sizes for all_gather) are not counted in the byte figures.

`start_all_reduce` / `start_reduce_scatter` queue the first backend call and return the rest (the
wait, the tree, scatter_tree's gather): a caller overlaps the transfer with work that does not need
it. With `segment_bytes`, scatter_tree's all_reduce of a large message runs as a pipeline of
segments, each one the whole algorithm on its elements, so the owner's adds of one segment overlap
the next one's all-to-all. `then` (all_reduce, reduce_scatter) finishes the reduced values with the
caller's elementwise function (its rounding) before they are shared: with scatter_tree each owner
rounds its chunk and the members gather the rounded chunks, half the bytes of an FP32 gather for a
bf16 result. None of these changes which adds run in which order: the bits are the same.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from h3lab.ops.fixed import balanced_tree
from h3lab.parallel.algorithms import (
    ALGORITHMS,
    CollectiveDecision,
    choose_algorithm,
    hierarchical_local_sizes,
    hierarchical_tree_string,
    tree_string,
)
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
    transport_of,
)

REDUCE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_WIRE_DTYPES = (*REDUCE_DTYPES, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_NDIM = 10  # shape signatures carry up to 10 dims; the block's tensors have at most 4


def _keep(t: Tensor) -> Tensor:
    return t


@dataclass
class _SiteStats:
    decision: CollectiveDecision
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    seconds: float = 0.0
    algorithms: Counter = field(default_factory=Counter)


class DeterministicCollective:
    """all_reduce / reduce_scatter / all_gather over a fixed member list, with one tree (see module doc)."""

    def __init__(
        self,
        *,
        members: list[int],
        rank: int,
        algorithm: str,
        local_size: int | None,
        hierarchical: bool,
        device: torch.device | None,
        flat_group,
        intra_group,
        lane_group,
        segment_bytes: int | None = None,
        gather_group: Group | None = None,
    ) -> None:
        self.members, self.rank, self.algorithm = list(members), rank, algorithm
        self.segment_bytes, self._gather_group = segment_bytes, gather_group
        self.local_size, self.device = local_size, device
        self.index = self.members.index(rank) if rank in self.members else None
        self._hier_L = local_size if hierarchical else None  # None: the hierarchical tree is not allowed
        self._flat, self._intra, self._lane = flat_group, intra_group, lane_group
        self._shm: SharedFrames | None = None
        self._sites: dict[tuple[str, str], _SiteStats] = {}
        self._total = Bytes()
        self._closed = False
        P, L = len(members), local_size or len(members)
        self.tree = tree_string([f"r{q}" for q in members])
        self.group = {
            "ranks": list(members),
            "groups": [list(members[i : i + L]) for i in range(0, P, L)],
            "local_size": local_size,
        }

    # ---- public ops ---------------------------------------------------------------------------

    def all_reduce(self, x: Tensor, site: str, *, then: Finish | None = None) -> Tensor:
        """Every member gets balanced_tree([x_member0, ..., x_member{P-1}]) (a new tensor).

        `then`: an elementwise function of the reduced values (the consumer's rounding, say): every
        member gets then(tree); scatter_tree applies it to the owner's chunk before the gather, so
        a narrowing `then` shrinks the gather. It must give each element's bits from that element
        alone (any shape, any chunk)."""
        return self._run("all_reduce", site, x, then=then)

    def reduce_scatter(self, x: Tensor, site: str, *, then: Finish | None = None) -> Tensor:
        """This member's dim-0 chunk (torch.tensor_split into P, member order) of all_reduce(x)
        (then(chunk) with `then`, see `all_reduce`)."""
        if x.dim() < 1:
            raise ValueError(f"reduce_scatter at {site!r}: x has 0 dims; allowed: dim 0 to split over members")
        return self._run("reduce_scatter", site, x, then=then)

    def start_all_reduce(self, x: Tensor, site: str, *, then: Finish | None = None) -> Callable[[], Tensor]:
        """`all_reduce` begun now and finished by the returned function (call it once).

        The backend moves the bytes while the caller queues other work (on NCCL the host does not
        wait; the finish makes the current stream wait); the tree's adds run in the finish, so the
        result is `all_reduce`'s bit for bit. Every member starts and finishes its calls of this
        collective in the same order.
        """
        return self._run("all_reduce", site, x, start=True, then=then)

    def start_reduce_scatter(self, x: Tensor, site: str, *, then: Finish | None = None) -> Callable[[], Tensor]:
        """`reduce_scatter` begun now and finished by the returned function (see `start_all_reduce`)."""
        if x.dim() < 1:
            raise ValueError(f"reduce_scatter at {site!r}: x has 0 dims; allowed: dim 0 to split over members")
        return self._run("reduce_scatter", site, x, start=True, then=then)

    def all_gather(self, x: Tensor, site: str, dim: int = 0, sizes: Sequence[int] | None = None) -> Tensor:
        """Members' tensors concatenated along `dim` in member order (a copy; sizes along `dim` may differ).

        `sizes` (members' sizes along `dim`), when the caller knows them, skips the size exchange.
        """
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"all_gather at {site!r}: dim {dim}; allowed: -{x.dim()}..{x.dim() - 1} for {x.dim()}-d x")
        return self._run("all_gather", site, x, dim=dim % x.dim(), sizes=sizes)

    @property
    def shared_memory_token(self) -> str | None:
        """The name token of this member's /dev/shm frames (files h3lab-<token>-*), None if none were made."""
        return self._shm.token if self._shm is not None else None

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The torch process group of all members (None for one member): for callers that time or
        synchronise around this collective's calls on the same communicator."""
        return self._flat.pg if self._flat is not None else None

    def bytes_total(self) -> tuple[int, int, int]:
        """(sent, received, local) bytes of every call so far, as the decision records count them."""
        return self._total.sent, self._total.received, self._total.local

    def decisions(self) -> list[dict]:
        """One dict per (op, site), first-call order: the decision plus call count, total bytes, seconds."""
        rows = []
        for stats in self._sites.values():
            row = stats.decision.to_dict()
            row.update(
                calls=stats.calls,
                bytes_sent_total=stats.bytes_sent,
                bytes_received_total=stats.bytes_received,
                bytes_local_total=stats.bytes_local,
                seconds_total=stats.seconds,
                algorithms=dict(stats.algorithms),
            )
            rows.append(row)
        return rows

    def close(self) -> None:
        """Release the shared-memory frames; the collective is unusable afterwards."""
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self._closed = True

    # ---- dispatch and records -----------------------------------------------------------------

    def _run(
        self,
        op: str,
        site: str,
        x: Tensor,
        *,
        dim: int = 0,
        sizes: Sequence[int] | None = None,
        start: bool = False,
        then: Finish | None = None,
    ) -> Tensor | Callable[[], Tensor]:
        self._check_usable(x, op, site)
        began = time.perf_counter()
        transport = transport_of(x.device, self._flat) if self._flat is not None else "none"
        key = (op, site)
        first = key not in self._sites
        if first and op != "all_gather" and len(self.members) > 1:
            self._check_signatures(x, op, site, transport)
        nbytes = x.numel() * x.element_size()
        hier_L = self._hier_L if self._hier_L is not None and self.algorithm in ("auto", "hierarchical") else None
        alg, reason = choose_algorithm(
            op,
            self.algorithm,
            nbytes=nbytes,
            num_members=len(self.members),
            local_size=hier_L,
            transport=transport,
            then=then is not None,
        )
        moved = Bytes()
        if op == "all_gather":
            out, used_transport = self._gather(x, dim, sizes, moved, transport)
            finish = lambda: out  # noqa: E731
        else:
            finish, used_transport = self._start_reduce(
                x, alg, moved, transport, scatter=op == "reduce_scatter", then=then or _keep
            )
        started = time.perf_counter() - began

        def timed_finish() -> Tensor:  # the records count the finish's bytes too (scatter_tree's gather)
            t = time.perf_counter()
            out = finish()
            stats = self._sites.get(key)
            if stats is None:
                decision = CollectiveDecision(
                    site=site,
                    op=op,
                    algorithm=alg,
                    reason=reason,
                    tree="copy" if op == "all_gather" else self.tree,
                    group=self.group,
                    dtype=str(x.dtype),
                    numel=x.numel(),
                    bytes_sent=moved.sent,
                    bytes_received=moved.received,
                    transport=used_transport,
                    bytes_local=moved.local,
                )
                stats = self._sites[key] = _SiteStats(decision)
            stats.calls += 1
            stats.bytes_sent += moved.sent
            stats.bytes_received += moved.received
            stats.bytes_local += moved.local
            stats.algorithms[alg] += 1
            self._total.sent += moved.sent
            self._total.received += moved.received
            self._total.local += moved.local
            stats.seconds += started + time.perf_counter() - t
            return out

        return timed_finish if start else timed_finish()

    def _check_usable(self, x: Tensor, op: str, site: str) -> None:
        if self._closed:
            raise ValueError(f"{op} at {site!r}: collective over ranks {self.members} is closed")
        if self.index is None:
            raise ValueError(f"{op} at {site!r}: rank {self.rank} is not a member; allowed ranks: {self.members}")
        if self.device is not None and x.device.type != self.device.type:
            raise ValueError(f"{op} at {site!r}: x on {x.device}; allowed: {self.device} (the collective's device)")
        allowed = _WIRE_DTYPES if op == "all_gather" else REDUCE_DTYPES
        if x.dtype not in allowed:
            raise ValueError(f"{op} at {site!r}: dtype {x.dtype}; allowed: {list(allowed)}")

    def _signatures(self, x: Tensor, transport: str) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype, shape) of every member, by one small all-gather."""
        if x.dim() > _MAX_NDIM:
            raise ValueError(f"x has {x.dim()} dims; allowed: at most {_MAX_NDIM}")
        sig = torch.full((2 + _MAX_NDIM,), -1, dtype=torch.int64, device=x.device)
        sig[0], sig[1] = _WIRE_DTYPES.index(x.dtype), x.dim()
        sig[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        rows = gather_rows(self._flat, sig, transport, Bytes()).cpu().tolist()
        return [(str(_WIRE_DTYPES[r[0]]), tuple(r[2 : 2 + r[1]])) for r in rows]

    def _check_signatures(self, x: Tensor, op: str, site: str, transport: str) -> None:
        sigs = self._signatures(x, transport)
        if len(set(sigs)) > 1:  # every member sees the same list, so every member raises
            by_rank = dict(zip(self.members, sigs, strict=True))
            raise ValueError(f"{op} at {site!r}: members disagree on (dtype, shape): {by_rank}")

    # ---- algorithms ---------------------------------------------------------------------------

    def _start_reduce(
        self, x: Tensor, alg: str, moved: Bytes, transport: str, *, scatter: bool, then: Finish
    ) -> tuple[Callable[[], Tensor], str]:
        """The reduction begun: the first backend call is queued, the returned function finishes it
        (`then` on the reduced values: before the gather where one follows)."""
        P, me = len(self.members), self.index
        done = lambda out: lambda: out  # noqa: E731
        if alg == "identity" or x.numel() == 0:  # nothing to add (numel agrees on all members)
            return done(then(torch.tensor_split(x, P, dim=0)[me].clone() if scatter else x.clone())), "none"
        if alg == "hierarchical":
            out, used = self._hierarchical(x, moved, transport, scatter=scatter)
            return done(then(out)), used
        if alg == "gather_tree":
            gathered = start_gather_rows(self._flat, x, transport, moved)

            def tree() -> Tensor:
                out = balanced_tree(list(gathered().unbind(0))).view(x.shape)
                return then(torch.tensor_split(out, P, dim=0)[me].clone() if scatter else out)

            return tree, transport
        assert alg == "scatter_tree", alg
        if scatter:  # the owner of chunk j (dim-0 rows, tensor_split) receives chunk j of every member
            rows = chunk_numels(x.shape[0], P)
            numels = [r * (x.numel() // x.shape[0]) for r in rows]
            got = start_all_to_all(self._flat, x.reshape(-1), numels, [numels[me]] * P, transport, moved)

            def owner_tree() -> Tensor:
                return then(balanced_tree(list(got().view(P, numels[me]).unbind(0))).view(rows[me], *x.shape[1:]))

            return owner_tree, transport
        seg = self._segment_numel(x)
        if seg:
            group = self._gather_group or self._flat
            return done(pipelined_scatter_all_reduce(self._flat, group, x, seg, transport, moved, then)), transport
        # all_reduce: any chunking of the flat tensor gives the same elementwise tree; equal chunks of
        # c = ceil(numel/P) elements (zero padding) let both steps use even splits
        c = -(-x.numel() // P)
        flat = x.reshape(-1)
        if P * c != flat.numel():
            flat = torch.cat([flat, flat.new_zeros(P * c - flat.numel())])
        got = start_all_to_all(self._flat, flat, [c] * P, [c] * P, transport, moved)

        def finish() -> Tensor:
            mine = then(balanced_tree(list(got().view(P, c).unbind(0))))
            out = gather_rows(self._flat, mine, transport, moved).reshape(-1)[: x.numel()]
            return out.view(x.shape)

        return finish, transport

    def _segment_numel(self, x: Tensor) -> int:
        """Elements per segment of a pipelined scatter_tree all_reduce, 0 for the plain one: segments
        need `segment_bytes`, a message of at least two segments, and members in group-rank order."""
        if not self.segment_bytes or self._flat is None or not self._flat.identity:
            return 0
        P = len(self.members)
        seg = self.segment_bytes // x.element_size() // P * P
        return seg if seg and x.numel() >= 2 * seg else 0

    def _hierarchical(self, x: Tensor, moved: Bytes, transport: str, *, scatter: bool) -> tuple[Tensor, str]:
        P, me = len(self.members), self.index
        L = self._hier_L
        G, local_index, group_id = P // L, me % L, me // L
        if L == 1:
            part, intra = x, "none"
        elif x.device.type == "cpu" and SHM_DIR.is_dir():
            if self._shm is None:
                first = self.members[group_id * L]
                self._shm = SharedFrames(self._intra, L, group_id, first)
            part, intra = self._shm.tree(x, moved), f"{SHM_DIR} frames"
        else:
            part = balanced_tree(list(gather_rows(self._intra, x, transport, moved).unbind(0))).view(x.shape)
            intra = transport
        lanes = "none" if G == 1 else transport
        used = f"intra-group: {intra}; lanes: {lanes}"
        if not scatter:
            if G == 1:
                return (part.clone() if L == 1 else part), used
            out = balanced_tree(list(gather_rows(self._lane, part, transport, moved).unbind(0)))
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
        got = all_to_all(self._lane, send, [numels[j] for j in owned], [numels[me]] * G, transport, moved)
        out = balanced_tree(list(got.view(G, numels[me]).unbind(0)))
        return out.view(rows[me], *x.shape[1:]), used

    def _gather(self, x: Tensor, dim: int, sizes: Sequence[int] | None, moved: Bytes, transport: str):
        P = len(self.members)
        if P == 1:
            return x.clone(), "none"
        if sizes is None:
            sigs = self._signatures(x, transport)
            rest = {(dt, s[:dim] + s[dim + 1 :], len(s)) for dt, s in sigs}
            if len(rest) > 1:
                raise ValueError(
                    f"all_gather along dim {dim}: members disagree on dtype or other dims: "
                    f"{dict(zip(self.members, sigs, strict=True))}"
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
        rows = gather_rows(self._flat, padded, transport, moved)
        pieces = [rows[j].view(padded.shape).narrow(dim, 0, sizes[j]) for j in range(P)]
        return torch.cat(pieces, dim=dim), transport


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
    messages of at least two segments (the same bits, see `pipelined_scatter_all_reduce`).

    Raises:
        ValueError: unknown algorithm, bad ranks, a local size that does not divide the members or
            (for "hierarchical") whose nested tree differs from the flat balanced tree.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} not allowed; allowed: {list(ALGORITHMS)}")
    if segment_bytes is not None and segment_bytes < 1:
        raise ValueError(f"segment_bytes {segment_bytes}; allowed: None or a positive byte count")
    P = len(ranks)
    if P == 0 or len(set(ranks)) != P:
        raise ValueError(f"ranks {ranks}: need at least one rank, each once")
    if local_size is not None and (local_size < 1 or P % local_size):
        divisors = [d for d in range(1, P + 1) if P % d == 0]
        raise ValueError(f"local_size {local_size} does not split {P} members into equal groups; allowed: {divisors}")
    labels = [f"r{q}" for q in ranks]
    nested_ok = local_size is not None and local_size in hierarchical_local_sizes(P)
    if algorithm == "hierarchical" and not nested_ok:
        if local_size is None:
            raise ValueError("algorithm 'hierarchical' needs local_size; allowed: a divisor of the member count")
        raise ValueError(
            f"local_size {local_size} with {P} members: nested tree {hierarchical_tree_string(labels, local_size)} "
            f"!= flat {tree_string(labels)}; allowed: {hierarchical_local_sizes(P)} (power-of-two group count, or 1)"
        )
    if not dist.is_initialized():
        raise ValueError("new_collective needs torch.distributed initialised (init_process_group)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if any(not 0 <= q < world for q in ranks):
        raise ValueError(f"ranks {ranks}: allowed: 0..{world - 1} (world size {world})")
    flat = Group.make(ranks, rank) if P > 1 else None
    intra = lane = None
    if nested_ok and algorithm in ("auto", "hierarchical") and P > 1:
        L, G = local_size, P // local_size
        intra, lane = flat if G == 1 else None, flat if L == 1 else None
        if 1 < L < P:  # every rank creates every group, in the same order
            for g in range(G):
                intra = Group.make(ranks[g * L : (g + 1) * L], rank) or intra
            for lane_index in range(L):
                lane = Group.make(ranks[lane_index::L], rank) or lane
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
