"""Where the GPU waits for the host: idle gaps between kernels in a torch.profiler chrome trace.

A block's wall time is its kernels' time plus the time the GPU sat idle; an idle gap ends when the
host launches the next kernel, so the gap belongs to the host code that ran before that launch.
`gaps()` finds every gap on the busiest stream, names the kernel that ended it, the last marker
the host passed before launching it (the block's op names, planted by `marker_trace`), and the
synchronisations the host made during the gap (each drains the queue, so the host must refill it).

Trace events used (kineto's chrome trace): "kernel", "gpu_memcpy", "gpu_memset" (GPU busy),
"cuda_runtime" / "cuda_driver" (launches and synchronisations, joined to kernels by
args.correlation), "user_annotation" (the markers).
"""

from __future__ import annotations

import bisect
import collections
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.profiler import record_function

MARK = "h3lab:"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# cudaMemcpyAsync is not one: the plan's copies are asynchronous, and a blocking copy shows up as
# cudaStreamSynchronize anyway
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def marker_trace(name: str, t: Tensor, space: str) -> Tensor:
    """A block_step trace hook that leaves an instant marker `h3lab:<op>` on the profiler's host timeline."""
    with record_function(MARK + name):
        pass
    return t


def gaps(trace_path: Path | str, min_gap_us: float = 5.0) -> dict[str, Any]:
    """GPU idle time between the first and last kernel, split into gaps and attributed to host code.

    Returns busy/idle totals (µs), the idle time per marker (the op the host last passed before the
    launch that ended a gap) and the largest gaps with the kernel after them and any syncs inside.
    """
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    events = [e for e in events if e.get("ph") == "X"]
    gpu = _busiest_stream(events, trace_path)
    launches = _launches_by_correlation(events)
    syncs = _host_syncs(events)
    last_mark = _last_mark(events)
    found, busy, end = [], 0.0, gpu[0]["ts"]
    for e in gpu:
        gap = e["ts"] - end
        if gap >= min_gap_us:
            found.append(_gap(e, gap, end, launches, syncs, last_mark))
        busy += e["dur"]
        end = max(end, e["ts"] + e["dur"])
    return _totals(found, busy, end - gpu[0]["ts"])


def _busiest_stream(events: list[dict], trace_path: Path | str) -> list[dict]:
    """The GPU events of the stream with the most of them, by start time (the block runs on one stream;
    others are profiler noise)."""
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        raise ValueError(f"{trace_path}: no GPU events; allowed: a trace profiled with ProfilerActivity.CUDA")
    streams = collections.Counter(e.get("args", {}).get("stream") for e in gpu)
    stream = streams.most_common(1)[0][0]
    return sorted((e for e in gpu if e.get("args", {}).get("stream") == stream), key=lambda e: e["ts"])


def _launches_by_correlation(events: list[dict]) -> dict[Any, dict]:
    """The host's runtime and driver calls by args.correlation, the id that joins a launch to its kernel."""
    return {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }


def _host_syncs(events: list[dict]) -> list[dict]:
    """The host's synchronisations (SYNCS, runtime or driver calls), by start time."""
    return sorted(
        (e for e in events if e.get("name") in SYNCS and e.get("cat") in ("cuda_runtime", "cuda_driver")),
        key=lambda e: e["ts"],
    )


def _last_mark(events: list[dict]) -> Callable[[float], str]:
    """The op of the last `h3lab:<op>` marker at or before a host time; "(block start)" before the first."""
    marks = sorted(
        (e["ts"], e["name"][len(MARK) :])
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith(MARK)
    )
    mark_ts = [t for t, _ in marks]

    def last_mark(ts: float) -> str:
        i = bisect.bisect_right(mark_ts, ts) - 1
        return marks[i][1] if i >= 0 else "(block start)"

    return last_mark


def _gap(
    e: dict, gap: float, end: float, launches: dict[Any, dict], syncs: list[dict], last_mark: Callable[[float], str]
) -> dict[str, Any]:
    """The gap that GPU event `e` ends (the GPU idle since `end`): charged to the op the host last passed
    before launching `e` (before `e` itself when its launch is not in the trace), with the syncs inside."""
    launch = launches.get(e.get("args", {}).get("correlation"))
    launch_ts = launch["ts"] if launch else e["ts"]
    inside = [s["name"] for s in syncs if end <= s["ts"] + s.get("dur", 0) and s["ts"] <= e["ts"]]
    return {
        "gap_us": gap,
        "before_kernel": e["name"][:80],
        "after_op": last_mark(launch_ts),
        "syncs": dict(collections.Counter(inside)),
    }


def _totals(found: list[dict[str, Any]], busy: float, span: float) -> dict[str, Any]:
    """gaps()'s record: busy and idle totals, idle per op (largest first) and the 25 largest gaps."""
    by_op: dict[str, float] = collections.defaultdict(float)
    for g in found:
        by_op[g["after_op"]] += g["gap_us"]
    return {
        "span_us": span,
        "busy_us": busy,
        "idle_us": sum(g["gap_us"] for g in found),
        "gaps": len(found),
        "idle_by_op_us": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
        "largest": sorted(found, key=lambda g: -g["gap_us"])[:25],
    }
