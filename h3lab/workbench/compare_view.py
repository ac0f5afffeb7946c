"""`h3lab compare`'s summary as a frame, a per-record table and the drift heatmap (h3lab.workbench.figures).

Columns of the heatmap: a record named `step{k}.<kind>...` (`loss`, `grad_norm`, `dw.<parameter>`,
`w.<parameter>`: h3lab.run.steps) goes under its kind, any other record under the first part of its
name (`final.proj_in.weight` under `final`); each cell is the worst over what it gathers. A layout
that failed has no verdicts: its row is dark. The per-record table has every record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from h3lab.run.steps import step_kind
from h3lab.workbench import figures
from h3lab.workbench.tables import VERDICT_FIELDS
from h3lab.workbench.views import collapsed


def verdict_rows(summary: dict[str, Any]) -> pd.DataFrame:
    """One row per layout and record: its verdict fields (h3lab.metrics.compare); missing for a failed layout."""
    names = [name for name, _ in (summary.get("canonical") or {}).get("order", [])]
    rows = []
    for layout, rec in summary["layouts"].items():
        tensors = rec.get("tensors") or {}
        for name in names:
            t = tensors.get(name) or {}
            rows.append(
                {"mode": "deterministic", "layout": layout, "tensor": name} | {c: t.get(c) for c in VERDICT_FIELDS}
            )
    df = pd.DataFrame(rows)
    for col in ("max_abs_diff", "ref_rms", "max_ulp_at_rms", "frac_differing"):
        df[col] = df[col].astype("Float64")
    df["bitwise_equal"] = df["bitwise_equal"].astype("boolean")
    for col in ("max_ulp", "num_elements", "num_differing", "sign_flips", "ulp_p50", "ulp_p99"):
        df[col] = df[col].astype("Int64")
    return df


def record_table(summary: dict[str, Any]) -> pd.DataFrame:
    """Record x layout: "equal", "differs: N of M, max ULP U", or the layout's status when it has no verdict."""
    frame = verdict_rows(summary)

    def cell(row: pd.Series) -> str:
        if pd.isna(row["bitwise_equal"]):
            return summary["layouts"][row["layout"]]["status"]
        if row["bitwise_equal"]:
            return "equal"
        return f"differs: {row['num_differing']} of {row['num_elements']}, max ULP {row['max_ulp']}"

    table = frame.assign(verdict=frame.apply(cell, axis=1)).pivot(index="tensor", columns="layout", values="verdict")
    return table.reindex(index=list(dict.fromkeys(frame["tensor"])), columns=list(summary["layouts"]))


def heatmap(summary: dict[str, Any]) -> figures.Figure:
    """Layout x record (or kind) of the verdicts: error at RMS, p99 ULP, fraction differing."""
    frame = verdict_rows(summary)
    title = f"h3lab compare: {summary['request']['script']} under every layout against one process (tp1)"
    return figures.verdict_heatmap(frame.assign(tensor=frame["tensor"].map(column)), title=title)


def column(name: str) -> str:
    """The heatmap column of record `name` (module docstring)."""
    return collapsed(name) if step_kind(name) is not None else name.split(".", 1)[0]


def write_heatmap(summary: dict[str, Any], path: Path) -> Path:
    """The heatmap as a PNG at `path` (a new file)."""
    path.write_bytes(figures.png_bytes(heatmap(summary)))
    return path


def parameter_table(summary: dict[str, Any], kind: str = "w") -> pd.DataFrame:
    """Parameter x (layout, step): the verdict of every `step{k}.{kind}.<parameter>` record ("w": the
    weights after each step, "dw": the gradients), as `record_table` words it; parameters in the
    script's order."""
    table = record_table(summary)
    parts = table.index.to_series().str.extract(rf"^step(\d+)\.{kind}\.(.+)$")
    keep = parts[0].notna()
    out = table[keep.to_numpy()].copy()
    out.index = pd.MultiIndex.from_arrays([parts[1][keep], parts[0][keep].astype(int)], names=["parameter", "step"])
    return out.unstack("step").reindex(index=list(dict.fromkeys(parts[1][keep])))
