"""`h3lab compare --layout L... -- python my_train.py ARGS`: your own script under every layout, its
records (`h3lab.record`) compared byte for byte with one process (h3lab.run.compare); the verdicts
in summary.json, the drift heatmap beside it (heatmap.png)."""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

from h3lab.parallel.layout import ALL_LAYOUTS, parse_layouts
from h3lab.run.compare import COMMAND_FORMS, CompareRequest, compare_run, format_compare


def add_arguments(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("--layout", nargs="+", required=True, metavar="L", help=f"{', '.join(ALL_LAYOUTS)} or all")
    p.add_argument("--out", type=Path, default=None, help="run directory (default runs/compare-<time>-<hex>)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch: the tp1 reference, each layout")
    p.add_argument("command", nargs=argparse.REMAINDER, help=f"after --: {COMMAND_FORMS}")

    def handle(a: argparse.Namespace) -> int:
        command = a.command[1:] if a.command[:1] == ["--"] else a.command
        out = a.out or Path("runs") / f"compare-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        req = CompareRequest(
            layouts=tuple(parse_layouts(a.layout)), command=tuple(command), out=out, timeout_s=a.timeout
        )
        summary = compare_run(req)
        print(format_compare(summary))
        if summary["layouts"]:
            try:
                from h3lab.workbench.compare_view import write_heatmap

                print(f"heatmap: {write_heatmap(summary, req.out / 'heatmap.png')}")
            except ImportError as err:  # the notebooks extra (matplotlib, pandas) is not installed
                print(f"heatmap: not drawn ({err}; pip install -e '.[notebooks]')", file=sys.stderr)
        print(f"run directory: {req.out}")
        return 0 if summary["status"] == "passed" else 1

    return handle
