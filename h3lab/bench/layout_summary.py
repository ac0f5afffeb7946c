"""The layout benchmark's record from its ranks' records (h3lab.bench.layouts): per case and mode the
steps, collectives, skew, bytes and memory, det's digests, and the arrival-skew suspects' effects."""

from __future__ import annotations

from typing import Any

from h3lab.bench.layout_compare import compare, table
from h3lab.bench.layout_stats import first_large_skew, median, split_calls, spread
from h3lab.parallel.layout import Layout


def summarize(ranks: list[dict | None], spec: dict) -> dict:
    """The benchmark's record from the ranks' records (missing ranks or cases are listed, not guessed)."""
    by_case: dict[tuple[str, int], dict[int, dict]] = {}
    for rec in ranks:
        for case in (rec or {}).get("cases", []):
            by_case.setdefault((case["layout"], case["rows"]), {})[case["rank"]] = case
    hosts = {rec.get("host") for rec in ranks if rec}
    cases, missing = {}, []
    for name, rows_list in spec["cases"]:
        for rows in rows_list:
            per_rank = by_case.get((name, rows), {})
            world = Layout.parse(name).world
            if len(per_rank) < world:
                missing.append(f"{name}@{rows}: {len(per_rank)} of {world} ranks")
                continue
            cases[f"{name}@{rows}"] = summarize_case(name, rows, per_rank, same_host=len(hosts) == 1)
    comparison = compare(cases)
    return {
        "request": spec,
        "ranks_done": [bool(rec and rec.get("done")) for rec in ranks],
        "missing": missing,
        "cases": cases,
        "comparison": comparison,
        "table": table(comparison),
    }


def summarize_case(layout: str, rows: int, per_rank: dict[int, dict], *, same_host: bool = True) -> dict:
    """One (layout, rows): each mode's steps, collectives, skew, bytes and memory; det's digests."""
    out: dict[str, Any] = {"layout": layout, "rows": rows, "world": len(per_rank), "ranks": {}}
    for r, case in sorted(per_rank.items()):
        out["ranks"][r] = {k: case[k] for k in ("coords", "units", "local_rows")}
    for mode in ("det", "eager"):
        recs = {r: c[mode] for r, c in per_rank.items() if mode in c}
        if len(recs) == len(per_rank):
            out[mode] = summarize_mode(recs, same_host=same_host)
    if "det" in out and all("digests" in c["det"] for c in per_rank.values()):
        out["det"]["digests"] = merge_digests([c["det"]["digests"] for c in per_rank.values()])
    diag = {r: c["det"]["diagnose"] for r, c in per_rank.items() if "diagnose" in c.get("det", {})}
    if diag:
        out["diagnose"] = summarize_diagnose(diag, same_host=same_host)
    return out


def _layout_steps(recs: dict[int, dict], key: str = "steps", field: str = "step_ms") -> list[float]:
    """Per step, the slowest rank's value (a layout's step ends when its last rank's does)."""
    n = min(len(rec[key]) for rec in recs.values())
    return [max(rec[key][i][field] for rec in recs.values()) for i in range(n)]


def summarize_mode(recs: dict[int, dict], *, same_host: bool = True) -> dict:
    """Steps, collectives, skew, bytes and memory of one mode over its ranks."""
    out: dict[str, Any] = {
        "step_ms": spread(_layout_steps(recs)),
        "wall_ms": spread(_layout_steps(recs, field="wall_ms")),
        "per_rank_step_ms": {r: spread([s["step_ms"] for s in rec["steps"]]) for r, rec in sorted(recs.items())},
        "step_start_spread_ms": spread(_start_spreads(recs, "steps")),
        "peak_gib": {r: rec["peak_gib"] for r, rec in sorted(recs.items())},
        "base_gib": {r: rec["base_gib"] for r, rec in sorted(recs.items())},
        # what the step itself allocates above the weights, shards and inputs alive before it
        "step_extra_gib": {
            r: None if rec["peak_gib"] is None else rec["peak_gib"] - rec["base_gib"] for r, rec in sorted(recs.items())
        },
        "first_step": {r: _first_step(rec["first_step"]) for r, rec in sorted(recs.items())},
    }
    chosen = [rec["sdpa_backend"] for rec in recs.values() if "sdpa_backend" in rec]
    if chosen:
        out["sdpa_backend"] = chosen[0]  # every rank of the layout chose the same
    out |= summarize_collectives(recs, "collective_steps", same_host=same_host)
    return out


def _start_spreads(recs: dict[int, dict], key: str) -> list[float]:
    n = min(len(rec[key]) for rec in recs.values())
    return [
        (
            max(rec[key][i]["origin_ns"] for rec in recs.values())
            - min(rec[key][i]["origin_ns"] for rec in recs.values())
        )
        / 1e6
        for i in range(n)
    ]


