"""`h3lab workbench NOTEBOOK -p NAME VALUE ...`: execute a notebook through papermill into a run directory.

`h3lab workbench reproduce` (what `make reproduce` runs) executes notebooks/reproduce.py into
runs/<id>/reproduce.ipynb with a progress bar over the sweep, renders the report into runs/<id>/report/
and prints the verdict table, the accuracy table and the report's path (the published reports/ are
`h3lab publish`'s). `h3lab workbench explore` writes the executed notebook and its key numbers
(<out>.json) to new files, never into the run it explores; `--force` replaces existing ones once the
notebook has ended.
"""

from __future__ import annotations

import argparse
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path


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
        "explore: the executed notebook, its key numbers beside it as .json (default runs/explore-<time>-<hex>.ipynb); "
        "your_code: the executed notebook (default runs/your-code-<time>-<hex>.ipynb)",
    )
    p.add_argument("--force", action="store_true", help="explore: replace an existing --out (and its .json)")
    p.add_argument("--no-report", action="store_true", help="reproduce: do not render the report")

    def handle(a: argparse.Namespace) -> int:
        import yaml

        from h3lab.workbench import notebooks

        params = {name: yaml.safe_load(value) for name, value in a.param}
        try:
            if a.notebook == "explore":
                return _explore(a, params)
            if a.notebook == "your_code":
                return _your_code(a, params)
            if a.force:
                raise ValueError(
                    "--force with reproduce; allowed: --force with explore (a run folder is never replaced)"
                )
            return _reproduce(a, params)
        except notebooks.NotebookError as err:
            print(f"h3lab workbench: {err}")
            return 2 if err.ename == "ValueError" else 1

    return handle


def _explore(a: argparse.Namespace, params: dict) -> int:
    """The explore notebook into new files (`--force`: built beside, then renamed over the old ones)."""
    from h3lab.io.rundir import check_unpublished
    from h3lab.workbench import notebooks

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = a.out or _runs() / f"explore-{stamp}-{secrets.token_hex(2)}.ipynb"
    if out.suffix != ".ipynb":
        raise ValueError(f"--out {str(out)!r}; allowed: a path ending in .ipynb (its key numbers go beside, .json)")
    record = out.with_suffix(".json")
    check_unpublished(out, "--out")
    existing = [str(p) for p in (out, record) if os.path.lexists(p)]
    if existing and not a.force:
        raise ValueError(f"--out: {existing} exist; allowed: a new path, or --force to replace them")
    if "record" in params:
        raise ValueError("-p record: the key numbers go beside --out (<out>.json); allowed: --out")
    targets, suffix = (out, record), f".{secrets.token_hex(3)}.tmp"
    built = tuple(t.with_name(f".{t.name}{suffix}") for t in targets) if existing else targets
    ended = False  # the notebook ran to its end or stopped in a cell: its files are the new record
    try:
        notebooks.execute("explore", built[0], params | {"record": str(built[1])}, progress=True)
        ended = True
    except notebooks.NotebookError as err:  # it names the notebook where it will be
        ended = True
        raise notebooks.NotebookError("explore", err.cell, err.ename, err.evalue, out) from None
    finally:
        for new, old in zip(built, targets, strict=True) if existing else ():
            if ended and new.exists():
                os.replace(new, old)
            elif ended:
                old.unlink(missing_ok=True)  # replaced by nothing: no stale record beside a new notebook
            else:  # Ctrl-C, a signal: the old files stay
                new.unlink(missing_ok=True)
    print(f"executed notebook: {out}")
    return 0


def _your_code(a: argparse.Namespace, params: dict) -> int:
    """The your_code notebook into a new file: an existing --out is refused (its compare run has a
    folder of its own, `-p run_dir`, which must be new or empty)."""
    from h3lab.io.rundir import check_unpublished
    from h3lab.workbench import notebooks

    if a.force:
        raise ValueError("--force with your_code; allowed: --force with explore (give a new --out)")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = a.out or _runs() / f"your-code-{stamp}-{secrets.token_hex(2)}.ipynb"
    if out.suffix != ".ipynb":
        raise ValueError(f"--out {str(out)!r}; allowed: a path ending in .ipynb")
    check_unpublished(out, "--out")
    if os.path.lexists(out):
        raise ValueError(f"--out {str(out)!r} exists; allowed: a new path")
    notebooks.execute("your_code", out, params, progress=True)
    print(f"executed notebook: {out}")
    return 0


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
    if not a.no_report:  # into the run directory: the published reports/ are h3lab publish's
        page = publish([run_dir], run_dir / "report")
        print(f"report: {page.resolve()}")
    return 0 if sweep.status == "passed" else 1
