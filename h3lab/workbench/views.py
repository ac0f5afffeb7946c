"""What the notebooks display: headings, styled tables and figures, grouped by node type and problem.

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

from h3lab.io.env import files_changed
from h3lab.io.jsonfile import write_json
from h3lab.metrics import error_stats
from h3lab.run.steps import step_kind
from h3lab.tensorname import TensorName
from h3lab.workbench import benchmarks as bench_tables
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


def _groups(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """(node type, problem) pairs in the frame's order: each gets its own tables and figures."""
    return list(dict.fromkeys(zip(frame["node_type"], frame["problem"], strict=True))) if len(frame) else []


def _commit(sw: Sweep) -> str:
    git = sw.env.get("git") or {}
    if not git.get("commit"):
        return "commit not recorded"
    if files_changed(git):
        files = f"; its files form tree `{git['tree'][:12]}`" if git.get("tree") else ""
        return f"commit `{git['commit'][:12]}` (with changes on top{files})"
    return f"commit `{git['commit'][:12]}`"


def show_header(sweeps: list[Sweep], title: str, note: str = "") -> None:
    """Title, an optional note (markdown), and per run: node type, status, date, commit, the problem."""
    lines = [f"# {title}", ""] + ([note, ""] if note else [])
    for sw in sweeps:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(sw.params.get("started", sw.path.stat().st_mtime)))
        problems = "; ".join(dict.fromkeys(r.problem_label for r in sw.runs))
        lines.append(f"- **{sw.node_type}** run `{sw.run_id}`: {sw.status}; {when}; {_commit(sw)}; {problems}")
    _md("\n".join(lines))


def show_verdicts(sweeps: list[Sweep]) -> None:
    """Per node type and problem: layout x mode verdicts and one sentence on the deterministic mode."""
    layouts = tables.layout_frame(sweeps)
    for node, problem in _groups(layouts):
        df = layouts[(layouts["node_type"] == node) & (layouts["problem"] == problem)]
        det = df[df["mode"] == "deterministic"]
        ok = int((det["status"] == "passed").sum())
        _md(
            f"### {node}: {problem}\n\nDeterministic mode: **{ok} of {len(det)}** layout runs are byte-identical to "
            "the single-process block on every tensor. Baseline mode (library kernels and collectives), where it "
            "ran, is shown for contrast: a mismatch there is the expected finding."
        )
        _display(tables.verdict_table(df).style)  # a Styler: no cell is cut at pandas' 50 characters
        for run in _training_runs(sweeps, node, problem):
            _md("Per training step and kind of tensor, against the single process's step:")
            _display(tables.train_step_table(run.summary).style)
        failed = df[df["status"] == "failed"]
        for _, r in failed.iterrows():
            _md(
                f"- **{r['layout']}** ({r['mode']}, seed {r['seed']}) failed on rank {r['failed_rank']}: "
                f"{r['failure']} (log `{r['log']}`)"
            )


def _training_runs(sweeps: list[Sweep], node: str, problem: str) -> list[RunnerRun]:
    """The training runs (`h3lab run --train-steps`) of one node type and problem."""
    runs = [r for sw in sweeps if sw.node_type == node for r in sw.runs if r.problem_label == problem]
    return [r for r in runs if r.summary["request"]["problem"].get("task") == "train"]


def collapsed(tensor: str) -> str:
    """A tensor's column in the heatmap: chains drop the block ("block3.dw.x" -> "dw.x"), digests the
    unit slice ("dw.x@u5" -> "dw.x"), a training run's tensors go by kind ("step2.block1.w.ff.gate@u3"
    -> "weights"; loss, clip, gradients, weights); the cell is then the worst over what it gathers."""
    kind = step_kind(tensor)
    if kind is not None:
        return kind[1]
    return str(TensorName.parse(tensor).replace(block=None, unit=None))


def show_heatmaps(sweeps: list[Sweep], out_dir: Path | None = None) -> None:
    """Per node type and problem: the layout x tensor heatmap (error at RMS, p99 ULP, fraction), both modes."""
    verdicts = tables.verdict_frame(sweeps)
    for i, (node, problem) in enumerate(_groups(verdicts)):
        v = verdicts[(verdicts["node_type"] == node) & (verdicts["problem"] == problem)]
        many = v["tensor"].map(collapsed).ne(v["tensor"]).any()
        title = f"{node}, {problem}: every layout against the single-process block of the same mode"
        fig = figures.verdict_heatmap(v.assign(tensor=v["tensor"].map(collapsed)), title=title)
        if many:
            fig.suptitle(fig.get_suptitle() + "\n(each cell: the worst over blocks and unit slices)", fontsize=9)
        name = f"heatmap-{node.lower()}{f'-{i}' if i else ''}.png"
        figures.show(fig, out_dir / "figures" / name if out_dir else None)