def _first_step(step: dict) -> dict:
    """The warm-up's first step: its time and each call's host time (compiles, first uses, checks)."""
    calls = [
        {"site": c["site"], "kind": c["kind"], "host_ms": (c["host_out_ns"] - c["host_in_ns"]) / 1e6}
        for c in step.get("calls", [])
    ]
    return {"step_ms": step["step_ms"], "wall_ms": step["wall_ms"], "calls": calls}


def summarize_collectives(recs: dict[int, dict], key: str, *, same_host: bool = True) -> dict:
    """Per rank and per site: span, wait and transfer per step (medians over steps), the skew at each
    step's first large call, bytes per step, and the collective share of the step."""
    n = min(len(rec[key]) for rec in recs.values())
    if n == 0:
        return {"collective_steps": 0}
    steps = [{r: rec[key][i]["calls"] for r, rec in recs.items()} for i in range(n)]
    split = [split_calls(s) if same_host else {r: [] for r in s} for s in steps]
    step_ms = {r: [rec[key][i]["step_ms"] for i in range(n)] for r, rec in recs.items()}
    per_rank = {}
    for r in sorted(recs):
        span = [sum(c["span_ms"] for c in s[r]) for s in split]
        wait = [sum(c["wait_ms"] or 0.0 for c in s[r]) for s in split]
        transfer = [sum(c["transfer_ms"] or 0.0 for c in s[r]) for s in split]
        per_rank[r] = {
            "span_ms": spread(span),
            "wait_ms": spread(wait),
            "transfer_ms": spread(transfer),
            "share": median([a / b for a, b in zip(span, step_ms[r], strict=True) if b > 0]),
            "wait_share": median([a / b for a, b in zip(wait, step_ms[r], strict=True) if b > 0]),
            "sent_per_step": sum(c["sent"] for c in steps[0][r]),
            "received_per_step": sum(c["received"] for c in steps[0][r]),
            "calls_per_step": len(steps[0][r]),
        }
    layout_step = median([max(step_ms[r][i] for r in recs) for i in range(n)])
    skews = [first_large_skew(s) for s in steps] if same_host else []
    spreads = [s["spread_ms"] for s in skews if s]
    return {
        "collective_steps": n,
        "collective_step_ms": layout_step,
        "collectives": per_rank,
        "sites": _sites(split),
        "skew": {
            "site": next((s["site"] for s in skews if s), None),
            "spread_ms": spread(spreads),
            "fraction_of_step": None if not spreads or not layout_step else median(spreads) / layout_step,
            "max_fraction_of_step": None if not spreads or not layout_step else max(spreads) / layout_step,
        },
        "wait_split": "inferred from arrival times" if same_host else "not computed: ranks on several hosts",
    }


def _sites(split: list[dict[int, list[dict]]]) -> list[dict]:
    """Per (kind, site), first-call order: calls per step and, per step summed over its calls, the
    medians over steps and ranks of span, wait and transfer; the largest rank's bytes sent per step."""
    order: list[tuple[str, str]] = []
    acc: dict[tuple[str, str], dict[str, list[float]]] = {}
    for s in split:
        for calls in s.values():
            per: dict[tuple[str, str], dict[str, float]] = {}
            for c in calls:
                k = (c["kind"], c["site"])
                if k not in acc:
                    order.append(k)
                    acc[k] = {"span_ms": [], "wait_ms": [], "transfer_ms": [], "sent": [], "calls": []}
                p = per.setdefault(k, {"span_ms": 0.0, "wait_ms": 0.0, "transfer_ms": 0.0, "sent": 0, "calls": 0})
                p["span_ms"] += c["span_ms"]
                p["wait_ms"] += c["wait_ms"] or 0.0
                p["transfer_ms"] += c["transfer_ms"] or 0.0
                p["sent"] += c["sent"]
                p["calls"] += 1
            for k, p in per.items():
                for f, v in p.items():
                    acc[k][f].append(v)
    rows = []
    for k in order:
        a = acc[k]
        rows.append(
            {"kind": k[0], "site": k[1], "calls_per_step": max(a["calls"]), "sent_per_step": max(a["sent"])}
            | {f: median(a[f]) for f in ("span_ms", "wait_ms", "transfer_ms")}
            | {"max_wait_ms": max(a["wait_ms"])}
        )
    return rows


def merge_digests(per_rank: list[dict[str, str]]) -> dict:
    """One digest per name over the ranks; `conflicts`: names whose replicas differ."""
    merged: dict[str, str] = {}
    conflicts = []
    for d in per_rank:
        for k, v in d.items():
            if merged.setdefault(k, v) != v:
                conflicts.append(k)
    return {"values": merged, "conflicts": sorted(set(conflicts))}


