"""A profiled step's GPU time by part: each kernel charged to the part the host was in when it launched it.

The host plants markers (`h3lab:<name>` user annotations, h3lab.bench.gaps.marker_trace) as it
passes the step's stage boundaries; `part_of(name)` says which part begins at a marker (None: the
part goes on). A kernel, copy or memset belongs to the part of the last part-opening marker before
its launch (the runtime call that shares its correlation id), on any host thread, so autograd's
backward thread counts too. The profiled step is slower than a timed one (the profiler, the
markers); what compares is its parts' GPU time, side by side in one run.

Trace events used (kineto's chrome trace): as h3lab.bench.gaps.
"""

from __future__ import annotations

import bisect
import collections
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from h3lab.bench.gaps import GPU_CATS, MARK


def _events(trace_path: Path | str) -> list[dict[str, Any]]:
    return [e for e in json.loads(Path(trace_path).read_text())["traceEvents"] if e.get("ph") == "X"]


def _bounds(events: list[dict[str, Any]], part_of: Callable[[str], str | None]) -> list[tuple[float, str]]:
    """(timestamp, part) where each part begins, in host order; repeats of the current part dropped."""
    marks = sorted(
        (e["ts"], e["name"][len(MARK) :])
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith(MARK)
    )
    bounds: list[tuple[float, str]] = []
    for ts, name in marks:
        part = part_of(name)
        if part is not None and (not bounds or bounds[-1][1] != part):
            bounds.append((ts, part))
    return bounds


def by_part(
    trace_path: Path | str, part_of: Callable[[str], str | None], first: str, top: int = 8
) -> dict[str, dict[str, Any]]:
    """{part: {"gpu_ms", "launches" (kernels, copies and memsets), "host_ms", "kernels": [[name, ms,
    launches], ...] longest `top`, "most_launched": [[name, launches], ...]}} in the order the parts
    began; `first` is the part before any marker. host_ms: from where the part began to where the
    next began (the first part: from the first launch; the last: to the last launch)."""
    events = _events(trace_path)
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        raise ValueError(f"{trace_path}: no GPU events; allowed: a trace profiled with ProfilerActivity.CUDA")
    bounds = _bounds(events, part_of)
    starts = [t for t, _ in bounds]
    launch_ts = sorted(launches.values())
    ends = [*starts[1:], launch_ts[-1] if launch_ts else starts[-1] if starts else 0.0]
    begin = launch_ts[0] if launch_ts else min(e["ts"] for e in gpu)
    out: dict[str, dict[str, Any]] = {first: {"host_ms": ((starts[0] if starts else ends[-1]) - begin) / 1e3}}
    for (ts, part), end in zip(bounds, ends, strict=True):
        rec = out.setdefault(part, {"host_ms": 0.0})
        rec["host_ms"] += (end - ts) / 1e3
    kernels: dict[str, collections.Counter] = {p: collections.Counter() for p in out}
    counts: dict[str, collections.Counter] = {p: collections.Counter() for p in out}
    for e in gpu:
        ts = launches.get(e.get("args", {}).get("correlation"), e["ts"])
        i = bisect.bisect_right(starts, ts) - 1
        part = bounds[i][1] if i >= 0 else first
        kernels[part][e["name"]] += e.get("dur", 0) / 1e3
        counts[part][e["name"]] += 1
    for part, rec in out.items():
        rec["gpu_ms"] = sum(kernels[part].values())
        rec["launches"] = sum(counts[part].values())
        rec["kernels"] = [[name[:120], ms, counts[part][name]] for name, ms in kernels[part].most_common(top)]
        rec["most_launched"] = [[name[:120], n] for name, n in counts[part].most_common(top)]
    return out


def side_by_side(canonical: dict[str, dict[str, Any]], eager: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per part of either side (canonical's order first): both GPU times and their ratio."""
    rows = []
    for part in dict.fromkeys([*canonical, *eager]):
        c, e = canonical.get(part, {}).get("gpu_ms", 0.0), eager.get(part, {}).get("gpu_ms", 0.0)
        rows.append({"part": part, "canonical_ms": c, "eager_ms": e, "ratio": c / e if e else None})
    return rows
