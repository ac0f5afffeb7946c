"""`h3lab publish --node NODE`: regenerate reports/<node type>[x<GPUs>]/ with one command.

Stages, in this order, each resumable in the work folder (h3lab.workbench.stages):
  sweeps       the reproduce notebook through papermill, one run directory each (h3lab.workbench.plans)
  benchmarks   every benchmark of h3lab.bench.registry that has arguments for the node, a process each
  render       the report notebook over the sweeps and the benchmark records into a folder built beside
               the published one and swapped in when complete; reports/index.html refreshed
A stage done in an earlier call is kept (`--redo` runs it again); `--only` runs just the stages named,
so a GPU node's folder is made in a few calls of bounded length (reports/README.md lists them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from h3lab.cli.report import REPORTS


def add_arguments(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from h3lab.bench.registry import NODE_TYPES

    p.add_argument("--node", required=True, choices=NODE_TYPES, help="the node type of this machine")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every GPU torch sees; cpu: 0)")
    p.add_argument("--work", type=Path, default=None, help="work folder (default runs/publish-<folder>)")
    p.add_argument("--reports", type=Path, default=REPORTS, help=f"reports folder (default {REPORTS})")
    p.add_argument("--only", default="", metavar="STAGES", help="run only these stages now (comma-separated)")
    p.add_argument("--redo", default="", metavar="STAGES", help="run these stages again even if done")
    p.add_argument("--partial", action="store_true", help="render even if a benchmark is not done (said so)")
    p.add_argument("--no-screenshot", action="store_true", help="skip the Chromium screenshot")
    p.add_argument("--list", action="store_true", help="print the stages and their states; run nothing")

    def handle(a: argparse.Namespace) -> int:
        from h3lab.bench.registry import plan
        from h3lab.io.rundir import read_record
        from h3lab.workbench import plans
        from h3lab.workbench.notebooks import NotebookError
        from h3lab.workbench.publish import published_folder
        from h3lab.workbench.stages import StageBook

        gpus = _gpus(a.node, a.gpus)
        folder = published_folder(a.node, gpus)
        benches = {p.bench.name: p for p in plan(a.node, gpus)}
        sweeps = plans.sweeps(a.node)
        names = [*sweeps, *benches, "render"]
        only, redo = _names(a.only, names, "--only"), _names(a.redo, names, "--redo")
        book = StageBook(a.work or Path("runs") / f"publish-{folder}")
        if a.list:
            book.record = read_record(book.path) or {"stages": {}}
            return _print_states(book, names)
        book.claim({"node": a.node, "gpus": gpus, "folder": folder})
        print(f"publish {folder}: work folder {book.work}")
        try:
            for name in (n for n in names if not only or n in only):
                if name in sweeps:
                    fn = lambda n=name: _sweep(book, n, sweeps[n] | {"gpus": gpus})  # noqa: E731
                elif name in benches:
                    fn = lambda n=name: _bench(book, benches[n], gpus)  # noqa: E731
                elif (why := _not_ready(book, sweeps, benches, a.partial)) and "render" not in only:
                    print(f"render: not run now: {why}")  # asked for by name, it is refused below instead
                    continue
                else:
                    fn = lambda: _render(book, a, folder, gpus, sweeps, benches)  # noqa: E731
                rec = book.run(name, fn, redo=name in redo)
                print(f"{name}: {_line(rec)}", flush=True)
        except NotebookError as err:  # a sweep's notebook stopped: its stage says failed, with the cell
            print(f"h3lab publish: {err}")
        finally:
            book.release()
        return _print_states(book, names)

    return handle


def _not_ready(book, sweeps: dict, benches: dict, partial: bool) -> str:
    """Why the render cannot run yet ("" when it can)."""
    missing = [n for n in sweeps if not book.done(n)]
    if missing:
        return f"sweeps {missing} are not done"
    open_ = [n for n in benches if book.state(n).get("state") not in ("done", "skipped")]
    return f"benchmarks {open_} are not done (--partial renders without them)" if open_ and not partial else ""


def _gpus(node: str, gpus: int | None) -> int:
    """The GPUs of this publish, checked against the machine: this must be a `node` node."""
    from h3lab.bench.registry import NODE_TYPES
    from h3lab.io.env import node_type

    if node == "cpu":
        if gpus:
            raise ValueError(f"--gpus {gpus} with --node cpu; allowed: 0")
        return 0
    import torch

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    here = node_type("cuda").lower() if seen else "cpu"
    if here not in NODE_TYPES:
        raise ValueError(
            f"--node {node}, but this machine's GPU is {here!r}, a node type publish has no folder for; "
            f"allowed: a node of {list(NODE_TYPES)} (h3lab verify prints this machine's digests)"
        )
    if here != node:
        raise ValueError(f"--node {node}, but this machine is a {here} node; allowed: --node {here}")
    if gpus is not None and not 1 <= gpus <= seen:
        raise ValueError(f"--gpus {gpus}; allowed: 1..{seen} (the GPUs torch sees)")
    return gpus or seen


def _names(value: str, allowed: list[str], flag: str) -> set[str]:
    names = {v for v in value.split(",") if v}
    if names - set(allowed):
        raise ValueError(f"{flag} {sorted(names - set(allowed))}; allowed: {allowed}")
    return names


def _sweep(book, name: str, params: dict[str, Any]) -> dict[str, Any]:
    from h3lab.io.rundir import claim
    from h3lab.workbench.notebooks import run_reproduce

    run_dir = book.attempt(name)
    claim(run_dir, flag="run directory")
    sweep = run_reproduce(run_dir, params)
    problems = [f"{p['layout']} ({p['mode']}): {p['status']}" for p in sweep.record.get("problems", [])]
    state = "done" if sweep.status == "passed" else "failed"
    return {"state": state, "output": str(run_dir), "status": sweep.status, "problems": problems}


def _bench(book, planned, gpus: int) -> dict[str, Any]:
    from h3lab.workbench.stages import log_tail, run_command
    from h3lab.workbench.sweep import first_gpus

    b = planned.bench
    if planned.argv is None:
        return {"state": "skipped", "reason": planned.skipped}
    out = book.attempt(b.name, "" if b.record_in else ".json")
    env = dict(os.environ)
    if gpus:  # the first `gpus` of the GPUs this process sees
        env["CUDA_VISIBLE_DEVICES"] = first_gpus(gpus, env.get("CUDA_VISIBLE_DEVICES"))
    res = run_command(
        [sys.executable, *planned.argv, "--out", str(out)], out.with_suffix(".log"), env=env, timeout_s=b.timeout_s
    )
    record = out / b.record_in if b.record_in else out
    command = " ".join(["python", *planned.argv, "--out", b.output])
    if res["returncode"] == 0 and record.is_file():
        return {"state": "done", "output": str(record), "command": command, "log": res["log"], "commit": _commit()}
    why = f"timed out after {b.timeout_s:.0f} s" if res["timed_out"] else f"exit status {res['returncode']}"
    return {"state": "failed", "error": f"{why}: {log_tail(res['log'])}", "command": command, "log": res["log"]}


def _render(book, a: argparse.Namespace, folder: str, gpus: int, sweeps: dict, benches: dict) -> dict[str, Any]:
    from h3lab.workbench import folder as product
    from h3lab.workbench.publish import publish, write_index

    why = _not_ready(book, sweeps, benches, a.partial)
    if why:
        raise ValueError(f"render: {why}; allowed: render once every sweep and benchmark stage is done")
    benchmarks = {}
    for name, planned in benches.items():
        st = book.state(name)
        entry = {"what": planned.bench.what, "output": planned.bench.output, "command": st.get("command")}
        entry["commit"] = st.get("commit")
        if st.get("state") == "done":
            benchmarks[name] = entry | {"path": st["output"]}
        elif st.get("state") == "skipped":
            benchmarks[name] = entry | {"skipped": st["reason"]}
        else:  # --partial: the page and the README say so
            benchmarks[name] = entry | {"skipped": f"{st.get('state', 'not run')} in this publish"}
    runs = [Path(book.state(n)["output"]) for n in sweeps]
    command = f"h3lab publish --node {a.node}" + (f" --gpus {gpus}" if gpus else "")
    staging = product.staging(a.reports.resolve(), folder)
    try:
        publish(
            runs,
            staging,
            title=f"h3lab on {folder.upper()}",
            benchmarks=benchmarks,
            take_screenshot=not a.no_screenshot,
            fp64=True,
            notebook=book.attempt("render", ".ipynb"),  # the record of the page, in the work folder
        )
        product.copy_records(staging, runs[0] / "env.json", benchmarks)
        product.readme(staging, folder, command=command, node=a.node, benchmarks=benchmarks, took=_took(book))
        kept = product.swap_in(staging, a.reports.resolve() / folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # ours, half-built: the published folder is untouched
        raise
    write_index(a.reports.resolve())
    rec = {"state": "done", "output": str(a.reports.resolve() / folder), "previous_kept": str(kept) if kept else None}
    return rec


def _took(book) -> str:
    """', about N min of stages on this machine (a: s, b: s, ...)' from the stages that ran here."""
    ran = {n: st["seconds"] for n, st in book.record["stages"].items() if st.get("state") == "done" and n != "render"}
    total = sum(ran.values())
    parts = ", ".join(f"{n} {s:.0f} s" for n, s in ran.items())
    return f"; its stages took {total / 60:.0f} min here, the render aside ({parts})" if ran else ""


def _commit() -> str | None:
    """The checkout's commit as `git describe --always --dirty` (h3lab.io.env), for records without one."""
    from h3lab.io.env import capture

    describe = capture("cpu")["git"].get("describe")
    return f"{describe} (the checkout that ran it)" if describe else None


def _line(rec: dict[str, Any]) -> str:
    if rec.get("kept"):
        return f"{rec['state']} in an earlier call, kept ({rec.get('output', '')})"
    detail = rec.get("reason") or rec.get("error") or rec.get("output") or ""
    extra = (
        f"; the previous folder had files git does not hold: kept at {rec['previous_kept']}"
        if rec.get("previous_kept")
        else ""
    )
    return f"{rec['state']} in {rec.get('seconds', 0):.0f} s: {detail}{extra}"


def _print_states(book, names: list[str]) -> int:
    states = {n: book.state(n) for n in names}
    for n, st in states.items():
        print(f"  {n:<16} {st.get('state', 'not run'):<12} {st.get('seconds', '')!s:>8}  {st.get('reason', '')}")
    bad = [n for n, st in states.items() if st.get("state") in ("failed", "interrupted")]
    return 1 if bad else 0
