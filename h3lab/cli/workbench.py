"""`h3lab workbench NOTEBOOK -p NAME VALUE ...`: execute a notebook through papermill into a run directory.

`h3lab workbench reproduce` (what `make reproduce` runs) executes notebooks/reproduce.py into
runs/<id>/reproduce.ipynb with a progress bar over the sweep, publishes the report to
runs/<id>/report/ (reports/<node type>[x<GPUs>]/ with --publish) and prints the verdict table, the accuracy
table and the report's path.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from h3lab.cli.report import REPORTS


def add_arguments(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("notebook", choices=["reproduce", "explore", "your_code"])
    p.add_argument(
        "-p",
        "--param",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="a parameter; VALUE is YAML: 264, true, [0, 1], 'tp2,tp4' (repeatable)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="reproduce: the run directory (default runs/<time>-<node>-<commit>-<hex>); "
        "explore, your_code: the executed notebook (default runs/<notebook>-<time>.ipynb)",
    )
    p.add_argument(
        "--publish",
        action="store_true",
        help="reproduce: publish into REPORTS/<node type>[x<GPUs>]/ instead of the run directory "
        "(`h3lab publish` regenerates a whole folder, benchmarks included)",
    )
    p.add_argument("--reports", type=Path, default=REPORTS, help=f"reports folder for --publish (default {REPORTS})")
    p.add_argument("--no-report", action="store_true", help="reproduce: do not render the report")

    def handle(a: argparse.Namespace) -> int:
        import yaml

        from h3lab.workbench import notebooks

        params = {name: yaml.safe_load(value) for name, value in a.param}
        try:
            if a.notebook in ("explore", "your_code"):
                stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
                out = a.out or _runs() / f"{a.notebook.replace('_', '-')}-{stamp}.ipynb"
                notebooks.execute(a.notebook, out, params, progress=True)
                print(f"executed notebook: {out}")
                return 0
            return _reproduce(a, params)
        except notebooks.NotebookError as err:
            print(f"h3lab workbench: {err}")
            return 2 if err.ename == "ValueError" else 1

    return handle


def _runs() -> Path:
    from h3lab.workbench.params import runs_root

    return runs_root()


def _reproduce(a: argparse.Namespace, params: dict) -> int:
    from h3lab.io.rundir import claim
    from h3lab.workbench import tables
    from h3lab.workbench.notebooks import run_reproduce
    from h3lab.workbench.publish import publish
    from h3lab.workbench.sweep import new_run_dir

    if a.out:  # claimed before anything is written: an existing sweep (or anything else) is refused
        claim(a.out, flag="--out")
    run_dir = a.out.resolve() if a.out else new_run_dir(str(params.get("device", "cpu")))
    print(f"run directory: {run_dir}")
    sweep = run_reproduce(run_dir, params)
    print(tables.terminal_summary(sweep))
    if sweep.accuracy is not None:
        print(sweep.accuracy["table"])
    for problem in sweep.record.get("problems", []):
        print(
            f"PROBLEM {problem['layout']} ({problem['mode']}, seed {problem['seed']}): {problem['status']}"
            + (
                f" on rank {problem['failed_rank']}: {problem['failure']} (log: {problem['log']})"
                if problem["failure"]
                else ""
            )
        )
    every = {True: "yes", False: "no", None: "-"}[sweep.record.get("deterministic_all_equal")]
    print(f"sweep: {sweep.status}; every deterministic layout bit-identical: {every}")
    print(f"executed notebook: {run_dir / 'reproduce.ipynb'}")
    if not a.no_report:  # into the run directory: a sweep never overwrites the committed reports/ unasked
        from h3lab.workbench.publish import folder_name, write_index

        page = publish([run_dir], a.reports / folder_name(sweep) if a.publish else run_dir / "report")
        if a.publish:
            write_index(a.reports)
        print(f"report: {page.resolve()}")
    return 0 if sweep.status == "passed" else 1
