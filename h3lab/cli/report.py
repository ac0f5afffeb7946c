"""`h3lab report RUN...`: run directories -> a self-contained HTML report under reports/<node type>[x<GPUs>]/.

A run on N > 1 GPUs of a node publishes into the folder with N (reports/h200x2/), on one GPU into
reports/h200/, on CPU into reports/cpu/ (h3lab.workbench.publish.folder_name).
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--root", type=Path, default=REPORTS, help=f"reports folder holding index.html (default {REPORTS})")
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

    def handle(a: argparse.Namespace) -> int:
        from h3lab.workbench.notebooks import NotebookError
        from h3lab.workbench.publish import folder_name, publish, write_index
        from h3lab.workbench.rundata import load_sweep

        groups: dict[Path, list[Path]] = {}
        for run in a.runs:
            sweep = load_sweep(run)
            sweep.require_complete()  # before anything is written
            groups.setdefault(a.out or a.root / folder_name(sweep), []).append(run)
        status = 0
        for out, runs in groups.items():
            try:
                page = publish(
                    runs,
                    out,
                    title=a.title,
                    element_layout=a.element_layout,
                    element_tensor=a.element_tensor,
                    fp64=not a.no_fp64,
                    take_screenshot=not a.no_screenshot,
                )
            except NotebookError as err:
                print(f"h3lab report: {err}")
                status = 1
                continue
            print(f"report: {page}")
        root = a.root.resolve()
        if a.out is not None and a.index:  # asked for: the index of the reports beside --out
            print(f"index: {write_index(a.out.resolve().parent)}")
        elif all(out.resolve().is_relative_to(root) for out in groups):
            print(f"index: {write_index(root)}")
        else:  # a report written elsewhere (--out): an index there may be the user's own
            print(f"index: not updated ({a.out.resolve().parent / 'index.html'} is left alone; --index rewrites it)")
        return status

    return handle
