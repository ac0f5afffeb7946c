"""`DistComm`: a layout's implementation of the block's `BlockComm` seam over torch.distributed.

Deterministic mode: every reduction goes through h3lab.parallel.collectives (the backend moves bytes, the
balanced tree adds them), so a TP rank's unit subtree root is finished exactly as the 8-unit
tree would. Baseline mode (`BaselineComm`): what people run today — `all_reduce(SUM)` of the
bf16 partial, whatever order the backend picks; gathers are copies in both.

`build_comm` must be called by every rank in the same order: it creates all process groups
(h3lab.parallel.procgroups, from `Layout.groups()`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from h3lab.parallel.assemble import units_of
from h3lab.parallel.collective_groups import new_collective
from h3lab.parallel.collectives import DeterministicCollective
from h3lab.parallel.layout import Layout
from h3lab.parallel.procgroups import new_groups
from h3lab.parallel.transport import Finish


def _no_call(site: str) -> None:
    pass


class DistComm:
    """Deterministic collectives for one rank of `layout` (TP group, CP group).

    `on_call(site)` runs before every call that moves bytes, on the calling thread, with the call's
    site: the run's status file (h3lab.run.progress), a test's fault. It sees no tensor, so it
    cannot change a bit; every rank makes the same calls in the same order.
    """

    def __init__(
        self,
        layout: Layout,
        rank: int,
        tp: DeterministicCollective | None,
        cp: DeterministicCollective | None,
        on_call: Callable[[str], None] | None = None,
    ) -> None:
        self.layout, self.rank, self.tp, self.cp = layout, rank, tp, cp
        self.on_call = on_call if on_call is not None else _no_call
        self.units = units_of(layout, rank)
        self.seconds = 0.0

    def _timed(self, site: str, fn: Callable[[], Any]) -> Any:
        self.on_call(site)
        t = time.perf_counter()
        out = fn()
        self.seconds += time.perf_counter() - t
        return out

    def reduce_units(
        self, root: Tensor, site: str, *, scatter_rows: bool = False, then: Finish | None = None
    ) -> Tensor:
        if self.tp is None:
            return then(root) if then is not None else root
        if scatter_rows and self.layout.sp:
            return self._timed(site, lambda: self.tp.reduce_scatter(root, site, then=then))
        return self._timed(site, lambda: self.tp.all_reduce(root, site, then=then))

    def start_reduce_units(
        self, root: Tensor, site: str, *, scatter_rows: bool = False, then: Finish | None = None
    ) -> Callable[[], Tensor]:
        """`reduce_units` begun: the bytes move while the caller queues independent work; the returned
        function finishes the tree (the same bits). Every rank starts and finishes in one order."""
        if self.tp is None:
            out = then(root) if then is not None else root
            return lambda: out
        tp = self.tp
        if scatter_rows and self.layout.sp:
            finish = self._timed(site, lambda: tp.start_reduce_scatter(root, site, then=then))
        else:
            finish = self._timed(site, lambda: tp.start_all_reduce(root, site, then=then))
        return lambda: self._timed_finish(finish)

    def _timed_finish(self, finish: Callable[[], Tensor]) -> Tensor:
        t = time.perf_counter()
        out = finish()
        self.seconds += time.perf_counter() - t
        return out

    def gather_units(self, part: Tensor, site: str, *, dim: int) -> Tensor:
        if self.tp is None:
            return part
        return self._timed(site, lambda: self.tp.all_gather(part, site, dim=dim, sizes=_equal(self.tp, part, dim)))

    def gather_tp_rows(self, x: Tensor, site: str) -> Tensor:
        if not self.layout.sp:
            return x
        return self._timed(site, lambda: self.tp.all_gather(x, site, dim=0, sizes=_equal(self.tp, x, 0)))

    def gather_seq_rows(self, x: Tensor, site: str) -> Tensor:
        if self.cp is None:
            return x
        return self._timed(site, lambda: self.cp.all_gather(x, site, dim=0, sizes=_equal(self.cp, x, 0)))

    def decisions(self) -> list[dict]:
        return [d for c in (self.tp, self.cp) if c is not None for d in c.decisions()]

    def close(self) -> None:
        for c in (self.tp, self.cp):
            if c is not None:
                c.close()


def _equal(coll: DeterministicCollective, x: Tensor, dim: int) -> list[int]:
    # SeqShard pads rows and units split evenly, so every member holds the same size: no size exchange
    return [x.shape[dim]] * len(coll.members)


class BaselineComm(DistComm):
    """The non-deterministic way: all_reduce(SUM) of the partial in the activation dtype."""

    def __init__(self, *args, act_dtype: torch.dtype, tp_group: dist.ProcessGroup | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.act_dtype, self.tp_group = act_dtype, tp_group

    def reduce_units(
        self, root: Tensor, site: str, *, scatter_rows: bool = False, then: Finish | None = None
    ) -> Tensor:
        if self.tp is None:
            return then(root) if then is not None else root

        def reduce() -> Tensor:
            x = root.to(self.act_dtype)  # people reduce the rounded partial (half the bytes)
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.tp_group)
            if scatter_rows and self.layout.sp:
                x = x.tensor_split(self.layout.tp)[self.layout.coords(self.rank)[1]]
            x = x.to(torch.float32)
            return then(x) if then is not None else x

        return self._timed(site, reduce)

    def start_reduce_units(
        self, root: Tensor, site: str, *, scatter_rows: bool = False, then: Finish | None = None
    ) -> Callable[[], Tensor]:
        out = self.reduce_units(root, site, scatter_rows=scatter_rows, then=then)
        return lambda: out


def build_comm(
    layout: Layout,
    rank: int,
    *,
    mode: str,
    algorithm: str,
    device: torch.device,
    act_dtype: torch.dtype,
    on_call: Callable[[str], None] | None = None,
    segment_bytes: int | None = None,
) -> DistComm | None:
    """The comm of `rank` (`on_call`: see DistComm); every rank of the world calls this with the same
    arguments (it creates the groups). A rank outside the layout (a world larger than the layout, as
    a benchmark that runs several layouts in one launch has) creates the groups and gets None."""
    if mode not in ("deterministic", "baseline"):
        raise ValueError(f"unknown mode {mode!r}; allowed: ['deterministic', 'baseline']")
    local_size = layout.local if layout.hierarchical else None
    algo = "hierarchical" if layout.hierarchical else algorithm

    def tp_collective(ranks: list[int]) -> DeterministicCollective:
        return new_collective(ranks, algorithm=algo, local_size=local_size, device=device, segment_bytes=segment_bytes)

    def cp_collective(ranks: list[int]) -> DeterministicCollective:
        return new_collective(ranks, algorithm=algorithm, device=device, segment_bytes=segment_bytes)

    colls = new_groups(layout, {"tp": tp_collective, "cp": cp_collective}, rank=rank)
    baseline = new_groups(layout, {"tp": dist.new_group}, rank=rank) if mode == "baseline" else None
    if rank >= layout.world:
        return None
    if baseline is None:
        return DistComm(layout, rank, colls.tp, colls.cp, on_call)
    return BaselineComm(layout, rank, colls.tp, colls.cp, on_call, act_dtype=act_dtype, tp_group=baseline.tp)
