"""Publishing: run directories -> the executed report notebook -> one self-contained HTML page.

reports/<node type>/ holds report.html (no code cells, figures inline as base64 PNG, no script or
stylesheet fetched from a CDN: require.js, MathJax, mermaid and widget loaders are dropped, so it
opens offline), report.json (what reports/index.html lists), data/*.parquet (the report's frames)
and, when Chromium is installed, screenshot.png. The executed notebook, the record of how the page
was made, goes where the caller says: beside the page by default (`h3lab publish` keeps it in its
work folder); never into a run it reads.
"""

from __future__ import annotations

import html
import json
import os
import secrets
import subprocess
import time
from pathlib import Path

import nbformat

from h3lab.io.env import code_label
from h3lab.io.jsonfile import write_json
from h3lab.workbench import notebooks, tables
from h3lab.workbench.rundata import Sweep, load_sweep

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
# lab's index.html.j2 loads require.js, MathJax and mermaid from cdnjs; a report needs none of them.
# Figures carry their title as alt text (figures.show puts it in the output's metadata).
OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block data_png scoped -%}
<div class="jp-RenderedImage jp-OutputArea-output {{ extra_class }}">
<img src="data:image/png;base64,{{ output.data['image/png'] | escape_html }}"
 alt="{{ output.metadata.get('image/png', {}).get('alt', 'figure') | escape_html }}">
