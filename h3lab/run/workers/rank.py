"""One rank of a layout: run the block on its rows and units, compare its shards, write them out.

Launched only by h3lab.run.runner through h3lab.launch.launcher: `python -m h3lab.run.workers.rank SPEC.json`.
The rank writes, under the layout directory: rank{r}.log (stdout and stderr), rank{r}.status.json
(running / done / error / terminated, updated at every collective call so a hang can be traced
to the straggler), rank{r}.safetensors (its out/dx rows, its dW unit slices, replicated grads)
and rank{r}.json (verdicts against the canonical block, timings, collective decisions).

H3LAB_FAULT=<raise|hang|kill|stop>:<rank> injects a fault on one rank after the process group is up,
H3LAB_FAULT=flip:<rank>:<op>:<index> one flipped bit in a traced op's output (fault-handling and
finder tests, h3lab.run.workers.faults; never set by the runner itself). A rank exits when
its agent or its runner is gone (h3lab.launch.lifeline), saying so in its status.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from h3lab.backend import get_backend
from h3lab.io.jsonfile import write_json
from h3lab.launch.lifeline import watch
from h3lab.metrics import compare
from h3lab.parallel.distcomm import build_comm
from h3lab.parallel.layout import Layout
from h3lab.parallel.seqshard import SeqShard
from h3lab.run.problem import Problem
from h3lab.run.progress import Progress
from h3lab.run.tasks import ROW_TENSORS, compute, expected_shard, num_rows, prepare
from h3lab.run.trace import TraceRecorder
from h3lab.run.workers import faults


def _redirect_output(log: Path) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1), os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)


HEARTBEAT_S = 0.2


def _start_heartbeat(path: Path) -> None:
    """Write the time every 0.2 s from a thread; it keeps beating while the main thread waits in a
    collective (torch releases the GIL there), so the rank whose beat stopped first died first."""

    def beat() -> None:
        while True:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(repr(time.time()))
            tmp.replace(path)
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, daemon=True, name="h3lab-heartbeat").start()


def _take_sigterm_in_a_thread(on_term: Callable[[int, object], None]) -> None:
    """SIGTERM (torchrun stopping its ranks after one failed, or the runner's sweep) runs `on_term` at
    once, also while the main thread is blocked in a collective. Python runs a handler in the main
    thread between bytecodes only, so a rank waiting in gloo's C++ took SIGTERM when the collective
    returned, or never: torchrun waited its grace period and sent SIGKILL. Python's C-level handler
    also writes the signal's number to the wakeup fd, whichever thread the signal lands on; a thread
    reading that fd runs `on_term`. No signal mask changes, so processes the rank starts (a compiler)
    take SIGTERM as usual."""
    signal.signal(signal.SIGTERM, on_term)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def wait() -> None:
        while True:
            if signal.SIGTERM in os.read(read_fd, 64):
                on_term(signal.SIGTERM, None)

    threading.Thread(target=wait, daemon=True, name="h3lab-sigterm").start()


def run_rank(spec: dict) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_dir = Path(spec["layout_dir"])
    status = out_dir / f"rank{rank}.status.json"
    _redirect_output(out_dir / f"rank{rank}.log")

    progress = Progress(status)

    def on_term(signum: int, _frame: object) -> None:  # the agent or the runner stops us
        record = {"state": "terminated", "signal": signum, "time": time.time(), "calls": progress.calls}
        write_json(status, record | {"site": progress.site})
        os._exit(128 + signum)

    def on_launcher_gone(pid: int) -> None:  # a thread: also ends a rank blocked in a collective
        record = {"state": "terminated", "reason": f"its launcher (pid {pid}) is gone", "time": time.time()}
        write_json(status, record | {"calls": progress.calls, "site": progress.site})
        os._exit(1)

    _take_sigterm_in_a_thread(on_term)
    watch(on_launcher_gone, parent_signal=signal.SIGKILL)  # SIGKILL: also ends a rank stuck in C++
    progress.tick("start")
    _start_heartbeat(out_dir / f"rank{rank}.heartbeat")
    try:
        record = _run(spec, rank, world, progress)
    except BaseException as err:
        write_json(
            status,
            {
                "state": "error",
                "error": f"{type(err).__name__}: {err}",
                "time": time.time(),
                "traceback": traceback.format_exc(),
            },
        )
        traceback.print_exc()
        return 1
    write_json(status, {"state": "done", "time": time.time(), "all_equal": record["all_equal"]})
    return 0


def _run(spec: dict, rank: int, world: int, progress: Progress) -> dict:
    layout = Layout.parse(spec["layout"])
    if layout.world != world:
        raise ValueError(f"layout {layout.name} needs {layout.world} ranks, torchrun started {world}")
    problem = Problem.from_dict(spec["problem"])
    device = problem.rank_device(int(os.environ.get("LOCAL_RANK", 0)))
    transport = "nccl" if device.type == "cuda" and problem.one_gpu_per_rank(layout) else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and Triton launch on the current device
    dist.init_process_group(transport, device_id=device if transport == "nccl" else None)
    progress.tick("process group up")  # phases count as progress, so a hang names its straggler
    on_call = faults.inject(str(rank), progress.tick)  # a `stop` fault: a hook that stops in the next collective
    progress.tick("fault check")
    comm = build_comm(
        layout,
        rank,
        mode=problem.mode,
        algorithm=spec.get("algorithm", "auto"),
        device=device,
        act_dtype=torch.bfloat16,
        on_call=on_call,
    )
    flip = faults.planted_flip(str(rank))
    if flip is not None and not spec.get("trace"):
        raise ValueError(
            f"{faults.FAULT_VAR} flips {flip[0]!r}, a traced op, in a run without --trace; allowed: --trace"
        )
    recorder = TraceRecorder(flip=flip) if spec.get("trace") else None
    inputs = prepare(problem, device)  # once: a repeat that rebuilt them would start its step late
    backend = get_backend(problem.block_backend, device)  # this rank's one backend
    result = compute(problem, comm, device, backend=backend, layout=layout, rank=rank, trace=recorder, inputs=inputs)
    if flip is not None and not recorder.flipped:  # type: ignore[union-attr]
        raise ValueError(f"{faults.FAULT_VAR} flips {flip[0]!r}, which this rank never traced; allowed: a traced op")
    for _ in range(problem.repeats - 1):  # timing repeats; the bytes of every repeat are identical
        dist.barrier()  # every rank starts the step together: its forward_s then excludes the others' digests
        result = compute(problem, comm, device, backend=backend, layout=layout, rank=rank, inputs=inputs)
    tensors, timings = result.tensors, result.timings
    out_dir = Path(spec["layout_dir"])
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out_dir / f"rank{rank}.safetensors"))
    if recorder is not None:
        recorder.save(out_dir / f"rank{rank}.trace")
    verdicts = _compare_with_canonical(tensors, Path(spec["canonical"]), problem, layout, rank)
    if result.digests:  # digests-only run: the same per-unit names as the canonical process
        canon = json.loads(Path(spec["canonical"]).with_name("canonical.digests.json").read_text())
        verdicts |= {
            k: {"bitwise_equal": canon.get(k) == v, "sha256_a": v, "sha256_b": canon.get(k)}
            for k, v in result.digests.items()
        }
    record = {
        "rank": rank,
        "layout": layout.name,
        "coords": layout.coords(rank),
        "units": list(comm.units),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device),
        "transport": transport,
        "timings": {**timings, "collective_s": comm.seconds},
        "decisions": comm.decisions(),
        "verdicts": verdicts,
        "digests": result.digests,
        "all_equal": all(v["bitwise_equal"] for v in verdicts.values()),
    }
    if (S := num_rows(problem)) is not None:
        rows = SeqShard(layout, S).local_rows(rank)
        record["local_rows"] = [rows.start, rows.stop]
    write_json(out_dir / f"rank{rank}.json", record)
    comm.close()
    progress.close()
    dist.destroy_process_group()
    return record


def _compare_with_canonical(tensors: dict, canonical_path: Path, problem: Problem, layout: Layout, rank: int) -> dict:
    """This rank's shards against the same slices of the canonical result, byte for byte."""
    canon = load_file(str(canonical_path))
    config = problem.config()
    real = slice(0)
    if (S := num_rows(problem)) is not None:
        rows = SeqShard(layout, S).local_rows(rank)
        real = slice(rows.start, min(rows.stop, S))  # rows past S are SeqShard padding
    verdicts = {}
    for name, t in tensors.items():
        want = expected_shard(name, canon, config, real)
        got = t[: want.shape[0]] if name in ROW_TENSORS else t
        verdicts[name] = compare(got.contiguous().cpu(), want.contiguous()).to_dict()
    return verdicts


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    return run_rank(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
