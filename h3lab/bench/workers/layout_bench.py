"""Worker: one rank of the layout benchmark (h3lab.bench.layouts): deterministic and eager steps, timed.

    python -m h3lab.bench.workers.layout_bench SPEC.json

Launched only through `h3lab.launch.launcher.launch`, one process per GPU (NCCL; gloo on CPU), as many
as the largest layout of the spec needs; ranks outside a smaller layout wait for it. Per rank: the
block's weights, every case's batch, shards, comms and event pools are built before its steps;
each timed step starts after a barrier of the layout's ranks (gloo, on the host) and a device
synchronisation, and is timed by CUDA events (wall clock on CPU). A case runs its warm-up steps
(the first one's collectives recorded: compiles, first-use costs), `steps` plain steps (the step
times and the peak memory), then `collective_steps` steps whose every collective is recorded
(h3lab.parallel.timed), for the wait/transfer split. Writes OUT_DIR/rank{r}.json after every case.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from h3lab.backend import get_backend
from h3lab.batch import PackedBatch, packed_batch
from h3lab.bench.workers import layout_diagnose
from h3lab.bench.workers.eager_layouts import EagerGroups, eager_groups, eager_inputs, eager_parallel
from h3lab.block import BlockStep, block_step
from h3lab.config import H3Config
from h3lab.io.jsonfile import write_json
from h3lab.launch.lifeline import exit_now, watch
from h3lab.metrics import digest
from h3lab.parallel.distcomm import DistComm, build_comm
from h3lab.parallel.layout import Layout
from h3lab.parallel.seqshard import SeqShard
from h3lab.parallel.timed import CollectiveClock, TimedComm, now_ns
from h3lab.reference.eager import EagerCollectives, eager_block
from h3lab.units import unit_weights
from h3lab.weights import BlockWeights, synthetic_block

GIB = 1 << 30
Barrier = Callable[[], None]


class Rank:
    """This process: device, groups for host barriers, and the spec's settings."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        timeout = datetime.timedelta(seconds=float(spec.get("timeout_s", 1800)))
        if spec["device"] == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            torch.cuda.set_device(self.device)  # NCCL and Triton launch on the current device
            dist.init_process_group("nccl", device_id=self.device, timeout=timeout)
            self.host_group = dist.new_group(backend="gloo", timeout=timeout)  # barriers never touch a stream
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=timeout)
            self.host_group = dist.group.WORLD
        self.cuda = self.device.type == "cuda"
        self.backend = get_backend(spec["backend"], self.device)  # this process's one backend
        self.timeout = timeout
        self.host_groups: dict[int, Any] = {}  # layout size n -> a gloo group of ranks 0..n-1
        self.runner_diagnosed = False
        self.current_rows = 0  # rows of the case being diagnosed (the runner path's problem)
        self.diagnose_rows = 0  # the row count of each layout at which the diagnosis runs

    def make_host_groups(self, worlds: list[int]) -> None:
        """Every rank creates every group, in one order."""
        for n in sorted(set(worlds)):
            self.host_groups[n] = dist.new_group(list(range(n)), backend="gloo", timeout=self.timeout)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def step_record(fn: Callable[[], Any], barrier: Barrier, r: Rank, clock: CollectiveClock | None) -> dict:
    """One step after `barrier` and a device synchronisation: its device time (events; wall on CPU),
    host wall time, host origin, and with `clock` its collective calls."""
    start = end = None
    if r.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    barrier()
    r.sync()
    origin = now_ns()
    if r.cuda:
        start.record()
    if clock is not None:
        clock.begin(start, origin)
    result = fn()
    if r.cuda:
        end.record()
        end.synchronize()
    wall = now_ns() - origin
    del result
    rec = {"origin_ns": origin, "wall_ms": wall / 1e6, "step_ms": start.elapsed_time(end) if r.cuda else wall / 1e6}
    if clock is not None:
        rec["calls"] = clock.end()
    return rec


def measure(fn: Callable[[], Any], barrier: Barrier, r: Rank, clock: CollectiveClock) -> dict:
    """Warm-up (the first step's collectives recorded), plain steps with the peak memory, then steps
    with every collective recorded."""
    spec = r.spec
    first = step_record(fn, barrier, r, clock)
    for _ in range(spec["warmup"] - 1):
        step_record(fn, barrier, r, None)
    r.sync()
    base = torch.cuda.memory_allocated(r.device) if r.cuda else 0
    if r.cuda:
        torch.cuda.reset_peak_memory_stats(r.device)
    plain = [step_record(fn, barrier, r, None) for _ in range(spec["steps"])]
    peak = torch.cuda.max_memory_allocated(r.device) if r.cuda else 0
    timed = [step_record(fn, barrier, r, clock) for _ in range(spec["collective_steps"])]
    return {
        "steps": plain,
        "collective_steps": timed,
        "first_step": first,
        "base_gib": base / GIB if r.cuda else None,  # weights and inputs alive when the steps start
        "peak_gib": peak / GIB if r.cuda else None,  # the most allocated at once during the plain steps
    }


