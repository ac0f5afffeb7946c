"""What a layout costs: the deterministic layouts against eager TP/SP/CP at the same layout, one run.

    python -m h3lab.bench.layouts --out FILE.json --layouts tp1,tp2,tp2+sp,cp2 --rows 4096,16384 \\
        [--steps 20] [--warmup 3] [--device cuda] [--diagnose]

or `run_layout_bench(...)` (a papermill-friendly dict). One launch through h3lab.launch.launcher with one
process per GPU (NCCL; gloo on CPU) runs every layout and row count
(h3lab.bench.workers.layout_bench); a layout smaller than the launch runs on its first ranks.

Per case (layout, rows) and mode (`det`: the block under the contract, `eager`: what people run,
h3lab.reference.eager), from every rank's steps:
- step time: CUDA events around a step that starts after a host barrier of the layout's ranks and
  a device synchronisation; per rank median, p10, p90, min, max over `steps` steps, and the
  layout's step (per step, the slowest rank's time, then the median over steps);
- per collective, from `collective_steps` steps more with every call recorded: its span on the
  device (events before and after it on the stream), split into the wait for the late peer and
  the transfer. Each rank's arrival is its host origin (a CLOCK_MONOTONIC read just before the
  step's first event, recorded on an idle GPU) plus the event's offset on its own GPU; on one host
  the clock is shared, so the wait of rank r at a call is (the group's last arrival - r's arrival)
  and the transfer the rest of r's span. Its error is the spread of "host read -> event executed
  on an idle GPU" across ranks (microseconds), reported as the step-start spread; `--diagnose`
  measures the wait directly too (a one-element all_reduce before each call, timed apart);
- skew: per step, the arrival spread at its first call moving >= 1 MiB (the first large
  collective; below that size the step's largest), as a fraction of the step;
- bytes sent and received per step per rank (det: the collectives' own counts; eager:
  nccl-tests' per-rank conventions), collective share of the step, peak memory per rank (the
  whole block's weights stay alive on every rank, so `step_extra_gib`, the peak less what was
  allocated before the steps, is what the step itself needs);
- det's bits: digests of the unit slices of every weight gradient, d temb and out/dx in row blocks
  of rows/8 from one step after the timed ones, equal across ranks and to tp1's at the same rows.
The comparison per layout and rows: det, eager, det/eager, the overhead (det/eager) / (det/eager at
tp1), each one's speedup over tp1, collective shares, waits, peak memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from h3lab.config import H3Config
from h3lab.io.env import capture
from h3lab.io.jsonfile import write_json
from h3lab.launch.launcher import launch
from h3lab.parallel.layout import Layout, parse_layouts

LARGE_BYTES = 1 << 20  # a collective at least this large is "large" (the skew is read at the first one)
# the targets on the layout's overhead: (det/eager at the layout) / (det/eager at tp1)
OVERHEAD_TARGET = {4096: 1.10}
OVERHEAD_TARGET_LONG = 1.05  # rows above 4096
SKEW_TARGET = 0.01  # of the step, at the first large collective


def run_layout_bench(
    layouts: Sequence[str] | str,
    rows: Sequence[int],
    *,
    out: Path,
    config: str = "real",
    device: str | None = None,
    backend: str | None = None,
    steps: int = 20,
    warmup: int = 3,
    collective_steps: int | None = None,
    eager: bool = True,
    digests: bool = True,
    diagnose: bool = False,
    diagnose_steps: int = 5,
    diagnose_runner_steps: int = 2,
    algorithm: str = "auto",
    segment_bytes: int | None = None,
    overlap: bool = True,
    seed: int = 1,
    weights_seed: int = 0,
    timeout_s: float = 1800.0,
) -> dict:
    """Run the benchmark; returns its record (also written to `out`, the ranks' files beside it).

    Args:
        layouts: names (h3lab.parallel.layout grammar); each must fit the launch's GPUs.
        rows: row counts of the packed sequence (the eager layouts need multiples of the row shards).
        out: the JSON file; ranks' records and logs go to `<out stem>.ranks/`.
        config: "real" or "tiny".
        device, backend: "cuda"/"triton" where a GPU is, else "cpu"/"torch".
        steps, warmup: timed steps per mode and rank (the issue asks >= 20), and warm-up steps (>= 1).
        collective_steps: steps with every collective recorded (default: `steps`; 0: none).
        eager: also time the eager layout. digests: check det's bits against tp1's.
        diagnose: run the arrival-skew suspects (h3lab.bench.workers.layout_diagnose) on every layout of > 1 rank,
            at its first row count.
        algorithm, segment_bytes: the deterministic collectives' (h3lab.parallel.collectives).
        overlap: False finishes each reduction the block starts at once (no overlap with its work).
        timeout_s: the whole launch's limit.

    Returns:
        The record as written: {"request", "env", "cases": {"<layout>@<rows>": summary},
        "comparison": [...], "table": str, "missing": [...], "launch": {...}}.

    Raises:
        ValueError: unknown layouts, too few GPUs, warm-up or steps below 1.
    """
    parsed = parse_layouts(list(layouts) if not isinstance(layouts, str) else layouts)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = backend or ("triton" if device == "cuda" else "torch")
    _check(parsed, rows, config, device, steps, warmup)
    world = max(lay.world for lay in parsed)
    work = out.parent / f"{out.stem}.ranks"
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "config": config,
        "device": device,
        "backend": backend,
        "cases": [[lay.name, list(rows)] for lay in parsed],
        "steps": steps,
        "warmup": warmup,
        "collective_steps": steps if collective_steps is None else collective_steps,
        "eager": eager,
        "digests": digests,
        "diagnose": diagnose,
        "diagnose_steps": diagnose_steps,
        "diagnose_runner": diagnose and diagnose_runner_steps > 0,
        "diagnose_runner_steps": diagnose_runner_steps,
        "algorithm": algorithm,
        "segment_bytes": segment_bytes,
        "overlap": overlap,
        "seed": seed,
        "weights_seed": weights_seed,
        "timeout_s": timeout_s,
        "out_dir": str(work.resolve()),
    }
    write_json(work / "spec.json", spec)
    worker, spec_arg = "h3lab.bench.workers.layout_bench", [str((work / "spec.json").resolve())]
    res = launch(worker, spec_arg, nproc_per_node=world, log_dir=work / "logs", timeout_s=timeout_s)
    record = summarize([_read(work / f"rank{r}.json") for r in range(world)], spec)
    record["launch"] = {"ok": res.ok, "returncode": res.returncode, "timed_out": res.timed_out}
    record["launch"]["elapsed_s"] = res.elapsed_s
    if not res.ok:
        record["launch"]["agent_log_tail"] = "\n".join(p.read_text()[-4000:] for p in res.agent_logs if p.exists())
    record["env"] = capture(device)
    write_json(out, record)
    return json.loads(out.read_text())  # what a reader of the file sees (string keys for ranks)


def _check(layouts: list[Layout], rows: Sequence[int], config: str, device: str, steps: int, warmup: int) -> None:
    if not rows or any(int(r) < 1 for r in rows):
        raise ValueError(f"rows {list(rows)}; allowed: positive row counts")
    if steps < 1 or warmup < 1:
        raise ValueError(f"steps={steps}, warmup={warmup}; allowed: >= 1 each (the first warm-up step compiles)")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}; allowed: 'cpu', 'cuda'")
    c = H3Config.named(config)
    for lay in layouts:  # a layout of several nodes runs its nodes as groups of this machine's ranks
        lay.check(c)
    world = max(lay.world for lay in layouts)
    if device == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} visible; allowed: fewer ranks")


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---- statistics ---------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """median, p10, p90, min, max and n of `values` (nearest-rank percentiles)."""
    v = sorted(values)
    if not v:
        return {"n": 0, "median": None, "p10": None, "p90": None, "min": None, "max": None}
    pick = lambda q: v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]  # noqa: E731
    return {"n": len(v), "median": statistics.median(v), "p10": pick(0.1), "p90": pick(0.9), "min": v[0], "max": v[-1]}


def _median(values: Sequence[float]) -> float | None:
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


# ---- summaries ----------------------------------------------------------------------------------


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
            "share": _median([a / b for a, b in zip(span, step_ms[r], strict=True) if b > 0]),
            "wait_share": _median([a / b for a, b in zip(wait, step_ms[r], strict=True) if b > 0]),
            "sent_per_step": sum(c["sent"] for c in steps[0][r]),
            "received_per_step": sum(c["received"] for c in steps[0][r]),
            "calls_per_step": len(steps[0][r]),
        }
    layout_step = _median([max(step_ms[r][i] for r in recs) for i in range(n)])
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
            "fraction_of_step": None if not spreads or not layout_step else _median(spreads) / layout_step,
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
            | {f: _median(a[f]) for f in ("span_ms", "wait_ms", "transfer_ms")}
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
        "step_ms_off": _median(_layout_steps(off)),
        "step_ms_on": _median(_layout_steps(on)),
        "start_spread_ms_on": spread(_start_spreads(on, "steps")),
    }
    off = {r: {"steps": d["heartbeat"]["off"]} for r, d in diag.items()}
    on = {r: {"steps": d["heartbeat"]["on"]} for r, d in diag.items()}
    out["heartbeat"] = {"step_ms_off": _median(_layout_steps(off)), "step_ms_on": _median(_layout_steps(on))}
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


# ---- comparison ---------------------------------------------------------------------------------


def overhead_target(rows: int) -> float | None:
    """The issue's target on (det/eager) / (det/eager at tp1): 1.10 at 4096 rows, 1.05 above."""
    if rows in OVERHEAD_TARGET:
        return OVERHEAD_TARGET[rows]
    return OVERHEAD_TARGET_LONG if rows > 4096 else None


def compare(cases: dict[str, dict]) -> list[dict]:
    """One row per case: det and eager step times, their ratio, the overhead over tp1's ratio, each
    one's speedup over tp1, collective shares, waits, skew, peak memory, bytes, det's bits vs tp1."""
    rows = []
    for case in cases.values():
        det, eager = case.get("det"), case.get("eager")
        if det is None:
            continue
        tp1 = cases.get(f"tp1@{case['rows']}", {})
        d_ms = det["step_ms"]["median"]
        e_ms = eager["step_ms"]["median"] if eager else None
        d1 = tp1.get("det", {}).get("step_ms", {}).get("median")
        e1 = tp1.get("eager", {}).get("step_ms", {}).get("median") if tp1.get("eager") else None
        ratio = d_ms / e_ms if e_ms else None
        ratio1 = d1 / e1 if d1 and e1 else None
        overhead = ratio / ratio1 if ratio and ratio1 else None
        target = overhead_target(case["rows"])
        skew = det.get("skew", {}).get("fraction_of_step")
        rows.append(
            {
                "layout": case["layout"],
                "rows": case["rows"],
                "det_ms": d_ms,
                "eager_ms": e_ms,
                "ratio": ratio,
                "overhead": overhead,
                "overhead_target": target,
                "meets_overhead_target": None if overhead is None or target is None else overhead <= target,
                "speedup_det": d1 / d_ms if d1 else None,
                "speedup_eager": e1 / e_ms if e1 and e_ms else None,
                "det_collective_share": _max_of(det, "share"),
                "eager_collective_share": _max_of(eager, "share") if eager else None,
                "det_wait_share": _max_of(det, "wait_share"),
                "det_skew_fraction": skew,
                "meets_skew_target": None if skew is None else skew < SKEW_TARGET,
                "det_peak_gib": _max_value(det["peak_gib"]),
                "eager_peak_gib": _max_value(eager["peak_gib"]) if eager else None,
                "det_step_extra_gib": _max_value(det["step_extra_gib"]),
                "eager_step_extra_gib": _max_value(eager["step_extra_gib"]) if eager else None,
                "det_sent_per_step": max((c["sent_per_step"] for c in det.get("collectives", {}).values()), default=0),
                "eager_sent_per_step": max(
                    (c["sent_per_step"] for c in (eager or {}).get("collectives", {}).values()), default=0
                ),
                "eager_grad_sync_ms": _grad_sync(eager),
                # what eager would take with its gradient reductions hidden (as DDP overlaps them with
                # earlier blocks' backward in a model): the step less their median span
                "ratio_vs_eager_without_grad_sync": _without_sync(d_ms, e_ms, _grad_sync(eager)),
                "bits_vs_tp1": bits_vs(case, tp1),
            }
        )
    return rows


def _max_of(mode: dict, field: str) -> float | None:
    vals = [c[field] for c in mode.get("collectives", {}).values() if c.get(field) is not None]
    return max(vals) if vals else None


def _max_value(d: dict) -> float | None:
    vals = [v for v in d.values() if v is not None]
    return max(vals) if vals else None


def _grad_sync(eager: dict | None) -> float | None:
    if not eager:
        return None
    return sum(s["span_ms"] or 0.0 for s in eager.get("sites", []) if s["site"].startswith("grad_sync"))


def _without_sync(det_ms: float, eager_ms: float | None, sync_ms: float | None) -> float | None:
    if not eager_ms or sync_ms is None or sync_ms >= eager_ms:
        return None
    return det_ms / (eager_ms - sync_ms)


def bits_vs(case: dict, tp1: dict) -> dict | None:
    """det's digests against tp1's at the same rows: every name both have must agree."""
    mine = case.get("det", {}).get("digests")
    ref = tp1.get("det", {}).get("digests")
    if mine is None or ref is None:
        return None
    common = sorted(set(mine["values"]) & set(ref["values"]))
    differ = [k for k in common if mine["values"][k] != ref["values"][k]]
    equal = not differ and not mine["conflicts"] and bool(common)
    return {"equal": equal, "compared": len(common), "differ": differ[:20], "replica_conflicts": mine["conflicts"]}


def table(comparison: list[dict]) -> str:
    """The comparison as fixed-width text."""
    cols = [
        ("layout", "layout", "{}"),
        ("rows", "rows", "{}"),
        ("det_ms", "det ms", "{:.2f}"),
        ("eager_ms", "eager ms", "{:.2f}"),
        ("ratio", "det/eager", "{:.3f}"),
        ("overhead", "overhead", "{:.3f}"),
        ("speedup_det", "spd det", "{:.2f}"),
        ("speedup_eager", "spd eager", "{:.2f}"),
        ("det_collective_share", "coll det", "{:.1%}"),
        ("eager_collective_share", "coll eager", "{:.1%}"),
        ("det_wait_share", "wait det", "{:.1%}"),
        ("det_skew_fraction", "skew", "{:.2%}"),
        ("det_peak_gib", "peak det GiB", "{:.2f}"),
        ("eager_peak_gib", "peak eager GiB", "{:.2f}"),
        ("det_step_extra_gib", "step det GiB", "{:.2f}"),
        ("eager_step_extra_gib", "step eager GiB", "{:.2f}"),
    ]
    cell = lambda fmt, v: "-" if v is None else fmt.format(v)  # noqa: E731
    body = [[h for _, h, _ in cols] + ["bits"]]
    for row in comparison:
        bits = row["bits_vs_tp1"]
        verdict = "-" if bits is None else ("equal" if bits["equal"] else "DIFFER")
        body.append([cell(fmt, row[k]) for k, _, fmt in cols] + [verdict])
    widths = [max(len(line[i]) for line in body) for i in range(len(body[0]))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m h3lab.bench.layouts", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON record (ranks' files beside it)")
    ap.add_argument("--layouts", default="tp1,tp2", help="comma-separated layout names")
    ap.add_argument("--rows", default="4096", help="comma-separated row counts")
    ap.add_argument("--config", default="real", choices=("real", "tiny"))
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None)
    ap.add_argument("--backend", choices=("torch", "triton"), default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--collective-steps", type=int, default=None, help="default: --steps")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--no-digests", action="store_true")
    ap.add_argument("--diagnose", action="store_true", help="run the arrival-skew suspects too")
    ap.add_argument("--diagnose-steps", type=int, default=5)
    ap.add_argument("--diagnose-runner-steps", type=int, default=2, help="0: skip the runner path's repeats")
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--segment-bytes", type=int, default=None, help="pipelined scatter_tree segments")
    ap.add_argument("--no-overlap", action="store_true", help="finish each reduction the block starts at once")
    ap.add_argument("--timeout", type=float, default=1800.0)
    a = ap.parse_args(argv)
    try:
        record = run_layout_bench(
            a.layouts,
            [int(r) for r in a.rows.split(",") if r],
            out=a.out,
            config=a.config,
            device=a.device,
            backend=a.backend,
            steps=a.steps,
            warmup=a.warmup,
            collective_steps=a.collective_steps,
            eager=not a.no_eager,
            digests=not a.no_digests,
            diagnose=a.diagnose,
            diagnose_steps=a.diagnose_steps,
            diagnose_runner_steps=a.diagnose_runner_steps,
            algorithm=a.algorithm,
            segment_bytes=a.segment_bytes,
            overlap=not a.no_overlap,
            timeout_s=a.timeout,
        )
    except ValueError as err:
        ap.error(str(err))
    print(record["table"])
    for line in record["missing"]:
        print(f"missing: {line}", file=sys.stderr)
    return 0 if record["launch"]["ok"] and not record["missing"] else 1


if __name__ == "__main__":
    sys.exit(main())