def show_drift(sweeps: list[Sweep]) -> None:
    """Every tensor whose bits differ: sign flips, ULP percentiles, error at RMS and the maximum ULP
    distance, folded behind one click (a <details> element) so the page opens on the headline."""
    drift = tables.drift_table(tables.verdict_frame(sweeps))
    if drift.empty:
        _md("*No tensor of any layout differs from the single-process block.*")
        return
    from IPython.display import HTML

    body = drift.to_html(float_format=lambda x: f"{x:.3g}", na_rep="-")
    _display(
        HTML(f"<details><summary>{len(drift)} differing tensors: the maximum ULP and more</summary>{body}</details>")
    )


def show_benchmarks(benchmarks: dict[str, dict[str, str]]) -> None:
    """Each benchmark's steady-state table, with the machine, the commit and the command that made it.

    Args:
        benchmarks: name (h3lab.bench.registry) -> {"path": its JSON record, "command": how it was run,
            "what": one line, "commit": of the checkout that ran it}; a name with a "skipped" reason
            instead of a path is listed as not run.
    """
    if not benchmarks:
        _md("*No benchmark ran for this report: it shows no speed figures.*")
        return
    for name, entry in benchmarks.items():
        if not entry.get("path"):
            _md(f"### {name}\n\n*Not run here: {entry.get('skipped', 'no record')}.*")
            continue
        record = bench_tables.load(entry["path"])
        where = bench_tables.provenance(record, entry.get("commit"))
        _md(
            f"### {name}: {entry.get('what', '')}\n\nMachine: {where['machine']}. Commit: {where['commit']}. "
            f"Command: `{entry.get('command') or 'not recorded'}`"
        )
        table = bench_tables.table(name, record)
        _display(table.style.format(precision=3, na_rep="-") if not table.empty else table)


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
    names = sweep.runs[0].tensor_names
    if tensor not in names:  # a trajectory's or a training run's tensors are named by step
        _md(
            f"*{layout}: this run has no tensor `{tensor}`; allowed: the `element_tensor` parameter, one of "
            f"{', '.join(list(names)[:6])}, ...*"
        )
        return
    ref64 = oracle_tensors(sweep.runs[0]).get(tensor) if fp64 else None  # one block's oracle only
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
    if all(sw.accuracy is None for sw in sweeps):
        _md("*None of these runs computed the accuracy table (`accuracy=True` in the reproduce notebook).*")
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
        rows.append(
            {
                "run": sw.run_id,
                "node type": sw.node_type,
                "device": _device(e),
                "torch": e.get("torch"),
                "triton": e.get("triton"),
                "cuda": e.get("cuda"),
                "driver": e.get("driver"),
                "nccl": e.get("nccl"),
                "python": e.get("python"),
                "commit": ((e.get("git") or {}).get("describe") or "not recorded"),
            }
        )
    return pd.DataFrame(rows).set_index("run")


def _device(env: dict[str, Any]) -> str:
    """'2 x NVIDIA H200 (139.8 GiB)', 'CPU: AMD EPYC x 2', or what a brief record holds ('NVIDIA H200')."""
    gpus = env.get("gpus") or []
    if gpus:
        return f"{len(gpus)} x {gpus[0]['name']} ({gpus[0]['memory_gib']} GiB)"
    if env.get("gpu"):
        return str(env["gpu"])
    cpu = env.get("cpu") or {}
    return f"CPU: {cpu['model']} x {cpu.get('count', '?')}" if cpu.get("model") else "not recorded"


def show_environment(sweeps: list[Sweep]) -> None:
    _display(environment_frame(sweeps))


# ---- explore: one layout -----------------------------------------------------------------------
def tensor_table(run: RunnerRun, layout: str) -> pd.DataFrame:
    """Per tensor of one layout: byte equality with the single-process block, differing elements, max ULP."""
    rec = run.record(layout)
    rows = [
        {
            "tensor": k,
            **{c: t.get(c) for c in ("dtype", "bitwise_equal", "num_differing", "frac_differing", "sign_flips")},
            **{c: t.get(c) for c in ("ulp_p50", "ulp_p99", "max_ulp_at_rms", "max_ulp")},
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
