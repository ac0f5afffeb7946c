"""A sweep: every layout, in every mode and batch seed, on one block, into one run directory.

runs/<id>/
  reproduce.ipynb            the executed notebook (papermill writes it; absent for library calls)
  env.json                   h3lab.io.env.capture(): versions, devices, node type, git state, determinism
  params.json                the validated parameters and the checkpoint actually used
  checkpoint/                the synthesized checkpoint, for one block of the tiny config when no checkpoint
                             was given; the real config's weights (1.3 GB a block), chains and trajectories
                             are drawn from the weight seed by every process instead (h3lab.run.problem)
  <mode>/seed<s>/            one h3lab.run.runner run directory (summary.json, canonical, layouts/, logs)
  accuracy.json              canonical bf16 vs FP64 vs diffusers (the `h3lab accuracy` table)
  verdicts|layouts|ranks|collectives.parquet, figures/
  sweep.json                 "running" (with its owner) from `prepare` on; written last: status,
                             every run and every failure; "failed" or "interrupted" with the error
                             when the sweep stops short
Workers run under torchrun subprocesses started by h3lab.run.runner; nothing here runs a rank itself.
On CUDA they see the first `gpus` GPUs (CUDA_VISIBLE_DEVICES): a layout whose ranks per node fit
them runs one process per GPU over NCCL, a larger one shares them over gloo (Problem.one_gpu_per_rank).
"""

from __future__ import annotations

import json
import os
import secrets
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from h3lab.config import H3Config
from h3lab.io.env import capture, node_type
from h3lab.io.jsonfile import write_json
from h3lab.io.rundir import (
    FINAL_STATES,
    OWNER_NAME,
    check_unpublished,
    describe_end,
    owner_record,
    read_record,
    reserve_space,
    write_final,
)
from h3lab.parallel.layout import parse_layouts
from h3lab.run.runner import RunRequest, run
from h3lab.workbench import tables
from h3lab.workbench.params import WEIGHTS_SEED, ReproduceParams, runs_root, sweep_problem
from h3lab.workbench.rundata import Sweep, load_sweep

SWEEP_FORMAT = "h3lab-sweep-v1"


def new_run_dir(device: str = "cpu", root: Path | None = None) -> Path:
    """Create runs/<UTC time>-<node type>-<commit>-<4 hex>/ (the suffix keeps two same-second runs apart)."""
    env_git = capture(device)["git"]
    commit = (env_git.get("commit") or "nogit")[:7] + ("-dirty" if env_git.get("dirty") else "")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    d = (root or runs_root()) / f"{stamp}-{node_type(device).lower()}-{commit}-{secrets.token_hex(2)}"
    d.mkdir(parents=True, exist_ok=False)
    return d


