"""When each collective of a step ran on one rank: arrival and exit on the device's timeline, host
entry and exit, bytes. A layout benchmark splits each call into time waiting for a late peer and
time moving bytes from these records of every rank (h3lab.bench.layouts).

Clock: CLOCK_MONOTONIC in nanoseconds, one clock for every process of a host. On CUDA a step starts
with an event recorded on an idle GPU (after a device synchronisation) at a host time read just
before; each call records an event before and after itself on the current stream, and its device
times are the step's host origin plus the events' offsets from the step's event. On CPU (gloo,
synchronous) the device times are the host times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from h3lab.parallel.distcomm import DistComm
from h3lab.parallel.transport import Finish


def now_ns() -> int:
    """The host clock every rank of a host shares."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class CollectiveClock:
    """Records one rank's collective calls within a step; off (a plain call) between steps.

    Events come from a pool made before timing. With `arrival_barrier`, every call is preceded by a
    one-element all_reduce on the call's own process group, timed apart: it returns when the last
    member has arrived, so its time is the wait for the late peer, measured, not inferred.
    """

    def __init__(self, device: torch.device, capacity: int = 512, *, arrival_barrier: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.arrival_barrier = arrival_barrier
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(3 * capacity)] if self.cuda else []
        self._one = torch.zeros(1, device=device)
        self._calls: list[dict] = []
        self._marks: list[tuple[Any, ...]] = []
        self._start: Any = None
        self._origin_ns = 0
        self.on = False

    def begin(self, start_event: Any, origin_ns: int) -> None:
        """A step starts: `start_event` was recorded on an idle device at host time `origin_ns`."""
        self._calls, self._marks, self._start, self._origin_ns, self.on = [], [], start_event, origin_ns, True

    def end(self) -> list[dict]:
        """The step's calls (after the step's device synchronisation): each with its device times."""
        self.on = False
        for call, marks in zip(self._calls, self._marks, strict=True):
            if self.cuda:
                offsets = [self._start.elapsed_time(e) * 1e6 for e in marks]  # ms -> ns
                call["arrive_ns"] = self._origin_ns + int(offsets[0])
                call["exit_ns"] = self._origin_ns + int(offsets[-1])
                if self.arrival_barrier:
                    call["barrier_exit_ns"] = self._origin_ns + int(offsets[1])
            else:
                call["arrive_ns"], call["exit_ns"] = marks[0], marks[-1]
                if self.arrival_barrier:
                    call["barrier_exit_ns"] = marks[1]
        return self._calls

    def timed(
        self,
        kind: str,
        site: str,
        group: list[int],
        fn: Callable[[], Tensor],
        *,
        x: Tensor,
        pg: Any = None,
        bytes_of: Callable[[], tuple[int, int]] | None = None,
    ) -> Tensor:
        """fn(), recorded as one call of `kind` on `x` at `site` over global ranks `group` (process
        group `pg`, for the arrival barrier). `bytes_of`: this rank's (sent, received) bytes so far."""
        if not self.on:
            return fn()
        before = bytes_of() if bytes_of is not None else (0, 0)
        i = len(self._calls)
        host_in = now_ns()
        marks: list[Any] = [self._mark(3 * i)]
        if self.arrival_barrier:
            dist.all_reduce(self._one, group=pg)
            marks.append(self._mark(3 * i + 1))
        out = fn()
        marks.append(self._mark(3 * i + 2))
        host_out = now_ns()
        after = bytes_of() if bytes_of is not None else (0, 0)
        self._calls.append(
            {
                "kind": kind,
                "site": site,
                "group": group,
                "bytes": x.numel() * x.element_size(),
                "sent": after[0] - before[0],
                "received": after[1] - before[1],
                "host_in_ns": host_in,
                "host_out_ns": host_out,
            }
        )
        self._marks.append(tuple(marks))
        return out

    def note_bytes(self, sent: int, received: int) -> None:
        """Set the last call's bytes (for collectives that count none themselves: the eager ones)."""
        if self._calls:
            self._calls[-1]["sent"], self._calls[-1]["received"] = sent, received

    def _mark(self, slot: int) -> Any:
        if not self.cuda:
            return now_ns()
        if slot >= len(self._events):
            raise ValueError(f"more than {len(self._events) // 3} collective calls in one step; raise capacity")
        event = self._events[slot]
        event.record()
        return event


class TimedComm:
    """A `DistComm` whose calls that move bytes `clock` records (the same calls, in the same order:
    the same bits). `overlap=False` finishes every started reduction at once (the block's overlap
    off, for a comparison in one run)."""

    def __init__(self, inner: DistComm, clock: CollectiveClock, *, overlap: bool = True) -> None:
        self.inner, self.clock, self.units, self.overlap = inner, clock, inner.units, overlap

    def _timed(self, kind: str, site: str, x: Tensor, fn: Callable[[], Any], *, cp: bool = False) -> Any:
        coll = self.inner.cp if cp else self.inner.tp
        if coll is None:  # no group: the inner comm hands back its input
            return fn()
        counter = coll.bytes_total
        return self.clock.timed(
            kind, site, coll.members, fn, x=x, pg=coll.process_group, bytes_of=lambda: counter()[:2]
        )

    def reduce_units(
        self, root: Tensor, site: str, *, scatter_rows: bool = False, then: Finish | None = None
    ) -> Tensor:
        fn = lambda: self.inner.reduce_units(root, site, scatter_rows=scatter_rows, then=then)  # noqa: E731
        return self._timed("reduce_units", site, root, fn)

    def start_reduce_units(
        self, root: Tensor, site: str, *, scatter_rows: bool = False, then: Finish | None = None
    ) -> Callable[[], Tensor]:
        if not self.overlap:
            out = self.reduce_units(root, site, scatter_rows=scatter_rows, then=then)
            return lambda: out
        finish = self._timed(
            "start_reduce_units",
            site,
            root,
            lambda: self.inner.start_reduce_units(root, site, scatter_rows=scatter_rows, then=then),
        )
        if self.inner.tp is None:
            return finish
        return lambda: self._timed("finish_reduce_units", site, root, finish)

    def gather_units(self, part: Tensor, site: str, *, dim: int) -> Tensor:
        return self._timed("gather_units", site, part, lambda: self.inner.gather_units(part, site, dim=dim))

    def gather_tp_rows(self, x: Tensor, site: str) -> Tensor:
        if not self.inner.layout.sp:
            return x
        return self._timed("gather_tp_rows", site, x, lambda: self.inner.gather_tp_rows(x, site))

    def gather_seq_rows(self, x: Tensor, site: str) -> Tensor:
        return self._timed("gather_seq_rows", site, x, lambda: self.inner.gather_seq_rows(x, site), cp=True)
