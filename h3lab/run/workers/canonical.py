"""The canonical result of a run: the problem in a single process, in a process of its own.

Launched only by h3lab.run.runner through h3lab.launch.launcher.launch_process, so that `--timeout`
bounds it, Ctrl-C or SIGTERM stop it, and a crash or a full disk ends it with a status instead of
taking the runner down: `python -m h3lab.run.workers.canonical SPEC.json`. Under the run folder
it writes canonical.safetensors (out, dx, dtemb, dw.<parameter>; a training run's step{k}. tensors),
canonical.digests.json (digests runs), canonical.trace (traced runs), then canonical.json (the
record the runner keeps; a training run's loss, norm and clip coefficient per step) and
canonical.status.json (running / done / error / terminated), the last one last.

H3LAB_FAULT=<raise|hang|kill>:canonical injects a fault (h3lab.run.workers.faults).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from h3lab.backend import get_backend
from h3lab.comm import LocalComm
from h3lab.io.jsonfile import write_json
from h3lab.io.tensorfile import write_tensors
from h3lab.launch.lifeline import exit_now, watch
from h3lab.metrics import count_nonfinite, sha256_tensor
from h3lab.run import tasks
from h3lab.run.problem import Problem
from h3lab.run.steps import step_values
from h3lab.run.trace import TraceRecorder
from h3lab.run.workers import faults


def compute_canonical(problem: Problem, out: Path, trace: bool) -> dict:
    """The canonical tensors into `out`; returns the record (time, timings, backend, sha256, non-finite counts)."""
    device = torch.device("cuda" if problem.device == "cuda" else "cpu")
    backend = get_backend(problem.block_backend, device)  # this process's one backend
    t = time.perf_counter()
    result = tasks.canonical(problem, device, backend)
    elapsed = time.perf_counter() - t
    tensors = {k: v.contiguous().cpu() for k, v in result.tensors.items()}
    write_tensors(out / "canonical.safetensors", tensors)
    if problem.digests:
        write_json(out / "canonical.digests.json", result.digests)
    if trace:  # a second, traced pass: the finder compares every op of every layout with it
        recorder = TraceRecorder()
        tasks.compute(problem, LocalComm(), device, backend=backend, trace=recorder)
        recorder.save(out / "canonical.trace")
    record = {
        "status": "done",
        "time_s": elapsed,
        "timings": result.timings,
        "backend": problem.block_backend,
        "sha256": {k: sha256_tensor(v) for k, v in tensors.items()},
        # a non-finite value compares equal to itself bit for bit: the summary shows where they are
        "nonfinite": {k: n for k, v in tensors.items() if (n := count_nonfinite(v))},
    }
    if problem.task == "train":  # each step's loss, norm and clip coefficient, as numbers
        record["steps"] = step_values(tensors)
    return record


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(spec["out"])
    status = out / "canonical.status.json"

    def on_term(signum: int, _frame: object) -> None:  # the runner stops us (Ctrl-C, SIGTERM, timeout)
        write_json(status, {"state": "terminated", "signal": signum, "time": time.time()})
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    watch(exit_now(), parent_signal=signal.SIGKILL)
    write_json(status, {"state": "running", "pid": os.getpid(), "time": time.time()})
    try:
        faults.inject("canonical")
        if faults.planted_flip("canonical") is not None:  # the reference stays clean: flips go to ranks
            raise ValueError(f"{faults.FAULT_VAR} flips a bit of the canonical process; allowed: flip:<rank>:...")
        record = compute_canonical(Problem.from_dict(spec["problem"]), out, bool(spec.get("trace")))
        write_json(out / "canonical.json", record)
    except BaseException as err:
        error = f"{type(err).__name__}: {err}"
        tb = traceback.format_exc()
        traceback.print_exc()
        # a full disk may refuse this too: the runner then reads "exited without reporting" and the log
        with contextlib.suppress(OSError):
            write_json(status, {"state": "error", "error": error, "time": time.time(), "traceback": tb})
        return 1
    write_json(status, {"state": "done", "time": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
