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

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from h3lab.parallel.algorithms import CollectiveDecision, choose_algorithm, tree_string
from h3lab.parallel.reduction import REDUCE_DTYPES, WIRE_DTYPES, Members, gather, signatures, start_reduce
from h3lab.parallel.transport import Bytes, Finish, Group, transport_of


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
        self.segment_bytes, self.local_size, self.device = segment_bytes, local_size, device
        self.index = self.members.index(rank) if rank in self.members else None
        self._m = Members(
            members=self.members,
            index=self.index,
            flat=flat_group,
            intra=intra_group,
            lane=lane_group,
            nested_size=local_size if hierarchical else None,  # None: the hierarchical tree is not allowed
            segment_bytes=segment_bytes,
            gather_group=gather_group,
        )
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
            raise ValueError(
                f"reduce_scatter at {site!r}: x has 0 dims; allowed: >= 1 dims (dim 0 splits over members)"
            )
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
            raise ValueError(
                f"reduce_scatter at {site!r}: x has 0 dims; allowed: >= 1 dims (dim 0 splits over members)"
            )
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
        return self._m.shm.token if self._m.shm is not None else None

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The torch process group of all members (None for one member): for callers that time or
        synchronise around this collective's calls on the same communicator."""
        return self._m.flat.pg if self._m.flat is not None else None

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
        if self._m.shm is not None:
            self._m.shm.close()
            self._m.shm = None
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
        """One call of `op`: the first backend call is queued now; the finish (run now, or returned with
        `start`) completes it and records the call at its site."""
        self._check_usable(x, op, site)
        began = time.perf_counter()
        transport = transport_of(x.device, self._m.flat) if self._m.flat is not None else "none"
        key = (op, site)
        first = key not in self._sites
        if first and op != "all_gather" and len(self.members) > 1:
            self._check_signatures(x, op, site, transport)
        alg, reason = self._choose(op, x, transport, then)
        moved = Bytes()
        finish, used_transport = self._begin(op, x, alg, moved, transport, dim, sizes, then)
        started = time.perf_counter() - began

        def timed_finish() -> Tensor:  # the records count the finish's bytes too (scatter_tree's gather)
            t = time.perf_counter()
            out = finish()
            self._record(key, alg, reason, x, moved, used_transport, started, t)
            return out

        return timed_finish if start else timed_finish()

    def _choose(self, op: str, x: Tensor, transport: str, then: Finish | None) -> tuple[str, str]:
        """(algorithm, reason) for this call; the hierarchical tree is offered only where it is allowed
        and the collective asked for it (auto or hierarchical)."""
        nbytes = x.numel() * x.element_size()
        hier_L = self._m.nested_size if self.algorithm in ("auto", "hierarchical") else None
        return choose_algorithm(
            op,
            self.algorithm,
            nbytes=nbytes,
            num_members=len(self.members),
            local_size=hier_L,
            transport=transport,
            then=then is not None,
        )

    def _begin(
        self,
        op: str,
        x: Tensor,
        alg: str,
        moved: Bytes,
        transport: str,
        dim: int,
        sizes: Sequence[int] | None,
        then: Finish | None,
    ) -> tuple[Callable[[], Tensor], str]:
        """(finish, transport used) of the call begun: a reduction's first backend call is queued;
        all_gather completes here and its finish returns the copy."""
        if op == "all_gather":
            out, used_transport = gather(self._m, x, dim, sizes, moved, transport)
            finish = lambda: out  # noqa: E731
        else:
            finish, used_transport = start_reduce(
                self._m, x, alg, moved, transport, scatter=op == "reduce_scatter", then=then or _keep
            )
        return finish, used_transport

    def _record(
        self,
        key: tuple[str, str],
        alg: str,
        reason: str,
        x: Tensor,
        moved: Bytes,
        used_transport: str,
        started: float,
        t: float,
    ) -> None:
        """Count one finished call at its site and in the totals (the site's first finish records its
        decision); its seconds are the start's plus the finish's since `t`."""
        stats = self._sites.get(key)
        if stats is None:
            stats = self._sites[key] = _SiteStats(self._decision(key, alg, reason, x, moved, used_transport))
        stats.calls += 1
        stats.bytes_sent += moved.sent
        stats.bytes_received += moved.received
        stats.bytes_local += moved.local
        stats.algorithms[alg] += 1
        self._total.sent += moved.sent
        self._total.received += moved.received
        self._total.local += moved.local
        stats.seconds += started + time.perf_counter() - t

    def _decision(
        self, key: tuple[str, str], alg: str, reason: str, x: Tensor, moved: Bytes, used_transport: str
    ) -> CollectiveDecision:
        """The decision record of site `key` = (op, site), from its first finished call."""
        op, site = key
        return CollectiveDecision(
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

    def _check_usable(self, x: Tensor, op: str, site: str) -> None:
        if self._closed:
            raise ValueError(
                f"{op} at {site!r}: collective over ranks {self.members} is closed; allowed: calls before close()"
            )
        if self.index is None:
            raise ValueError(f"{op} at {site!r}: rank {self.rank} is not a member; allowed ranks: {self.members}")
        if self.device is not None and x.device.type != self.device.type:
            raise ValueError(f"{op} at {site!r}: x on {x.device}; allowed: {self.device} (the collective's device)")
        allowed = WIRE_DTYPES if op == "all_gather" else REDUCE_DTYPES
        if x.dtype not in allowed:
            raise ValueError(f"{op} at {site!r}: dtype {x.dtype}; allowed: {list(allowed)}")

    def _check_signatures(self, x: Tensor, op: str, site: str, transport: str) -> None:
        sigs = signatures(self._m, x, transport)
        if len(set(sigs)) > 1:  # every member sees the same list, so every member raises
            by_rank = dict(zip(self.members, sigs, strict=True))
            raise ValueError(
                f"{op} at {site!r}: members disagree on (dtype, shape): {by_rank}; allowed: one on every member"
            )
