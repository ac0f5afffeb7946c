"""Where the canonical GPU block's time goes: kernels, launches, host synchronisations, Python.

`python -m h3lab.bench.block_profile --out DIR [--rows 264,4096] [--backend triton]` writes, per row
count, `profile-<rows>.txt` (torch.profiler tables: CUDA kernels by total time, CPU ops by self
time, runtime calls such as cudaStreamSynchronize by count; cProfile's top Python functions) and
`profile.json` (wall time, summed kernel time, launch and synchronisation counts). The wall time
minus the kernel time is what the host adds: launches the GPU waited for and synchronisations
that drained its queue. A second profiled run marks every op on the host timeline and splits the
GPU's idle time into gaps, each charged to the op the host had last passed (h3lab.bench.gaps):
`gaps-<rows>.json`, and the totals in `profile.json`. With `--eager` the eager bf16 block (cuBLAS +
SDPA, h3lab.reference.eager, forward + backward) is profiled at each row count too, and both blocks'
kernel time is split by role (attention, GEMM, other; h3lab.bench.roles) in `by_role_ms`: where the
canonical block's extra time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile

from h3lab.backend import Backend, get_backend
from h3lab.batch import PackedBatch, packed_batch
from h3lab.bench.block_gpu import cuda_times, eager_step
from h3lab.bench.gaps import SYNCS, gaps, marker_trace
from h3lab.bench.roles import by_role
from h3lab.block import block_step, canonical_block
from h3lab.comm import LocalComm
from h3lab.config import H3Config
from h3lab.io.env import capture as capture_env
from h3lab.io.jsonfile import write_json
from h3lab.units import UnitWeights, unit_weights
from h3lab.weights import BlockWeights, synthetic_block


def cuda_kernels(events: list) -> list:
    """The CUDA kernels among a profile's averaged events (prof.key_averages()), one per name."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_ms(kernels: list) -> list[tuple[str, float]]:
    """(kernel name, summed self milliseconds) of cuda_kernels' events."""
    return [(e.key, e.self_device_time_total / 1e3) for e in kernels]