def prepare(p: ReproduceParams) -> Path:
    """Create the run directory; write env.json, synthesize the checkpoint (unless given), write params.json.

    Raises:
        ValueError: the run directory already holds a sweep or anything else (nothing is ever
            overwritten or mixed: besides the notebook papermill writes and the caller's claim it must
            be empty), or lies inside the published reports.
    """
    run_dir = p.run_dir or new_run_dir(p.device)
    check_unpublished(run_dir, "run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "params.json").exists():
        raise ValueError(f"run_dir {str(run_dir)!r} already holds a sweep; allowed: a new or empty folder")
    others = sorted(n.name for n in run_dir.iterdir() if n.name not in (OWNER_NAME, "reproduce.ipynb"))
    if others:
        raise ValueError(f"run_dir {str(run_dir)!r} holds {others[:5]}; allowed: a new or empty folder")
    write_json(run_dir / "env.json", capture(p.device))
    checkpoint = p.checkpoint
    if checkpoint is None and p.task == "block" and p.config == "tiny":  # the loader's path, with its manifest
        from h3lab.io.checkpoint import synthesize_checkpoint

        config = H3Config.named(p.config)
        checkpoint = synthesize_checkpoint(run_dir / "checkpoint", config, num_blocks=p.block + 1, seed=WEIGHTS_SEED)
    path = str(Path(checkpoint).resolve()) if checkpoint is not None else None
    record = {"format": SWEEP_FORMAT, **p.to_dict(), "task": p.task, "checkpoint_path": path}
    record["started"] = time.time()
    write_json(run_dir / "params.json", record)
    write_json(run_dir / "sweep.json", {"format": SWEEP_FORMAT, "status": "running", "owner": owner_record()})
    reserve_space(run_dir)  # given back for the final sweep.json on a full disk
    return run_dir


def mark_ended(run_dir: str | Path, status: str, error: str) -> None:
    """sweep.json says `status` ("failed" or "interrupted") with `error`, unless it already holds a
    final state (`finish` wrote it) or the sweep never started (no params.json: nothing to mark)."""
    run_dir = Path(run_dir)
    record = read_record(run_dir / "sweep.json") or {}
    if record.get("status") in FINAL_STATES or not (run_dir / "params.json").is_file():
        return
    write_final(run_dir / "sweep.json", record | {"status": status, "error": error, "finished": time.time()})


def planned(params: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(mode, seed, layout) in the order the sweep runs them."""
    return [(m, s, lay) for m in params["modes"] for s in params["seeds"] for lay in params["layouts"]]


def first_gpus(count: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES naming the first `count` of the GPUs `visible` names (None or "": every GPU
    torch sees)."""
    if visible:
        ids = visible.split(",")
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    return ",".join(ids[:count])


@contextmanager
def visible_gpus(count: int) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES narrowed to the first `count` visible GPUs for the processes started inside
    (0: left as it is); this process keeps the devices it already opened."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if count:
        os.environ["CUDA_VISIBLE_DEVICES"] = first_gpus(count, before)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def run_sweep(run_dir: str | Path) -> Sweep:
    """Run every (mode, seed) of params.json through h3lab.run.runner.run into <mode>/seed<s>/.

    A layout that fails or mismatches does not stop the sweep: its record says which rank and log.
    """
    from h3lab.run.summary import format_summary

    run_dir = Path(run_dir)
    params = json.loads((run_dir / "params.json").read_text())
    layouts = tuple(parse_layouts(params["layouts"]))
    for mode in params["modes"]:
        for seed in params["seeds"]:
            out = run_dir / mode / f"seed{seed}"
            req = RunRequest(
                layouts=layouts,
                problem=sweep_problem(params, mode, seed),
                out=out,
                timeout_s=params["timeout"],
                trace=params.get("trace", False),
                command=["notebooks/reproduce.py", f"run_dir={run_dir}"],
            )
            with visible_gpus(params.get("gpus", 0) if params["device"] == "cuda" else 0):
                summary = run(req)
            print(f"== {mode}, batch seed {seed}: {out}\n{format_summary(summary)}", flush=True)
    return load_sweep(run_dir)


def accuracy(run_dir: str | Path) -> dict[str, Any]:
    """canonical bf16 vs the FP64 oracle vs diffusers on the sweep's (first) block and first seed -> accuracy.json."""
    import torch

    from h3lab.reference.accuracy import block_accuracy, format_table

    run_dir = Path(run_dir)
    params = json.loads((run_dir / "params.json").read_text())
    device = torch.device(params["device"])
    # diffusers imports tqdm.auto, which warns in a kernel without ipywidgets; the bars are not used here
    warnings.filterwarnings("ignore", message="IProgress not found")
    problem = sweep_problem(params, "deterministic", params["seeds"][0], task="block")  # the first block
    weights, batch = problem.weights(device), problem.batch(device)
    report = block_accuracy(weights, batch)
    report |= {"rows": params["rows"], "seed": params["seeds"][0], "table": format_table(report)}
    write_json(run_dir / "accuracy.json", report)
    return report


def finish(run_dir: str | Path) -> Sweep:
    """Write the parquet tables, then sweep.json (last, atomically) with the sweep's verdict.

    The sweep passes when every deterministic layout is byte-equal to the single-process block, no
    layout failed to run in any mode (a baseline mismatch is the expected finding, not a failure) and,
    when the accuracy section ran, its two canonical runs were bitwise equal.
    """
    run_dir = Path(run_dir)
    sweep = load_sweep(run_dir)
    tables.write_parquet([sweep], run_dir)
    layouts = tables.layout_frame([sweep])
    det = layouts["mode"] == "deterministic"
    bad = layouts[(det & (layouts["status"] != "passed")) | (layouts["status"] == "failed")]
    acc = sweep.accuracy
    acc_ok = acc is None or acc["determinism"]["bitwise_equal"]
    expected = len(planned(sweep.params))
    status = "passed" if len(layouts) == expected and bad.empty and acc_ok else "failed"
    cols = ["mode", "seed", "layout", "status", "failed_rank", "failure", "log"]
    runs = sweep.runs
    record = {
        "format": SWEEP_FORMAT,
        "status": status,
        "node_type": sweep.node_type,
        "finished": time.time(),
        "layouts_run": len(layouts),
        "layouts_planned": expected,
        "deterministic_all_equal": bool(det.any()) and bool((layouts[det]["status"] == "passed").all()),
        "accuracy_bitwise_equal": None if acc is None else acc["determinism"]["bitwise_equal"],
        "runs": [{"mode": r.mode, "seed": r.seed, "path": str(r.path), "status": r.summary["status"]} for r in runs],
        "problems": bad[cols].astype(object).where(bad[cols].notna(), None).to_dict("records"),
    }
    write_final(run_dir / "sweep.json", record)
    return load_sweep(run_dir)


def run_all(p: ReproduceParams) -> Sweep:
    """prepare, run_sweep, accuracy (if p.accuracy) and finish: the whole reproduce notebook, for scripts.

    A sweep stopped short (Ctrl-C, an error) leaves sweep.json "interrupted" or "failed" with the error.
    """
    run_dir = prepare(p)
    try:
        run_sweep(run_dir)
        if p.accuracy:
            accuracy(run_dir)
        return finish(run_dir)
    except (KeyboardInterrupt, SystemExit) as err:
        mark_ended(run_dir, "interrupted", describe_end(err))
        raise
    except BaseException as err:
        mark_ended(run_dir, "failed", describe_end(err))
        raise