class TimedEagerOps(EagerCollectives):
    """The eager layout's collectives, recorded by `clock`, with nccl-tests' byte conventions per rank:
    all_reduce of S bytes sends 2(P-1)/P*S, all_gather of s bytes (P-1)*s, reduce_scatter of S (P-1)/P*S."""

    def __init__(self, clock: CollectiveClock, ranks_of: dict[int, list[int]]) -> None:
        self.clock, self.ranks_of = clock, ranks_of

    def call(self, kind: str, site: str, group: Any, group_size: int, x: torch.Tensor, fn: Callable) -> torch.Tensor:
        out = self.clock.timed(kind, site, self.ranks_of[id(group)], fn, x=x, pg=group)
        S, P = x.numel() * x.element_size(), group_size
        moved = {"all_reduce": 2 * (P - 1) * S // P, "all_gather": (P - 1) * S, "reduce_scatter": (P - 1) * S // P}
        if self.clock.on:
            self.clock.note_bytes(moved[kind], moved[kind])
        return out


def det_case(r: Rank, layout: Layout, comm: DistComm, w: BlockWeights, full: PackedBatch, barrier: Barrier) -> dict:
    """The deterministic layout on this rank: timings, collective records, bytes, first-step digests."""
    local = SeqShard(layout, full.num_rows).coshard(full, r.rank)
    uw = unit_weights(w, comm.units)
    clock = CollectiveClock(r.device)
    timed = TimedComm(comm, clock, overlap=r.spec.get("overlap", True))
    backend = r.backend

    def step() -> BlockStep:
        return block_step(uw, local, timed, backend=backend)

    rec = measure(step, barrier, r, clock)
    if r.spec["digests"]:
        rec["digests"] = step_digests(step(), layout, full.num_rows, r.rank)
    rec["decisions"] = [d for c in (comm.tp, comm.cp) if c is not None for d in c.decisions()]
    if r.spec["diagnose"] and layout.world > 1 and full.num_rows == r.diagnose_rows:

        def step_with(c: Any) -> Callable[[], BlockStep]:
            return lambda: block_step(uw, local, c, backend=backend)

        def record(fn: Callable[[], Any], bar: Barrier, clk: CollectiveClock | None = None) -> dict:
            return step_record(fn, bar, r, clk)

        r.current_rows = full.num_rows
        rec["diagnose"] = layout_diagnose.diagnose(r, layout, comm, step_with, barrier, record)
    return rec


def step_digests(s: BlockStep, layout: Layout, rows: int, rank: int) -> dict[str, str]:
    """Digests a layout shares with every other: each unit's weight-gradient slices, the replicated
    ones, d temb, and out/dx in blocks of rows/8 (any layout's shards are whole blocks when 8
    divides the rows; otherwise no row digests)."""
    out = {f"dw.{k}@u{u}": digest(t) for k, per in s.dw_units.items() for u, t in per.items()}
    out |= {f"dw.{k}": digest(t) for k, t in s.dw_replicated.items()}
    out["dtemb"] = digest(s.dtemb)
    if rows % 8 == 0:
        local = SeqShard(layout, rows).local_rows(rank)
        block = rows // 8
        for j in range(local.start // block, min(local.stop, rows) // block):
            lo = j * block - local.start
            out |= {f"{name}.rows{j}": digest(t[lo : lo + block]) for name, t in (("out", s.out), ("dx", s.dx))}
    return out


def eager_case(
    r: Rank,
    layout: Layout,
    groups: EagerGroups,
    w: BlockWeights,
    full: PackedBatch,
    barrier: Barrier,
    ranks_of: dict[int, list[int]],
) -> dict:
    """The eager layout on this rank, the best SDPA backend of the node first chosen by all its ranks."""
    clock = CollectiveClock(r.device)
    inp = eager_inputs(w, full, layout, r.rank)
    par = eager_parallel(layout, groups, TimedEagerOps(clock, ranks_of))
    kernels: list = []

    def step() -> dict:
        with _sdpa(kernels):
            return eager_block(w, inp.batch, inp.cos, inp.sin, True, shard=inp.shard, parallel=par)

    chosen = choose_sdpa(step, kernels, barrier, r, layout)
    rec = measure(step, barrier, r, clock)
    rec["sdpa_backend"] = chosen
    return rec


def _sdpa(kernels: list) -> contextlib.AbstractContextManager:
    if not kernels:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel  # torch >= 2.3

    return sdpa_kernel(kernels)


def choose_sdpa(step: Callable, kernels: list, barrier: Barrier, r: Rank, layout: Layout) -> dict:
    """Time two steps per SDPA backend (cuDNN, flash, memory-efficient) and keep the fastest by the
    slowest rank; on CPU torch's own choice. Every rank tries the same backends in the same order."""
    if not r.cuda:
        return {"chosen": "default (CPU)", "ms": {}}
    from torch.nn.attention import SDPBackend

    ms: dict[str, float | None] = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        kernels[:] = [backend]
        try:
            step_record(step, barrier, r, None)
            ms[backend.name] = step_record(step, barrier, r, None)["step_ms"]
        except (RuntimeError, NotImplementedError):  # not for these shapes or this GPU: on every rank alike
            ms[backend.name] = None
    seen = [None] * layout.world
    dist.all_gather_object(seen, ms, group=r.host_groups[layout.world])
    worst = {k: max((m[k] for m in seen if m[k] is not None), default=None) for k in ms}
    usable = {k: v for k, v in worst.items() if v is not None and all(m[k] is not None for m in seen)}
    if not usable:
        raise ValueError(f"no SDPA backend ran on every rank of {layout.name}: {seen}")
    best = min(usable, key=usable.get)
    kernels[:] = [getattr(SDPBackend, best)]
    return {"chosen": best, "ms": worst}


def run_layout(
    r: Rank, layout: Layout, rows_list: list[int], w: BlockWeights, out: list[dict], write: Callable[[], Any]
) -> None:
    """Every row count of one layout on this rank (or, outside the layout, wait for it)."""
    spec = r.spec
    comm = build_comm(
        layout,
        r.rank,
        mode="deterministic",
        algorithm=spec["algorithm"],
        device=r.device,
        act_dtype=torch.bfloat16,
        segment_bytes=spec.get("segment_bytes"),
    )
    groups = eager_groups(layout, r.rank) if spec["eager"] else None
    host = r.host_groups[layout.world]
    barrier = (lambda: dist.barrier(group=host)) if layout.world > 1 else (lambda: None)
    r.diagnose_rows = rows_list[0]  # the suspects run at a layout's first row count
    for rows in rows_list:
        if comm is not None:
            full = packed_batch(w.config, rows, seed=spec["seed"]).to(r.device)
            mine = SeqShard(layout, rows).local_rows(r.rank)
            case = {"layout": layout.name, "rows": rows, "rank": r.rank, "coords": list(layout.coords(r.rank))}
            case |= {"units": [comm.units.start, comm.units.stop], "world": layout.world}
            case["local_rows"] = [mine.start, mine.stop]
            case["det"] = det_case(r, layout, comm, w, full, barrier)
            if groups is not None:
                case["eager"] = eager_case(r, layout, groups, w, full, barrier, _ranks_of(groups))
            out.append(case)
            write()
            del full
            if r.cuda:
                torch.cuda.empty_cache()
        dist.barrier(group=r.host_group)  # the next case starts on every rank of the world together
    if comm is not None:
        comm.close()


def _ranks_of(groups: EagerGroups) -> dict[int, list[int]]:
    return {id(groups.made.get(kind)): list(ranks) for kind, ranks in groups.members.items()}


def main(argv: list[str]) -> int:
    watch(exit_now(), parent_signal=signal.SIGKILL)  # no orphan when the agent or runner is gone
    spec = json.loads(Path(argv[0]).read_text())
    r = Rank(spec)
    out_dir = Path(spec["out_dir"])
    layouts = [(Layout.parse(name), rows) for name, rows in spec["cases"]]
    r.make_host_groups([lay.world for lay, _ in layouts])
    w = synthetic_block(H3Config.named(spec["config"]), 0, seed=spec["weights_seed"], device=r.device)
    record: dict = {"rank": r.rank, "world": r.world, "device": str(r.device), "host": socket.gethostname()}
    record |= {"transport": "nccl" if r.cuda else "gloo", "cases": []}

    def write() -> None:
        write_json(out_dir / f"rank{r.rank}.json", record)

    for layout, rows_list in layouts:
        run_layout(r, layout, rows_list, w, record["cases"], write)
    record["done"] = True
    write()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