def summarize_diagnose(diag: dict[int, dict], *, same_host: bool = True) -> dict:
    """Each suspect's effect (h3lab.bench.workers.layout_diagnose): what its steps' arrivals and times say."""
    any_rank = diag[min(diag)]
    out: dict[str, Any] = {"steps": any_rank["steps"]}
    barrier = {r: {"collective_steps": d["arrival_barrier"]} for r, d in diag.items()}
    n = min(len(b["collective_steps"]) for b in barrier.values())
    measured: dict[str, list[float]] = {}
    for i in range(n):
        for calls in (split_calls({r: b["collective_steps"][i]["calls"] for r, b in barrier.items()}) or {}).values():
            for c in calls:
                measured.setdefault(c["site"], []).append(c.get("barrier_wait_ms") or 0.0)
    out["arrival_barrier"] = {
        "step_ms": spread(_layout_steps(barrier, "collective_steps")),
        "measured_wait_ms_by_site": {site: spread(v) for site, v in measured.items()},
    }
    off = {r: {"steps": d["progress_file"]["off"]} for r, d in diag.items()}
    on = {r: {"steps": d["progress_file"]["on"]} for r, d in diag.items()}
    out["progress_file"] = {
        "tick_us": {r: d["progress_file"]["tick_us"] for r, d in diag.items()},
        "write_costs_us": {r: d["progress_file"]["write_costs_us"] for r, d in diag.items()},
        "ticks_per_step": {r: d["progress_file"]["ticks_per_step"] for r, d in diag.items()},
        "host_ms_per_step": {  # as it writes now, and as the runner wrote before (whole files)
            r: {
                folder: {k: v * d["progress_file"]["ticks_per_step"] / 1e3 for k, v in cost.items()}
                for folder, cost in d["progress_file"]["write_costs_us"].items()
            }
            for r, d in diag.items()
        },
        "step_ms_off": median(_layout_steps(off)),
        "step_ms_on": median(_layout_steps(on)),
        "start_spread_ms_on": spread(_start_spreads(on, "steps")),
    }
    off = {r: {"steps": d["heartbeat"]["off"]} for r, d in diag.items()}
    on = {r: {"steps": d["heartbeat"]["on"]} for r, d in diag.items()}
    out["heartbeat"] = {"step_ms_off": median(_layout_steps(off)), "step_ms_on": median(_layout_steps(on))}
    misses = {r: d.get("triton_cache_misses") for r, d in diag.items()}
    out["triton_cache_misses"] = {
        r: None if m is None else {"count": len(m), "kernels": m[:20]} for r, m in misses.items()
    }
    out["host_syncs"] = {
        r: None if d["host_syncs"] is None else {"count": sum(d["host_syncs"].values()), "sites": d["host_syncs"]}
        for r, d in diag.items()
    }
    runner = {r: d["runner_path"] for r, d in diag.items() if "runner_path" in d}
    if len(runner) == len(diag):
        out["runner_path"] = {v: _runner_variant(runner, v, same_host) for v in ("rebuilt", "prepared")}
        out["runner_path"]["prepare_ms"] = {r: d["prepare_ms"] for r, d in runner.items()}
        out["runner_path"]["barrier"] = any_rank["runner_path"]["barrier"]
    return out


def _runner_variant(runner: dict[int, dict], variant: str, same_host: bool) -> dict:
    """Per repeat: each rank's host time from its barrier to its first collective, the arrival
    spread at the first call and at the first large one, the largest wait, each rank's block times."""
    recs = {r: {"steps": d[variant]} for r, d in runner.items()}
    n = min(len(rec["steps"]) for rec in recs.values())
    repeats = []
    for i in range(n):
        calls = {r: rec["steps"][i]["calls"] for r, rec in recs.items()}
        first = {r: (c[0]["host_in_ns"] - recs[r]["steps"][i]["origin_ns"]) / 1e6 for r, c in calls.items() if c}
        split = split_calls(calls) if same_host else {}
        waits = [c["wait_ms"] or 0.0 for cs in split.values() for c in cs]
        arrivals = [c[0]["arrive_ns"] for c in calls.values() if c]
        repeats.append(
            {
                "step_ms": max(rec["steps"][i]["step_ms"] for rec in recs.values()),
                "host_ms_to_first_collective": first,
                "first_call_site": next((c[0]["site"] for c in calls.values() if c), None),
                "first_call_spread_ms": (max(arrivals) - min(arrivals)) / 1e6 if same_host and arrivals else None,
                "first_large": first_large_skew(calls) if same_host else None,
                "max_wait_ms": max(waits) if waits else None,
                "block_timings": {r: rec["steps"][i]["block_timings"] for r, rec in recs.items()},
            }
        )
    return {"repeats": repeats}
