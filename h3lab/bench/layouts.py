"""What a layout costs: the deterministic layouts against eager TP/SP/CP at the same layout, one run.

    python -m h3lab.bench.layouts --out FILE.json --layouts tp1,tp2,tp2+sp,cp2 --rows 4096,16384 \\
        [--steps 20] [--warmup 3] [--device cuda] [--diagnose]

or `run_layout_bench(...)` (a papermill-friendly dict). One launch through h3lab.launch.launcher with one
process per GPU (NCCL; gloo on CPU) runs every layout and row count
(h3lab.bench.workers.layout_bench); a layout smaller than the launch runs on its first ranks.

Per case (layout, rows) and mode (`det`: the block under the contract, `eager`: what people run,
h3lab.reference.eager), from every rank's steps:
- step time: CUDA events around a step that starts after a host barrier of the layout's ranks and
  a device synchronisation; per rank median, p10, p90, min, max over `steps` steps, and the
  layout's step (per step, the slowest rank's time, then the median over steps);
- per collective, from `collective_steps` steps more with every call recorded: its span on the
  device (events before and after it on the stream), split into the wait for the late peer and
  the transfer. Each rank's arrival is its host origin (a CLOCK_MONOTONIC read just before the
  step's first event, recorded on an idle GPU) plus the event's offset on its own GPU; on one host
  the clock is shared, so the wait of rank r at a call is (the group's last arrival - r's arrival)
  and the transfer the rest of r's span. Its error is the spread of "host read -> event executed
  on an idle GPU" across ranks (microseconds), reported as the step-start spread; `--diagnose`
  measures the wait directly too (a one-element all_reduce before each call, timed apart);
- skew: per step, the arrival spread at its first call moving >= 1 MiB (the first large
  collective; below that size the step's largest), as a fraction of the step;
- bytes sent and received per step per rank (det: the collectives' own counts; eager:
  nccl-tests' per-rank conventions), collective share of the step, peak memory per rank (the
  whole block's weights stay alive on every rank, so `step_extra_gib`, the peak less what was
  allocated before the steps, is what the step itself needs);
- det's bits: digests of the unit slices of every weight gradient, d temb and out/dx in row blocks
  of rows/8 from one step after the timed ones, equal across ranks and to tp1's at the same rows.
The comparison per layout and rows: det, eager, det/eager, the overhead (det/eager) / (det/eager at
tp1), each one's speedup over tp1, collective shares, waits, peak memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from h3lab.bench.layout_summary import summarize
from h3lab.config import H3Config
from h3lab.io.env import capture
from h3lab.io.jsonfile import write_json
from h3lab.launch.launcher import LaunchResult, launch
from h3lab.parallel.layout import Layout, parse_layouts


def run_layout_bench(
    layouts: Sequence[str] | str,
    rows: Sequence[int],
    *,
    out: Path,
    config: str = "real",
    device: str | None = None,
    backend: str | None = None,
    steps: int = 20,
    warmup: int = 3,
    collective_steps: int | None = None,
    eager: bool = True,
    digests: bool = True,
    diagnose: bool = False,
    diagnose_steps: int = 5,
    diagnose_runner_steps: int = 2,
    algorithm: str = "auto",
    segment_bytes: int | None = None,
    overlap: bool = True,
    seed: int = 1,
    weights_seed: int = 0,
    timeout_s: float = 1800.0,
) -> dict:
    """Run the benchmark; returns its record (also written to `out`, the ranks' files beside it).

    Args:
        layouts: names (h3lab.parallel.layout grammar); each must fit the launch's GPUs.
        rows: row counts of the packed sequence (the eager layouts need multiples of the row shards).
        out: the JSON file; ranks' records and logs go to `<out stem>.ranks/`.
        config: "real" or "tiny".
        device, backend: "cuda"/"triton" where a GPU is, else "cpu"/"torch".
        steps, warmup: timed steps per mode and rank (the issue asks >= 20), and warm-up steps (>= 1).
        collective_steps: steps with every collective recorded (default: `steps`; 0: none).
        eager: also time the eager layout. digests: check det's bits against tp1's.
        diagnose: run the arrival-skew suspects (h3lab.bench.workers.layout_diagnose) on every layout of > 1 rank,
            at its first row count.
        algorithm, segment_bytes: the deterministic collectives' (h3lab.parallel.collectives).
        overlap: False finishes each reduction the block starts at once (no overlap with its work).
        timeout_s: the whole launch's limit.

    Returns:
        The record as written: {"request", "env", "cases": {"<layout>@<rows>": summary},
        "comparison": [...], "table": str, "missing": [...], "launch": {...}}.

    Raises:
        ValueError: unknown layouts, too few GPUs, warm-up or steps below 1.
    """
    parsed = parse_layouts(list(layouts) if not isinstance(layouts, str) else layouts)
    device, backend = _resolve_device(device, backend)
    _check(parsed, rows, config, device, steps, warmup)
    work = _ranks_dir(out)
    spec = {"config": config, "device": device, "backend": backend, "cases": [[lay.name, list(rows)] for lay in parsed]}
    spec |= _timing_spec(steps, warmup, collective_steps, eager, digests)
    spec |= _diagnose_spec(diagnose, diagnose_steps, diagnose_runner_steps)
    spec |= {"algorithm": algorithm, "segment_bytes": segment_bytes, "overlap": overlap, "seed": seed}
    spec |= {"weights_seed": weights_seed, "timeout_s": timeout_s, "out_dir": str(work.resolve())}
    write_json(work / "spec.json", spec)
    record = _launch_and_summarize(spec, work, max(lay.world for lay in parsed), timeout_s)
    write_json(out, record)
    return json.loads(out.read_text())  # what a reader of the file sees (string keys for ranks)


def _resolve_device(device: str | None, backend: str | None) -> tuple[str, str]:
    """Unset device and backend default to "cuda"/"triton" where a GPU is, else "cpu"/"torch"."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, backend or ("triton" if device == "cuda" else "torch")


def _ranks_dir(out: Path) -> Path:
    """The ranks' folder beside `out` (`<out stem>.ranks/`), created."""
    work = out.parent / f"{out.stem}.ranks"
    work.mkdir(parents=True, exist_ok=True)
    return work


def _timing_spec(steps: int, warmup: int, collective_steps: int | None, eager: bool, digests: bool) -> dict:
    """The spec's timing keys; unset `collective_steps` records every collective of `steps` steps."""
    return {
        "steps": steps,
        "warmup": warmup,
        "collective_steps": steps if collective_steps is None else collective_steps,
        "eager": eager,
        "digests": digests,
    }


def _diagnose_spec(diagnose: bool, diagnose_steps: int, diagnose_runner_steps: int) -> dict:
    """The spec's diagnosis keys; the runner path's repeats run only when diagnosing, with steps > 0."""
    return {
        "diagnose": diagnose,
        "diagnose_steps": diagnose_steps,
        "diagnose_runner": diagnose and diagnose_runner_steps > 0,
        "diagnose_runner_steps": diagnose_runner_steps,
    }


def _launch_and_summarize(spec: dict, work: Path, world: int, timeout_s: float) -> dict:
    """One launch of `world` ranks runs every case; the record reads whatever rank files it left."""
    worker, spec_arg = "h3lab.bench.workers.layout_bench", [str((work / "spec.json").resolve())]
    res = launch(worker, spec_arg, nproc_per_node=world, log_dir=work / "logs", timeout_s=timeout_s)
    record = summarize([_read(work / f"rank{r}.json") for r in range(world)], spec)
    record["launch"] = _launch_info(res)
    record["env"] = capture(spec["device"])
    return record


def _launch_info(res: LaunchResult) -> dict:
    """How the launch ended; a failed one carries the tail of every agent log that exists."""
    info = {"ok": res.ok, "returncode": res.returncode, "timed_out": res.timed_out, "elapsed_s": res.elapsed_s}
    if not res.ok:
        info["agent_log_tail"] = "\n".join(p.read_text()[-4000:] for p in res.agent_logs if p.exists())
    return info


def _check(layouts: list[Layout], rows: Sequence[int], config: str, device: str, steps: int, warmup: int) -> None:
    if not rows or any(int(r) < 1 for r in rows):
        raise ValueError(f"rows {list(rows)}; allowed: positive row counts")
    if steps < 1 or warmup < 1:
        raise ValueError(f"steps={steps}, warmup={warmup}; allowed: >= 1 each (the first warm-up step compiles)")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}; allowed: 'cpu', 'cuda'")
    c = H3Config.named(config)
    for lay in layouts:  # a layout of several nodes runs its nodes as groups of this machine's ranks
        lay.check(c)
    world = max(lay.world for lay in layouts)
    if device == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} visible; allowed: fewer ranks")


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m h3lab.bench.layouts", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON record (ranks' files beside it)")
    ap.add_argument("--layouts", default="tp1,tp2", help="comma-separated layout names")
    ap.add_argument("--rows", default="4096", help="comma-separated row counts")
    ap.add_argument("--config", default="real", choices=("real", "tiny"))
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None)
    ap.add_argument("--backend", choices=("torch", "triton"), default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--collective-steps", type=int, default=None, help="default: --steps")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--no-digests", action="store_true")
    ap.add_argument("--diagnose", action="store_true", help="run the arrival-skew suspects too")
    ap.add_argument("--diagnose-steps", type=int, default=5)
    ap.add_argument("--diagnose-runner-steps", type=int, default=2, help="0: skip the runner path's repeats")
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--segment-bytes", type=int, default=None, help="pipelined scatter_tree segments")
    ap.add_argument("--no-overlap", action="store_true", help="finish each reduction the block starts at once")
    ap.add_argument("--timeout", type=float, default=1800.0)
    a = ap.parse_args(argv)
    try:
        record = run_layout_bench(
            a.layouts,
            [int(r) for r in a.rows.split(",") if r],
            out=a.out,
            config=a.config,
            device=a.device,
            backend=a.backend,
            steps=a.steps,
            warmup=a.warmup,
            collective_steps=a.collective_steps,
            eager=not a.no_eager,
            digests=not a.no_digests,
            diagnose=a.diagnose,
            diagnose_steps=a.diagnose_steps,
            diagnose_runner_steps=a.diagnose_runner_steps,
            algorithm=a.algorithm,
            segment_bytes=a.segment_bytes,
            overlap=not a.no_overlap,
            timeout_s=a.timeout,
        )
    except ValueError as err:
        ap.error(str(err))
    print(record["table"])
    for line in record["missing"]:
        print(f"missing: {line}", file=sys.stderr)
    return 0 if record["launch"]["ok"] and not record["missing"] else 1


if __name__ == "__main__":
    sys.exit(main())