def eager_profile(w: BlockWeights, b: PackedBatch, reps: int) -> dict:
    """The eager block's forward + backward: wall median (CUDA events) and its kernels by role."""
    step = eager_step(w, b)

    def run() -> None:
        step(True)

    wall = cuda_times(run, reps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ks = kernel_ms(cuda_kernels(prof.key_averages()))
    top = sorted(ks, key=lambda t: -t[1])[:12]
    return {
        "wall_median_s": statistics.median(wall),
        "kernel_s": sum(ms for _, ms in ks) / 1e3,
        "by_role_ms": by_role(ks),
        "top_kernels": [{"name": n[:120], "total_ms": ms} for n, ms in top],
    }


def profile_rows(c: H3Config, rows: int, backend: str, reps: int, out: Path, eager: bool = False) -> tuple[dict, str]:
    """One row count's profile of the canonical block: (its record in profile.json, profile-<rows>.txt)."""
    dev = torch.device("cuda")
    w = synthetic_block(c, 0, seed=0).to(dev)
    b = packed_batch(c, rows, seed=1).to(dev)
    be = get_backend(backend, dev)

    def run() -> None:
        canonical_block(w, b, backend=be)

    wall = cuda_times(run, reps)  # after 2 warm-up calls that compile every kernel
    events = _profiled(run)
    python_stats = _python_stats(run)
    uw = unit_weights(w)
    walls, laps = _block_step_times(uw, b, be, reps)
    idle = _marked_gaps(uw, b, be, out, rows)
    m = _Measured(wall, events, python_stats, walls, laps, idle)
    text = _text(rows, backend, m)
    record = _record(rows, backend, dev, m)
    if eager:  # the profilers above do not outlive their helpers
        record["eager"] = eager_profile(w, b, reps)
        mine, theirs = record["by_role_ms"], record["eager"]["by_role_ms"]
        record["extra_ms_by_role"] = {k: mine[k] - theirs[k] for k in mine}
    return record, text


_LAUNCH_CALLS = ("cuLaunchKernel", "cudaLaunchKernel", "cuLaunchKernelEx")


@dataclass(frozen=True)
class _Measured:
    """One row count's measurements of the canonical block (profile_rows); times in seconds."""

    wall: list[float]  # canonical_block's walls
    events: EventList  # its profiled run's averaged events (host and CUDA)
    python_stats: str  # cProfile's top Python functions of one more run
    walls: list[float]  # block_step's walls
    laps: list[float]  # block_step's own event laps
    idle: dict  # the marked run's GPU gaps (h3lab.bench.gaps)

    @functools.cached_property  # derived once from `events`; a frozen dataclass allows it (no __setattr__)
    def kernels(self) -> list:
        return cuda_kernels(self.events)

    @functools.cached_property
    def kernel_s(self) -> float:
        return sum(e.self_device_time_total for e in self.kernels) / 1e6

    @property
    def launches(self) -> int:
        return sum(e.count for e in self.events if e.key in _LAUNCH_CALLS)

    @property
    def syncs(self) -> dict[str, int]:
        return {e.key: e.count for e in self.events if e.key in SYNCS}


def _profiled(run: Callable[[], None]) -> EventList:
    """The averaged host and CUDA events of one profiled `run`, its queue drained inside the profile."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return prof.key_averages()


def _python_stats(run: Callable[[], None]) -> str:
    """cProfile's top 40 Python functions by own time of one `run`, its queue drained inside the profile."""
    pr = cProfile.Profile()
    pr.enable()
    run()
    torch.cuda.synchronize()
    pr.disable()
    py = io.StringIO()
    pstats.Stats(pr, stream=py).sort_stats("tottime").print_stats(40)
    return py.getvalue()


def _block_step_times(uw: UnitWeights, b: PackedBatch, be: Backend, reps: int) -> tuple[list[float], list[float]]:
    """block_step's walls and its own event laps (first to last GPU mark), `reps` each: the wall less
    the laps is what the host adds before the block's first launch and after its last mark."""
    laps: list[float] = []
    walls = cuda_times(lambda: laps.append(sum(block_step(uw, b, LocalComm(), backend=be).timings.values())), reps)
    return walls, laps[-reps:]  # not the warm-up calls


def _marked_gaps(uw: UnitWeights, b: PackedBatch, be: Backend, out: Path, rows: int) -> dict:
    """The GPU's idle gaps in one marked block_step, each charged to the op the host had last passed;
    its trace and gaps are written to `out` (trace-<rows>.json, gaps-<rows>.json)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as marked:
        block_step(uw, b, LocalComm(), backend=be, trace=marker_trace)
        torch.cuda.synchronize()
    marked.export_chrome_trace(str(out / f"trace-{rows}.json"))
    idle = gaps(out / f"trace-{rows}.json")
    write_json(out / f"gaps-{rows}.json", idle)
    return idle


def _text(rows: int, backend: str, m: _Measured) -> str:
    """profile-<rows>.txt: a summary line, the profiler's tables (CUDA, CPU, count) and cProfile's."""
    idle = m.idle
    return "\n\n".join(
        [
            f"rows {rows}, backend {backend}: wall median {statistics.median(m.wall) * 1e3:.2f} ms, "
            f"kernels {m.kernel_s * 1e3:.2f} ms, launches {m.launches}, syncs {m.syncs}; block_step wall "
            f"{statistics.median(m.walls) * 1e3:.2f} ms, its event laps {statistics.median(m.laps) * 1e3:.2f} ms; "
            f"marked run: GPU span {idle['span_us'] / 1e3:.2f} ms, idle {idle['idle_us'] / 1e3:.2f} ms in "
            f"{idle['gaps']} gaps, most after "
            + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in list(idle["idle_by_op_us"].items())[:6]),
            m.events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90),
            m.events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90),
            m.events.table(sort_by="count", row_limit=30, max_name_column_width=90),
            m.python_stats,
        ]
    )


def _record(rows: int, backend: str, dev: torch.device, m: _Measured) -> dict:
    """The row count's record in profile.json; the host adds the wall median less the kernel time."""
    kernels, kernel_s = m.kernels, m.kernel_s
    return {
        "rows": rows,
        "backend": backend,
        "env": capture_env(dev),
        "wall_median_s": statistics.median(m.wall),
        "wall_s": m.wall,
        "kernel_s": kernel_s,
        "host_added_s": statistics.median(m.wall) - kernel_s,
        "launches": m.launches,
        "syncs": m.syncs,
        "kernels": len(kernels),
        "block_step_wall_median_s": statistics.median(m.walls),
        "block_step_laps_median_s": statistics.median(m.laps),
        "marked_run": {k: m.idle[k] for k in ("span_us", "busy_us", "idle_us", "gaps")}
        | {"idle_by_op_us": dict(list(m.idle["idle_by_op_us"].items())[:12])},
        "top_kernels": [
            {"name": e.key[:120], "count": e.count, "total_ms": e.self_device_time_total / 1e3}
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
        ],
        "by_role_ms": by_role(kernel_ms(kernels)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="264,4096")
    ap.add_argument("--backend", default="triton", choices=("triton", "torch"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--config", default="real")
    ap.add_argument("--eager", action="store_true", help="profile the eager block too; kernel time by role")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    a.out.mkdir(parents=True, exist_ok=True)
    records = []
    for rows in (int(r) for r in a.rows.split(",")):
        record, text = profile_rows(H3Config.named(a.config), rows, a.backend, a.reps, a.out, a.eager)
        records.append(record)
        (a.out / f"profile-{rows}.txt").write_text(text)
        write_json(a.out / "profile.json", records)
        print(text.split("\n\n")[0], flush=True)


if __name__ == "__main__":
    main()
