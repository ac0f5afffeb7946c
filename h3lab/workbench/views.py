"""What the notebooks display: headings, styled tables and figures, grouped by node type.

Each `show_*` function displays into the running notebook (IPython) and returns None, so a cell
is one call with no echo; the values come from `tables` and the frame functions here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor

from h3lab.io.jsonfile import write_json
from h3lab.metrics import error_stats
from h3lab.workbench import figures, tables
from h3lab.workbench.rundata import RunnerRun, Sweep, oracle_tensors


def _display(*objs: Any) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is not None:
            display(*objs)
    except ImportError:  # plain Python: the return values are the output
        pass


def _md(text: str) -> None:
    from IPython.display import Markdown

    _display(Markdown(text))


def _nodes(sweeps: list[Sweep]) -> list[str]:
    return list(dict.fromkeys(sw.node_type for sw in sweeps))


def show_header(sweeps: list[Sweep], title: str) -> None:
    """Title, node types, runs (id, status, date, commit) and the problem the sweep ran."""
    lines = [f"# {title}", ""]
    for sw in sweeps:
        git = sw.env.get("git", {})
        commit = (git.get("commit") or "?")[:12] + (" (dirty)" if git.get("dirty") else "")
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(sw.params.get("started", sw.path.stat().st_mtime)))
        p = sw.params
        problem = p.get("problem", p)
        what = f"block {problem.get('block')}, {problem.get('rows')} rows, " + (
            f"config {p.get('config')}, seeds {p.get('seeds')}" if "seeds" in p else f"seed {problem.get('seed')}"
        )
        lines.append(f"- **{sw.node_type}** run `{sw.run_id}`: {sw.status}; {when}; commit `{commit}`; {what}")
    text = "\n".join(lines)
    _md(text)


def show_verdicts(sweeps: list[Sweep]) -> None:
    """Per node type: layout x mode verdicts and one sentence on the deterministic mode."""
    layouts = tables.layout_frame(sweeps)
    for node in _nodes(sweeps):
        df = layouts[layouts["node_type"] == node]
        det = df[df["mode"] == "deterministic"]
        ok = int((det["status"] == "passed").sum())
        _md(
            f"### {node}\n\nDeterministic mode: **{ok} of {len(det)}** layout runs are byte-identical to the "
            "single-process block on every tensor. Baseline mode (library kernels and collectives) is shown "
            "for contrast: a mismatch there is the expected finding."
        )
        _display(tables.verdict_table(df))
        failed = df[df["status"] == "failed"]
        for _, r in failed.iterrows():
            _md(
                f"- **{r['layout']}** ({r['mode']}, seed {r['seed']}) failed on rank {r['failed_rank']}: "
                f"{r['failure']} (log `{r['log']}`)"
            )


def show_heatmaps(sweeps: list[Sweep], out_dir: Path | None = None) -> None:
    """Per node type: the layout x tensor heatmap of max ULP and fraction differing, both modes."""
    verdicts = tables.verdict_frame(sweeps)
    for node in _nodes(sweeps):
        fig = figures.verdict_heatmap(
            verdicts[verdicts["node_type"] == node],
            title=f"{node}: every layout against the single-process block of the same mode",
        )
        figures.show(fig, out_dir / "figures" / f"heatmap-{node.lower()}.png" if out_dir else None)


def show_timings(sweeps: list[Sweep]) -> None:
    """Per node type: forward/backward per rank (median, spread), collectives, deterministic / baseline."""
    ranks = tables.rank_frame(sweeps)
    for node in _nodes(sweeps):
        df = ranks[ranks["node_type"] == node] if not ranks.empty else ranks
        table = tables.timing_table(df)
        devices = ", ".join(sorted(set(df["device"].dropna().astype(str).str.split(":").str[0]))) if len(df) else "-"
        _md(f"### {node} (ranks on {devices}; seconds per block step on each rank's clock)")
        if not table.empty:
            _display(table.style.format(precision=3, na_rep="-"))


def show_element_maps(
    sweep: Sweep, layout: str = "", tensor: str = "out", *, fp64: bool = True, out_dir: Path | None = None
) -> None:
    """Per mode: the per-element ULP map of `tensor` of `layout` against the single-process block and FP64."""
    layout = layout or sweep.runs[0].layouts[-1]
    if not all(run.has_tensors(layout) for run in sweep.runs if run.record(layout)["status"] != "failed"):
        _md(
            f"*{layout}: this run kept digests, not tensors (real-size runs are pruned to save GBs): no per-element "
            "map; the verdicts above compare every tensor's digest.*"
        )
        return
    ref64 = oracle_tensors(sweep.runs[0])[tensor] if fp64 else None
    for run in sweep.runs:
        if run.seed != sweep.runs[0].seed or run.record(layout)["status"] == "failed":
            continue
        _md(f"**{layout}, {tensor}, {run.mode} mode** (batch seed {run.seed})")
        t, ref = run.tensors(layout)[tensor], run.canonical()[tensor]
        fig = figures.element_map(t, ref, ref64, name=tensor, ref_label=f"single-process {run.mode} block")
        path = out_dir / "figures" / f"elements-{run.mode}.png" if out_dir else None
        figures.show(fig, path)


def accuracy_frame(report: dict[str, Any]) -> pd.DataFrame:
    """accuracy.json as a table: relative L2 per tensor of canonical and diffusers bf16 against FP64."""
    rows = []
    for name, cols in report["tensors"].items():
        rel = {k: v["rel_l2"] if v else None for k, v in cols.items()}
        ours, theirs = rel["canonical_bf16_vs_fp64"], rel["diffusers_bf16_vs_fp64"]
        rows.append(
            {
                "tensor": name,
                "canonical bf16 vs FP64": ours,
                "diffusers bf16 vs FP64": theirs,
                "ratio": ours / theirs if ours is not None and theirs else None,
                "fp32 parity": rel["canonical_fp32_vs_diffusers_fp32"],
            }
        )
    return pd.DataFrame(rows).set_index("tensor")


def show_accuracy(sweeps: list[Sweep]) -> None:
    """The `h3lab reproduce` table of every sweep that ran it (relative L2 errors, determinism line)."""
    for sw in sweeps:
        if sw.accuracy is None:
            continue
        det = sw.accuracy["determinism"]
        verdict = "bitwise equal" if det["bitwise_equal"] else f"DIFFER in {det['tensors_differing']}"
        _md(
            f"### {sw.node_type}: `{sw.run_id}` ({sw.accuracy['rows']} rows, batch seed {sw.accuracy['seed']})\n\n"
            f"Two canonical bf16 runs: **{verdict}**; sha256(out) `{det['sha256']['out'][:16]}…`"
        )
        styled = accuracy_frame(sw.accuracy).style.format("{:.2e}", na_rep="-")
        _display(styled.format("{:.2f}", subset=["ratio"], na_rep="-"))


def environment_frame(sweeps: list[Sweep]) -> pd.DataFrame:
    """One row per run: node type, versions, devices, commit (from env.json)."""
    rows = []
    for sw in sweeps:
        e = sw.env
        gpus = e.get("gpus") or []
        rows.append(
            {
                "run": sw.run_id,
                "node type": sw.node_type,
                "device": f"{len(gpus)} x {gpus[0]['name']} ({gpus[0]['memory_gib']} GiB)"
                if gpus
                else f"CPU: {e.get('cpu', {}).get('model', '?')} x {e.get('cpu', {}).get('count', '?')}",
                "torch": e.get("torch"),
                "triton": e.get("triton"),
                "cuda": e.get("cuda"),
                "driver": e.get("driver"),
                "nccl": e.get("nccl"),
                "python": e.get("python"),
                "commit": ((e.get("git") or {}).get("describe") or "?"),
            }
        )
    return pd.DataFrame(rows).set_index("run")


def show_environment(sweeps: list[Sweep]) -> None:
    _display(environment_frame(sweeps))


# ---- explore: one layout -----------------------------------------------------------------------
def tensor_table(run: RunnerRun, layout: str) -> pd.DataFrame:
    """Per tensor of one layout: byte equality with the single-process block, differing elements, max ULP."""
    rec = run.record(layout)
    rows = [
        {
            "tensor": k,
            **{c: t.get(c) for c in ("dtype", "bitwise_equal", "num_differing", "frac_differing", "max_ulp")},
            "sha256": t["sha256_a"][:16],
        }
        for k, t in rec.get("tensors", {}).items()
    ]
    df = pd.DataFrame(rows)
    order = {name: i for i, name in enumerate(run.tensor_names)}
    return df.sort_values("tensor", key=lambda s: s.map(order)).set_index("tensor") if len(df) else df


def fp64_table(layout: dict[str, Tensor], canonical: dict[str, Tensor], fp64: dict[str, Tensor]) -> pd.DataFrame:
    """Per tensor: the layout's and the single-process block's error against the FP64 oracle."""
    rows = []
    if not fp64:  # a chain or trajectory run: the FP64 oracle is of one block
        return pd.DataFrame(columns=["tensor", "layout rel L2", "layout max ULP", "single-process max ULP"]).set_index(
            "tensor"
        )
    for name, ref in fp64.items():
        a, b = error_stats(layout[name], ref), error_stats(canonical[name], ref)
        rows.append(
            {
                "tensor": name,
                "layout rel L2": a["rel_l2"],
                "layout max abs": a["max_abs"],
                "layout max ULP": a["max_ulp_vs_rounded_ref"],
                "single-process rel L2": b["rel_l2"],
                "single-process max ULP": b["max_ulp_vs_rounded_ref"],
            }
        )
    return pd.DataFrame(rows).set_index("tensor")


def save_record(path: str | Path, **frames: pd.DataFrame) -> Path:
    """The notebook's key numbers as JSON (tests read them back): {name: records of the frame}."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {k: json.loads(v.reset_index().to_json(orient="records")) for k, v in frames.items()}
    write_json(path, record)
    return path


def show_divergence(run: RunnerRun, layout: str) -> dict[str, Any] | None:
    """The layout's first divergence from the single process, op by op (a traced run), or a note."""
    rows = run.divergence(layout)
    if rows is None:
        _md(f"*{layout}: this run recorded no op traces (run with `trace=True` / `h3lab run --trace`).*")
        return None
    _display(figures.divergence_timeline(rows, title=layout))
    first = next((r for r in rows if not r["bitwise_equal"]), None)
    _md(
        "every op is bit-identical"
        if first is None
        else f"first divergence: op {first['index']} `{first['name']}` — {first['num_differing']} elements differ, "
        f"max {first['max_ulp']} ULP"
    )
    return first
