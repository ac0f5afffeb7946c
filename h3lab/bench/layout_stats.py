"""The layout benchmark's statistics over the ranks' collective records (h3lab.bench.layouts): spreads,
each call's wait for its late peer and its transfer, the arrival skew at a step's first large call."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

LARGE_BYTES = 1 << 20  # a collective at least this large is "large" (the skew is read at the first one)


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """median, p10, p90, min, max and n of `values` (nearest-rank percentiles)."""
    v = sorted(values)
    if not v:
        return {"n": 0, "median": None, "p10": None, "p90": None, "min": None, "max": None}
    pick = lambda q: v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]  # noqa: E731
    return {"n": len(v), "median": statistics.median(v), "p10": pick(0.1), "p90": pick(0.9), "min": v[0], "max": v[-1]}


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def split_calls(step_calls: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """Each rank's calls of one step with `wait_ms` and `transfer_ms`: matched across the call's group
    by (kind, site, occurrence); wait = the group's last arrival - this rank's arrival (at most the
    span: the rest is `clock_error_ms`), transfer = the rest of this rank's span. Calls with a barrier exit also get the
    measured `barrier_wait_ms` and `after_barrier_ms`."""
    keyed: dict[int, dict[tuple, dict]] = {}
    for r, calls in step_calls.items():
        seen: dict[tuple, int] = {}
        keyed[r] = {}
        for call in calls:
            base = (call["kind"], call["site"])
            seen[base] = seen.get(base, -1) + 1
            keyed[r][(*base, seen[base])] = call
    out: dict[int, list[dict]] = {}
    for r, calls in keyed.items():
        rows = []
        for key, call in calls.items():
            peers = [keyed[q][key]["arrive_ns"] for q in call["group"] if q in keyed and key in keyed[q]]
            span = (call["exit_ns"] - call["arrive_ns"]) / 1e6
            late = (max(peers) - call["arrive_ns"]) / 1e6 if len(peers) == len(call["group"]) else None
            # a call cannot end before its last peer arrives: a later arrival is clock error, so the
            # wait is clipped to the span (and the excess kept), and wait + transfer = span always
            wait = None if late is None else min(late, span)
            row = {k: call[k] for k in ("kind", "site", "bytes", "sent", "received")} | {"span_ms": span}
            row |= {"wait_ms": wait, "transfer_ms": None if wait is None else span - wait}
            row["clock_error_ms"] = None if late is None else max(0.0, late - span)
            row["arrive_ms"] = (call["arrive_ns"] - min(peers)) / 1e6 if peers else None
            if "barrier_exit_ns" in call:
                row["barrier_wait_ms"] = (call["barrier_exit_ns"] - call["arrive_ns"]) / 1e6
                row["after_barrier_ms"] = (call["exit_ns"] - call["barrier_exit_ns"]) / 1e6
            rows.append(row)
        out[r] = rows
    return out


def first_large_skew(step_calls: dict[int, list[dict]], large: int = LARGE_BYTES) -> dict | None:
    """The arrival spread (ms) at the step's first call moving >= `large` bytes (else its largest),
    over that call's group, with the call's site; None without calls."""
    calls = step_calls.get(min(step_calls)) if step_calls else None
    if not calls:
        return None
    big = [i for i, c in enumerate(calls) if c["bytes"] >= large]
    i = big[0] if big else max(range(len(calls)), key=lambda j: calls[j]["bytes"])
    call = calls[i]
    key = (
        call["kind"],
        call["site"],
        sum(1 for c in calls[:i] if (c["kind"], c["site"]) == (call["kind"], call["site"])),
    )
    arrivals = []
    for q in call["group"]:
        same = [c for c in step_calls.get(q, []) if (c["kind"], c["site"]) == key[:2]]
        if len(same) > key[2]:
            arrivals.append(same[key[2]]["arrive_ns"])
    if len(arrivals) < len(call["group"]):
        return None
    return {"site": call["site"], "bytes": call["bytes"], "spread_ms": (max(arrivals) - min(arrivals)) / 1e6}