</div>
{%- endblock data_png -%}
"""


def chromium() -> str | None:
    """The first Chromium binary found, or None."""
    return next((c for c in CHROMIUM if Path(c).is_file()), None)


def render_html(nb: nbformat.NotebookNode, title: str) -> str:
    """The executed notebook as HTML without inputs, prompts or stderr (warnings belong to the run record)."""
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    nb = nbformat.from_dict(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr")]
    nb.metadata["title"] = title
    exporter = HTMLExporter(
        template_name="lab",
        extra_loaders=[DictLoader({"h3lab_offline.html.j2": OFFLINE_TEMPLATE})],
        template_file="h3lab_offline.html.j2",
        exclude_input=True,
        exclude_input_prompt=True,
        exclude_output_prompt=True,
    )
    body, _ = exporter.from_notebook_node(nb)
    return body


def screenshot(page: Path, png: Path, *, width: int = 1400, height: int = 2600, timeout_s: float = 120) -> Path:
    """A PNG of the page's top (width x height) through headless Chromium.

    Raises:
        FileNotFoundError: no Chromium (Debian: apt-get install -y chromium).
        RuntimeError: Chromium ran but wrote no PNG.
    """
    exe = chromium()
    if exe is None:
        raise FileNotFoundError(f"no Chromium at {list(CHROMIUM)}; Debian: apt-get install -y chromium")
    cmd = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
        f"--screenshot={png.resolve()}",
        page.resolve().as_uri(),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot (exit {res.returncode}): {res.stderr[-500:]}")
    return png


def publish(
    runs: list[str | Path],
    out_dir: str | Path,
    *,
    title: str = "",
    element_layout: str = "",
    element_tensor: str = "out",
    fp64: bool = True,
    take_screenshot: bool = True,
    benchmarks: dict[str, dict[str, str]] | None = None,
    note: str = "",
    notebook: str | Path | None = None,
) -> Path:
    """Execute the report notebook over `runs` and write out_dir/report.html (+ report.json, data/, screenshot).

    `benchmarks` (name -> {"path", "command", "what"} or {"skipped": reason}) are the speed tables;
    `note` is markdown shown under the title; `notebook` is where the executed notebook goes (default
    out_dir/report.ipynb; it must not exist: nothing is overwritten). Nothing else is written but
    out_dir: a caller reporting runs it did not make keeps out_dir outside them (`h3lab report`).

    The index of the reports beside it (out_dir/../index.html) is not touched: `write_index` is
    the caller's choice (`h3lab report` writes its new root's, `h3lab publish` the reports folder's).

    Returns:
        The HTML page's path.

    Raises:
        ValueError: a run is not finished (running, interrupted, stale, no canonical result), or the
            notebook's path exists.
        notebooks.NotebookError: the report notebook stopped (bad runs, a failed figure).
    """
    sweeps = [load_sweep(r) for r in runs]
    for sweep in sweeps:
        sweep.require_complete()
    out_dir = Path(out_dir).resolve()
    executed_path = Path(notebook).resolve() if notebook is not None else out_dir / "report.ipynb"
    if executed_path.exists():
        raise ValueError(f"report notebook {str(executed_path)!r} exists; allowed: a new path")
    out_dir.mkdir(parents=True, exist_ok=True)
    # no out_dir: the figures live inline in the page, not as files beside it
    params = {
        "runs": [str(s.path) for s in sweeps],
        "element_layout": element_layout,
        "element_tensor": element_tensor,
        "fp64": fp64,
        "benchmarks": benchmarks or {},
        "note": note,
    }
    if title:
        params["title"] = title
    executed = notebooks.execute("report", executed_path, params)
    page = out_dir / "report.html"
    page.write_text(render_html(executed, title or _title(sweeps)), encoding="utf-8")
    data = out_dir / "data"
    data.mkdir(exist_ok=True)
    tables.write_parquet(sweeps, data)
    _write_record(sweeps, out_dir, title or _title(sweeps), benchmarks or {})
    if take_screenshot and chromium() is not None:
        screenshot(page, out_dir / "screenshot.png")
    return page


def _title(sweeps: list[Sweep]) -> str:
    return "h3lab layout sweep: " + ", ".join(dict.fromkeys(folder_name(s).upper() for s in sweeps))


def folder_name(sweep: Sweep) -> str:
    """The published folder of a run: its node type, with x<N> when it ran on N > 1 GPUs (cpu, h200, h200x2).

    N is the sweep's `gpus` (params.json), else the GPUs its environment record lists.
    """
    return published_folder(sweep.node_type, sweep.params.get("gpus") or len(sweep.env.get("gpus") or []))


def published_folder(node: str, gpus: int) -> str:
    """reports/<node type> for a CPU or one GPU, <node type>x<N> for N > 1 GPUs (cpu, h200, h200x2)."""
    node = node.lower()
    return node if node == "cpu" or gpus <= 1 else f"{node}x{gpus}"


def _commit(sweep: Sweep) -> str | None:
    return code_label(sweep.env.get("git") or {})


def _write_record(sweeps: list[Sweep], out_dir: Path, title: str, benchmarks: dict[str, dict[str, str]]) -> None:
    layouts = tables.layout_frame(sweeps)
    det = layouts[layouts["mode"] == "deterministic"]
    record = {
        "title": title,
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "node_types": list(dict.fromkeys(s.node_type for s in sweeps)),
        "runs": [
            {
                "id": s.run_id,
                "status": s.status,
                "commit": _commit(s),
                "modes": sorted({r.mode for r in s.runs}),
                "problems": list(dict.fromkeys(r.problem_label for r in s.runs)),
            }
            for s in sweeps
        ],
        "layouts": list(dict.fromkeys(layouts["layout"])),
        "modes": list(dict.fromkeys(layouts["mode"])),
        "deterministic_passed": int((det["status"] == "passed").sum()),
        "deterministic_runs": len(det),
        "failed": int((layouts["status"] == "failed").sum()),
        "verdicts": _verdicts(layouts),
        "benchmarks": {k: "ran" if v.get("path") else f"not run: {v.get('skipped')}" for k, v in benchmarks.items()},
    }
    write_json(out_dir / "report.json", record)


def _verdicts(layouts) -> dict[str, dict[str, dict]]:
    """Per problem and mode: the layouts run, how many equal the single-process block, how many failed."""
    out: dict[str, dict[str, dict]] = {}
    for (problem, mode), df in layouts.groupby(["problem", "mode"], sort=False):
        out.setdefault(problem, {})[mode] = {
            "layouts": list(dict.fromkeys(df["layout"])),
            "equal": int((df["status"] == "passed").sum()),
            "runs": len(df),
            "failed": int((df["status"] == "failed").sum()),
        }
    return out


def _run_status(run: dict) -> str:
    # a baseline-only run "fails" by design: its layouts are meant to differ from the single process
    if run["status"] == "failed" and run.get("modes") == ["baseline"]:
        return "baseline: differs, as expected"
    return run["status"]


def write_index(root: str | Path) -> Path:
    """root/index.html: one row per published folder root/<name>/report.json (hidden staging and kept
    folders are not listed): the folder and its README, the report, the verdict, the runs and their
    commits, the benchmarks that ran; self-contained."""
    root = Path(root)
    rows = []
    for rec_path in sorted(p for p in root.glob("*/report.json") if not p.parent.name.startswith(".")):
        rec, d = json.loads(rec_path.read_text()), rec_path.parent.name
        has_shot = (rec_path.parent / "screenshot.png").is_file()
        shot = f' · <a href="{d}/screenshot.png">screenshot</a>' if has_shot else ""
        verdict = f"{rec['deterministic_passed']}/{rec['deterministic_runs']} deterministic layout runs bit-identical"
        verdict += f", {rec['failed']} failed" if rec["failed"] else ""
        runs = ", ".join(f"{r['id']} ({_run_status(r)}, commit {r['commit'] or 'not recorded'})" for r in rec["runs"])
        ran = [k for k, v in rec.get("benchmarks", {}).items() if v == "ran"]
        readme = f'<a href="{d}/README.md">{html.escape(d)}</a>' if (rec_path.parent / "README.md").is_file() else d
        rows.append(
            f"<tr><td>{readme}</td>"
            f'<td><a href="{d}/report.html">{html.escape(rec["title"])}</a>{shot}</td>'
            f"<td>{html.escape(verdict)}</td><td>{html.escape(', '.join(rec['layouts']))}</td>"
            f"<td>{html.escape(', '.join(ran) or '-')}</td>"
            f"<td>{html.escape(rec['generated'])}</td><td>{html.escape(runs)}</td></tr>"
        )
    page = root / "index.html"
    tmp = page.with_name(f".index.html.{secrets.token_hex(4)}.tmp")  # whole or not at all, as write_json
    try:
        tmp.write_text(_INDEX.format(rows="\n".join(rows) or '<tr><td colspan="7">no reports yet</td></tr>'))
        os.replace(tmp, page)
    finally:
        tmp.unlink(missing_ok=True)
    return page


_INDEX = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>h3lab reports</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }}
th {{ background: #f0f0f0; }}
</style></head><body>
<h1>h3lab reports</h1>
<p>One folder per node type and GPU count: every layout of the MiniMax-H3 block against the single-process block,
byte for byte, and the benchmarks' steady-state speed. Each folder's README says what holds there, where each figure
was measured and the one command that regenerates it (<code>h3lab publish --node NODE</code>; README.md here).</p>
<table><tr><th>folder</th><th>report</th><th>verdict</th><th>layouts</th><th>benchmarks</th><th>generated</th>
<th>runs</th></tr>
{rows}
</table></body></html>
"""
