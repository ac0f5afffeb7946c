"""The layout benchmark's diagnosis of rank arrival skew (`python -m h3lab.bench.layouts --diagnose`).

Each suspect of a late rank, run on the deterministic layout's own steps, every collective recorded
(h3lab.parallel.timed), so one run on the GPUs says which of them moves the arrivals:
- `arrival_barrier`: a one-element all_reduce before every collective, timed apart: the wait for
  the late peer measured directly (checks the split the plain records infer from arrival times);
- `progress_file`: the runner's per-collective status-file write (h3lab.run.progress.Progress as
  DistComm.on_call) on, and the cost of one write as the runner wrote it before (a whole file per
  call) and as it does now;
- `heartbeat`: the runner's heartbeat thread (a file write every HEARTBEAT_S) running beside the steps;
- `host_syncs` (CUDA): every host synchronisation one step makes, by the h3lab line that made it;
- `triton_cache_misses`: kernels Triton had to specialise or compile during steady steps (a
  specialisation that changes between steps, e.g. with a pointer's alignment, compiles mid-step);
- `runner_path` (the first diagnosed case only): the runner's repeat as `h3lab run` ran it, building
  the problem's weights and batch after the barrier (`rebuilt`), against the same repeat with them
  built once (`prepared`, what h3lab.run.workers.rank does now).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from h3lab.bench.sync_sites import sites_of
from h3lab.parallel.distcomm import DistComm
from h3lab.parallel.layout import Layout
from h3lab.parallel.timed import CollectiveClock, TimedComm, now_ns
from h3lab.run import tasks
from h3lab.run.problem import Problem
from h3lab.run.progress import Progress

HEARTBEAT_S = 0.2  # as h3lab.run.workers.rank beats
TICKS = 200  # status-file writes timed for the cost of one


Record = Callable[..., dict]  # record(fn, barrier, clock=None): one timed step (the worker's step_record)


def diagnose(
    r: Any,
    layout: Layout,
    comm: DistComm,
    step_with: Callable[[Any], Callable[[], Any]],
    barrier: Callable[[], None],
    record: Record,
) -> dict:
    """Every suspect on this rank. `r`: the worker's Rank (device, spec, groups); `step_with(comm)`:
    the layout's block step through `comm`; `record`: the worker's timed step."""
    n = r.spec["diagnose_steps"]
    step = step_with(comm)
    clock = CollectiveClock(r.device, arrival_barrier=True)
    out: dict[str, Any] = {"steps": n}
    out["arrival_barrier"] = [record(step_with(TimedComm(comm, clock)), barrier, clock) for _ in range(n)]
    out["progress_file"] = _progress(r, comm, step, barrier, record, n)
    out["heartbeat"] = _heartbeat(r, step, barrier, record, n)
    out["host_syncs"] = host_syncs(step) if r.cuda else None
    with triton_cache_misses() as missed:
        out["triton_steps"] = [record(step, barrier) for _ in range(n)]
    out["triton_cache_misses"] = missed
    if r.spec.get("diagnose_runner") and not r.runner_diagnosed:
        r.runner_diagnosed = True
        out["runner_path"] = _runner_path(r, layout, comm, record)
    return out


def _write_costs(r: Any) -> dict[str, dict[str, float]]:
    """Microseconds per status write, in the run's folder and the system's temporary one: as the
    runner wrote it before (a whole file per call: open, truncate, write, close) and as Progress
    writes it now (one record overwritten in a file kept open)."""
    out = {}
    for folder in (Path(r.spec["out_dir"]), Path(tempfile.gettempdir())):
        path = folder / f"h3lab-rank{r.rank}-{os.getpid()}.probe.json"
        record = json.dumps({"state": "running", "calls": 1, "site": "attn.to_out.0"})
        t = now_ns()
        for _ in range(TICKS):
            path.write_text(record)
        whole = (now_ns() - t) / TICKS / 1e3
        probe = Progress(path)
        t = now_ns()
        for _ in range(TICKS):
            probe.tick("attn.to_out.0")
        kept_open = (now_ns() - t) / TICKS / 1e3
        probe.close()
        path.unlink(missing_ok=True)
        out[str(folder)] = {"whole_file_us": whole, "kept_open_us": kept_open}
    return out


def _progress(r: Any, comm: DistComm, step: Callable, barrier: Callable, record: Record, n: int) -> dict:
    path = Path(r.spec["out_dir"]) / f"rank{r.rank}.progress.json"
    costs = _write_costs(r)
    tick_us = costs[r.spec["out_dir"]]["kept_open_us"] if r.spec["out_dir"] in costs else None
    off = [record(step, barrier) for _ in range(n)]
    saved, writing = comm.on_call, Progress(path)
    comm.on_call = writing.tick
    try:
        on = [record(step, barrier) for _ in range(n)]
        calls = writing.calls // max(n, 1)
    finally:
        comm.on_call = saved
        writing.close()
    return {"tick_us": tick_us, "write_costs_us": costs, "ticks_per_step": calls, "off": off, "on": on}


def _heartbeat(r: Any, step: Callable, barrier: Callable, record: Record, n: int) -> dict:
    path = Path(r.spec["out_dir"]) / f"rank{r.rank}.heartbeat"
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(repr(time.time()))
            tmp.replace(path)
            stop.wait(HEARTBEAT_S)

    off = [record(step, barrier) for _ in range(n)]
    thread = threading.Thread(target=beat, daemon=True, name="h3lab-diagnose-heartbeat")
    thread.start()
    try:
        on = [record(step, barrier) for _ in range(n)]
    finally:
        stop.set()
        thread.join()
    return {"off": off, "on": on}


@contextlib.contextmanager
def triton_cache_misses() -> Iterator[list[str] | None]:
    """The kernels Triton looks up and misses in its in-memory cache inside the block (each miss is a
    specialisation or a compile on the host); None where this Triton has no cache hook."""
    owner: Any = None
    try:
        from triton import knobs

        owner, attr = knobs.runtime, "jit_cache_hook"
    except (ImportError, AttributeError):
        try:
            from triton.runtime.jit import JITFunction

            owner, attr = JITFunction, "cache_hook"
        except ImportError:
            pass
    if owner is None or not hasattr(owner, attr):  # a hook Triton would never call counts nothing
        yield None
        return
    missed: list[str] = []
    previous = getattr(owner, attr, None)

    def hook(*args: Any, **kwargs: Any) -> Any:
        missed.append(str(kwargs.get("repr", "?"))[:160])
        return previous(*args, **kwargs) if previous else None  # a false value: compile as usual

    setattr(owner, attr, hook)
    try:
        yield missed
    finally:
        setattr(owner, attr, previous)


def host_syncs(step: Callable[[], Any]) -> dict[str, int]:
    """Host synchronisations of one call of `step`, by its innermost three h3lab frames (CUDA only)."""
    return sites_of(step, skip="diagnose")


def _runner_path(r: Any, layout: Layout, comm: DistComm, record: Record) -> dict:
    """The runner's repeats on this layout: weights and batch rebuilt after each barrier, then built once."""
    spec = r.spec
    problem = Problem(
        synthetic=spec["config"],
        rows=r.current_rows,
        seed=spec["seed"],
        device=r.device.type,
        backend=spec["backend"],
        weights_seed=spec["weights_seed"],
    )
    clock = CollectiveClock(r.device)
    timed = TimedComm(comm, clock)
    backend = r.backend  # the worker's one backend, of this problem's name
    whole_world = layout.world == r.world
    host = r.host_groups[layout.world]
    barrier = dist.barrier if whole_world else (lambda: dist.barrier(group=host))  # rank.py: the default group
    n = spec["diagnose_runner_steps"]
    out: dict[str, Any] = {"barrier": "default group" if whole_world else "the layout's host group", "steps": n}

    def repeat(inputs: tasks.Inputs | None) -> dict:
        got: dict[str, Any] = {}

        def fn() -> None:
            c = tasks.compute(problem, timed, r.device, backend=backend, layout=layout, rank=r.rank, inputs=inputs)
            got.update(c.timings)

        rec = record(fn, barrier, clock)
        return rec | {"block_timings": dict(got)}

    out["rebuilt"] = [repeat(None) for _ in range(n)]
    t = now_ns()
    inputs = tasks.prepare(problem, r.device)
    out["prepare_ms"] = (now_ns() - t) / 1e6
    out["prepared"] = [repeat(inputs) for _ in range(n)]
    return out
