"""Run directories as pandas frames, saved as parquet, and the tables the notebooks print.

Frames (one row per ...; `problem` is what was compared, RunnerRun.problem_label):
  verdicts     node type, problem, run, mode, seed, layout, tensor: byte equality, differing elements, sign flips,
               ULP percentiles, the error in ULPs at the tensor's RMS, max ULP (h3lab.metrics.compare)
  layouts      node type, problem, run, mode, seed, layout: status, tensors equal, failure (rank, reason, log)
  ranks        node type, problem, run, mode, seed, layout, rank: forward/backward/collective seconds (one
               step of a correctness run, compilation included: not a speed figure), bytes moved
  collectives  node type, problem, run, mode, seed, layout, rank, collective site: op, algorithm, bytes
Times are each rank's own clock around its forward and backward (collectives included). Speed is
read from the benchmarks (h3lab.workbench.benchmarks), never from these.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from h3lab.run.steps import KINDS as STEP_KINDS
from h3lab.workbench.rundata import RunnerRun, Sweep

KEYS = ["node_type", "problem", "run_id", "mode", "seed", "layout"]
MODE_ORDER = ["deterministic", "baseline"]


def _runs(sweeps: Iterable[Sweep]) -> Iterable[tuple[dict, RunnerRun, str, dict]]:
    for sw in sweeps:
        for run in sw.runs:
            for layout, rec in run.summary["layouts"].items():
                keys = {"node_type": sw.node_type, "problem": run.problem_label, "run_id": sw.run_id}
                yield keys | {"mode": run.mode, "seed": run.seed, "layout": layout}, run, layout, rec


VERDICT_FIELDS = (
    "dtype",
    "bitwise_equal",
    "num_elements",
    "num_differing",
    "frac_differing",
    "max_ulp",
    "nan_mismatches",
    "sign_flips",
    "ulp_p50",
    "ulp_p99",
    "max_abs_diff",
    "ref_rms",
    "max_ulp_at_rms",
)


def verdict_frame(sweeps: Iterable[Sweep]) -> pd.DataFrame:
    """Per tensor of every layout: byte equality with the same mode's single-process block, max ULP.

    A layout that failed (no result) gets one row per tensor with missing verdicts, so figures show it.
    """
    rows = []
    for keys, run, _, rec in _runs(sweeps):
        tensors = rec.get("tensors") or {name: None for name in run.tensor_names}
        names = run.tensor_names  # a summary kept without its run's files: the verdicts name the rest
        for name in names + [k for k in tensors if k not in names]:
            t = tensors.get(name)
            # a digest-only verdict (`h3lab run --digests`) has bitwise_equal alone: the rest stays missing
            fields = {c: (t or {}).get(c) for c in VERDICT_FIELDS}
            for c in ("ulp_p50", "ulp_p99"):  # recorded as None: no element left besides sign flips
                fields[c] = 0 if t and c in t and t[c] is None else fields[c]
            rows.append(keys | {"layout_status": rec["status"], "tensor": name} | fields)
    df = pd.DataFrame(rows)
    for col in ("max_abs_diff", "ref_rms", "max_ulp_at_rms"):
        if col in df:
            df[col] = df[col].astype("Float64")
    for col, dtype in (("bitwise_equal", "boolean"), *((c, "Int64") for c in INT_FIELDS)):
        if col in df:
            df[col] = df[col].astype(dtype)
    return df


INT_FIELDS = ("max_ulp", "num_differing", "sign_flips", "ulp_p50", "ulp_p99")


def _worst_ulp(tensors: dict[str, dict], key: str = "max_ulp") -> int | float | None:
    """The largest `key` over the tensors whose bits differ (0 when none differ); unknown (None) when a
    differing one does not record it (a digest-only verdict, or a record older than the field). A
    recorded None (no element left to take a percentile of, no scale) counts as 0."""
    differing = [t for t in tensors.values() if not t["bitwise_equal"]]
    if any(key not in t for t in differing):
        return None
    return max((t[key] or 0 for t in differing), default=0 if tensors else None)


def _of_rms(t: dict) -> dict:
    """The tensor's verdict with "of_rms": max |a - b| / RMS of the reference, a fraction comparable
    across dtypes (absent when the record holds no drift; None when the reference is all zero)."""
    if "max_abs_diff" not in t or "ref_rms" not in t:
        return t
    rms = t["ref_rms"]
    return t | {"of_rms": t["max_abs_diff"] / rms if rms else None}


def layout_frame(sweeps: Iterable[Sweep]) -> pd.DataFrame:
    """Per layout of every run: status, how many tensors are byte-equal, the worst ULP, the failure."""
    rows = []
    for keys, _, _, rec in _runs(sweeps):
        tensors = rec.get("tensors", {})
        failure = rec.get("failure") or {}
        rows.append(
            keys
            | {
                "status": rec["status"],
                "world": rec.get("world"),
                "tensors_equal": sum(t["bitwise_equal"] for t in tensors.values()) if tensors else None,
                "tensors": len(tensors) if tensors else None,
                "max_ulp": _worst_ulp(tensors),
                "ulp_p99": _worst_ulp(tensors, "ulp_p99"),
                "max_ulp_at_rms": _worst_ulp(tensors, "max_ulp_at_rms"),
                "max_err_of_rms": _worst_ulp({k: _of_rms(t) for k, t in tensors.items()}, "of_rms"),
                "sign_flips": sum(t.get("sign_flips") or 0 for t in tensors.values()) if tensors else None,
                "launch_s": rec.get("launch", {}).get("elapsed_s"),
                "failed_rank": failure.get("rank"),
                "failure": failure.get("reason"),
                "log": failure.get("log"),
            }
        )
    df = pd.DataFrame(rows)
    for col in ("tensors_equal", "tensors", "max_ulp", "ulp_p99", "sign_flips", "failed_rank"):
        if col in df:
            df[col] = df[col].astype("Int64")
    for col in ("max_ulp_at_rms", "max_err_of_rms"):
        if col in df:
            df[col] = df[col].astype("Float64")
    return df


def rank_frame(sweeps: Iterable[Sweep]) -> pd.DataFrame:
    """Per rank: its forward, backward and collective seconds and the bytes its collectives moved."""
    rows = []
    for keys, run, layout, rec in _runs(sweeps):
        if "ranks" not in rec:
            continue
        for r in run.rank_records(layout):
            dec = r.get("decisions", [])
            rows.append(
                keys
                | {
                    "rank": r["rank"],
                    "device": r.get("device"),
                    "transport": r.get("transport"),
                    **{k: r["timings"].get(k) for k in ("forward_s", "backward_s", "collective_s")},
                    "collective_calls": sum(d.get("calls", 1) for d in dec),
                    "bytes_sent": sum(d.get("bytes_sent_total", 0) for d in dec),
                    "bytes_received": sum(d.get("bytes_received_total", 0) for d in dec),
                    "bytes_local": sum(d.get("bytes_local_total", 0) for d in dec),
                }
            )
    return pd.DataFrame(rows)


def collective_frame(sweeps: Iterable[Sweep]) -> pd.DataFrame:
    """Per collective site of every rank: the decision (op, algorithm, tree), its calls, bytes and seconds."""
    rows = []
    for keys, run, layout, rec in _runs(sweeps):
        if "ranks" not in rec:
            continue
        for r in run.rank_records(layout):
            rows += [keys | {"rank": r["rank"]} | _decision_row(d) for d in r.get("decisions", [])]
    return pd.DataFrame(rows)


def _decision_row(d: dict) -> dict:
    group = d.get("group") or {}
    return {
        "site": d.get("site"),
        "op": d.get("op"),
        "algorithm": d.get("algorithm"),
        "tree": d.get("tree"),
        "group": str(group.get("ranks")),
        "dtype": str(d.get("dtype", "")).removeprefix("torch."),
        "numel": d.get("numel"),
        "calls": d.get("calls"),
        "bytes_sent": d.get("bytes_sent_total"),
        "bytes_received": d.get("bytes_received_total"),
        "seconds": d.get("seconds_total"),
        "transport": d.get("transport"),
        "reason": d.get("reason"),
    }


def decision_table(run: RunnerRun, layout: str, rank: int = 0) -> pd.DataFrame:
    """The collective decisions one rank of one layout took: what each site did and why."""
    records = run.rank_records(layout)
    if not 0 <= rank < len(records):
        raise ValueError(f"rank {rank} not in layout {layout!r}; allowed: 0..{len(records) - 1}")
    return pd.DataFrame([_decision_row(d) for d in records[rank].get("decisions", [])])


def verdict_table(layouts: pd.DataFrame) -> pd.DataFrame:
    """Layout x mode: 'passed 15/15', 'mismatch: 15 of 15 differ, max |a-b| 2.1e-02 of RMS, 3 sign flips'
    or 'failed (rank 3)', over seeds (a mismatch counts the tensors that differ, never those equal).
    Per tensor, and the maximum ULP distance: `drift_table`."""

    def worst(r: pd.Series) -> str:
        if r["status"] == "passed":
            return ""
        if not pd.isna(r.get("max_err_of_rms", pd.NA)):
            n = 0 if pd.isna(r.get("sign_flips", 0)) else int(r["sign_flips"])
            flips = f", {n} sign flips" if n else ""
            return f", max |a-b| {r['max_err_of_rms']:.1e} of RMS{flips}"
        return " (by digest)" if pd.isna(r["max_ulp"]) else f", max {r['max_ulp']} ULP"

    def cell(rows: pd.DataFrame) -> str:
        parts = []
        for _, r in rows.iterrows():
            if pd.isna(r["tensors"]):
                parts.append(f"{r['status']} (rank {r['failed_rank']})")
            else:
                parts.append(_count(r["status"], r["tensors_equal"], r["tensors"]) + worst(r))
        return "; ".join(dict.fromkeys(parts))

    table = layouts.groupby(["layout", "mode"], sort=False).apply(cell, include_groups=False).unstack("mode")
    table = table.reindex(columns=[m for m in MODE_ORDER if m in table.columns])
    return table.reindex(list(dict.fromkeys(layouts["layout"])))


DRIFT_COLUMNS = {
    "num_differing": "differing",
    "frac_differing": "fraction",
    "sign_flips": "sign flips",
    "ulp_p50": "p50 ULP",
    "ulp_p99": "p99 ULP",
    "max_ulp_at_rms": "max ULP at RMS",
    "max_abs_diff": "max |a-b|",
    "ref_rms": "RMS",
    "max_ulp": "max ULP",
}


def drift_table(verdicts: pd.DataFrame) -> pd.DataFrame:
    """Per node type, problem, mode, layout and tensor whose bits differ: how many elements, the sign
    flips, the ULP percentiles, the error at the tensor's RMS, and the maximum ULP distance (worst over
    seeds; one problem's tensors never mix with another's)."""
    differs = verdicts[verdicts["bitwise_equal"].eq(False).fillna(False).astype(bool)]
    cols = [c for c in DRIFT_COLUMNS if c in differs]
    if differs.empty:
        return pd.DataFrame(columns=list(DRIFT_COLUMNS.values()))
    keys = [k for k in ("node_type", "problem", "mode", "layout", "tensor") if k in differs]
    table = differs.groupby(keys, sort=False)[cols].max()
    return table.rename(columns=DRIFT_COLUMNS)


def write_parquet(sweeps: list[Sweep], out: Path) -> dict[str, Path]:
    """verdicts/layouts/ranks/collectives.parquet under `out`; returns their paths."""
    frames = {
        "verdicts": verdict_frame(sweeps),
        "layouts": layout_frame(sweeps),
        "ranks": rank_frame(sweeps),
        "collectives": collective_frame(sweeps),
    }
    paths = {}
    for name, df in frames.items():
        paths[name] = out / f"{name}.parquet"
        df.to_parquet(paths[name], index=False)
    return paths


def terminal_summary(sweep: Sweep) -> str:
    """The sweep in a fixed-width table: per layout and mode, the verdict and the slowest rank's fwd+bwd
    seconds of its one correctness step (compilation included: a sign of life, not a speed figure)."""
    layouts, ranks = layout_frame([sweep]), rank_frame([sweep])
    verdicts = verdict_table(layouts)
    step = (
        ranks.assign(step=ranks["forward_s"] + ranks["backward_s"]).groupby(["layout", "mode"])["step"].max()
        if not ranks.empty
        else pd.Series(dtype=float)
    )
    modes = list(verdicts.columns)
    width = max(28, *(len(str(v)) + 2 for v in verdicts.to_numpy().ravel()))
    head = f"{'layout':<12}" + "".join(f"{m:<{width}}{'1st step s':>10}  " for m in modes)
    lines = [head, "-" * len(head)]
    for layout, row in verdicts.iterrows():
        cells = []
        for m in modes:
            t = step.get((layout, m), float("nan"))
            cells.append(f"{row[m]!s:<{width}}{t:>10.3f}  ")
        lines.append(f"{layout:<12}" + "".join(cells))
    return "\n".join(lines)


def _count(status: str, equal: int, total: int) -> str:
    """'passed 15/15' (all equal) or 'mismatch: 3 of 15 differ' (a count of those that differ)."""
    if status == "passed":
        return f"passed {equal}/{total}"
    return f"{status}: {int(total) - int(equal)} of {total} differ"


def train_step_table(summary: dict) -> pd.DataFrame:
    """A training run's verdicts (`h3lab run --train-steps N`), one row per layout and step: the step's
    verdict and, per kind of tensor (loss, clip, gradients, weights), 'passed 3/3' or 'mismatch: 1 of
    62 differ' against the single process. Read from summary.json (h3lab.run.steps); a layout without per-step
    verdicts (it failed to run) is one row with its status and no step."""
    rows = []
    for layout, rec in summary["layouts"].items():
        if not rec.get("steps"):
            rows.append({"layout": layout, "step": None, "verdict": rec["status"]})
        for step, v in rec.get("steps", {}).items():
            row = {"layout": layout, "step": int(step), "verdict": "passed" if v["bitwise_equal"] else "mismatch"}
            for kind in STEP_KINDS:
                if kind in v:
                    c = v[kind]
                    row[kind] = _count("passed" if c["bitwise_equal"] else "mismatch", c["equal"], c["total"])
            rows.append(row)
    return pd.DataFrame(rows, columns=["layout", "step", "verdict", *STEP_KINDS]).astype({"step": "Int64"})
