"""`h3lab report RUN...`: run directories -> a self-contained HTML report, one folder per node type.

Without `--out`, the reports go to a new folder, runs/report-<time>-<hex>/<node type>[x<GPUs>]/ with an
index.html beside them (a run on N > 1 GPUs of a node into the folder with N, on CPU into cpu/:
h3lab.workbench.publish.folder_name); `--root R` puts them in R/ instead, `--out DIR` puts one report
of every run in DIR. Nothing is written into a run it reads (the executed report notebook goes beside
the page), nor into the published reports/ (only `h3lab publish` writes there). A report folder is
built beside its place and renamed into it when complete; one that exists and holds files is
replaced only with `--force` (the previous one is then kept beside it, hidden, unless git holds it).
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

REPORTS = Path(__file__).resolve().parents[2] / "reports"  # the checkout's published reports


def add_arguments(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="sweeps (runs/<id>) or `h3lab run` folders")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="one report of all RUNs here (default: one per node type and GPU count in ROOT/<node type>[x<GPUs>]/)",
    )
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        help="folder of the per-node reports and their index.html (default: a new runs/report-<time>-<hex>/)",
    )
    p.add_argument("--force", action="store_true", help="replace a report folder (or index.html) that exists")
    p.add_argument("--title", default="", help="the report's title")
    p.add_argument("--element-layout", default="", help="layout of the per-element maps (default: the last)")
    p.add_argument("--element-tensor", default="out", help="tensor of the per-element maps (default: out)")
    p.add_argument("--no-fp64", action="store_true", help="skip the FP64 oracle (a real block's holds ~10 GB)")
    p.add_argument("--no-screenshot", action="store_true", help="skip the Chromium screenshot")
    p.add_argument(
        "--index",
        action="store_true",
        help="with --out: also rewrite DIR/../index.html to list the reports beside DIR (never done unasked)",
    )

    return _handle


def _handle(a: argparse.Namespace) -> int:
    """Every refusal before the first report is built; then one report per group, then the index."""
    root = a.root or _runs() / f"report-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    groups = _group_runs(a, root)
    _refuse_outputs(groups, a)
    status = _build_reports(groups, a)
    _update_index(a, root)
    return status


def _group_runs(a: argparse.Namespace, root: Path) -> dict[Path, list[Path]]:
    """Report folder -> its runs (`--out`, else ROOT/<node type>[x<GPUs>]); refuses an incomplete run first."""
    from h3lab.workbench.publish import folder_name
    from h3lab.workbench.rundata import load_sweep

    groups: dict[Path, list[Path]] = {}
    for run in a.runs:
        sweep = load_sweep(run)
        sweep.require_complete()  # before anything is written
        groups.setdefault(a.out or root / folder_name(sweep), []).append(run)
    return groups


def _refuse_outputs(groups: dict[Path, list[Path]], a: argparse.Namespace) -> None:
    """Raises ValueError for a report folder in reports/, inside a run it reports, or holding files without --force."""
    from h3lab.io.rundir import check_unpublished

    for out in groups:
        check_unpublished(out, "--out" if a.out else "--root")
        inside = [r for r in a.runs if out.resolve().is_relative_to(r.resolve())]
        if inside:
            raise ValueError(f"{str(out)!r} is inside the run {str(inside[0])!r} it reports; allowed: a folder outside")
        if _holds_files(out) and not a.force:
            raise ValueError(f"{str(out)!r} holds files; allowed: a new or empty folder, or --force to replace it")


def _build_reports(groups: dict[Path, list[Path]], a: argparse.Namespace) -> int:
    """Build each group's report; a stopped notebook is one line and status 1, the other reports still built."""
    from h3lab.workbench.notebooks import NotebookError

    status = 0
    for out, runs in groups.items():
        try:
            page = build(runs, out, a)
        except NotebookError as err:
            print(f"h3lab report: {err}")
            status = 1
            continue
        print(f"report: {page}")
    return status


def _update_index(a: argparse.Namespace, root: Path) -> None:
    """Rewrite the index.html beside the reports: under --out only with --index, an existing one only with --force."""
    from h3lab.io.rundir import check_unpublished
    from h3lab.workbench.publish import write_index

    index = a.out.resolve().parent / "index.html" if a.out is not None else root.resolve() / "index.html"
    if a.out is not None and not a.index:  # an index there may be the user's own
        print(f"index: not updated ({index} is left alone; --index rewrites it)")
    elif index.exists() and not a.force and a.out is None:
        print(f"index: not updated ({index} exists; --force rewrites it)")
    else:
        check_unpublished(index, "index")
        print(f"index: {write_index(index.parent)}")


def build(runs: list[Path], out: Path, a: argparse.Namespace) -> Path:
    """The report of `runs` built beside `out`, then renamed into place; returns the page at `out`."""
    from h3lab.workbench import folder as product
    from h3lab.workbench.publish import publish

    out = out.resolve()
    staging = product.staging(out.parent, out.name)
    try:
        publish(
            runs,
            staging,
            title=a.title,
            element_layout=a.element_layout,
            element_tensor=a.element_tensor,
            fp64=not a.no_fp64,
            take_screenshot=not a.no_screenshot,
        )
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # an empty folder holds nothing to keep
        kept = product.swap_in(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # ours, half-built: `out` is as it was
        raise
    if kept is not None:
        print(f"the previous {out} is kept at {kept}")
    return out / "report.html"


def _holds_files(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def _runs() -> Path:
    from h3lab.workbench.params import runs_root

    return runs_root()
