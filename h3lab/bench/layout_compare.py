"""The layout benchmark's comparison (h3lab.bench.layouts): per layout and rows, det against eager and
both against tp1, against the targets on the overhead and the skew, and the comparison as a table."""

from __future__ import annotations

# the targets on the layout's overhead: (det/eager at the layout) / (det/eager at tp1)
OVERHEAD_TARGET = {4096: 1.10}
OVERHEAD_TARGET_LONG = 1.05  # rows above 4096
SKEW_TARGET = 0.01  # of the step, at the first large collective


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
