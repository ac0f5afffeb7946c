"""One rank of a layout: run the block on its rows and units, compare its shards, write them out.

Launched only by h3lab.run.runner through h3lab.launch.launcher: `python -m h3lab.run.workers.rank SPEC.json`.
The rank writes, under the layout directory, what every rank writes (h3lab.run.workers.supervised:
rank{r}.log, rank{r}.status.json updated at every collective call so a hang can be traced to the
straggler, rank{r}.heartbeat), rank{r}.safetensors (its out/dx rows, its dW unit slices, replicated grads)
and rank{r}.json (verdicts against the canonical block, timings, collective decisions).

H3LAB_FAULT=<raise|hang|kill|stop>:<rank> injects a fault on one rank after the process group is up,
H3LAB_FAULT=flip:<rank>:<op>:<index> one flipped bit in a traced op's output (fault-handling and
finder tests, h3lab.run.workers.faults; never set by the runner itself). A rank exits when
its agent or its runner is gone (h3lab.launch.lifeline), saying so in its status.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from h3lab.backend import get_backend
from h3lab.io.jsonfile import write_json
from h3lab.metrics import compare
from h3lab.parallel.distcomm import DistComm, build_comm
from h3lab.parallel.layout import Layout
from h3lab.parallel.seqshard import SeqShard
from h3lab.run.problem import Problem
from h3lab.run.progress import Progress
from h3lab.run.tasks import ROW_TENSORS, Computed, compute, expected_shard, num_rows, prepare
from h3lab.run.trace import TraceRecorder
from h3lab.run.workers import faults
from h3lab.run.workers.supervised import supervised_rank


def run_rank(spec: dict) -> int:
    return supervised_rank(Path(spec["layout_dir"]), lambda rank, world, progress: _done(spec, rank, world, progress))


def _done(spec: dict, rank: int, world: int, progress: Progress) -> dict:
    return {"all_equal": _run(spec, rank, world, progress)["all_equal"]}


def _run(spec: dict, rank: int, world: int, progress: Progress) -> dict:
    """One rank's run: join the process group, compute (repeated for timing), save its shards and
    trace, write rank{r}.json; returns that record. Every phase ticks `progress`."""
    layout = Layout.parse(spec["layout"])
    if layout.world != world:
        raise ValueError(f"torchrun started {world} ranks for layout {layout.name}; allowed: {layout.world}")
    problem = Problem.from_dict(spec["problem"])
    device, transport = _join(problem, layout, progress)
    comm = _comm(spec, problem, layout, rank, device, progress)
    flip = faults.planted_flip(str(rank))
    if flip is not None and not spec.get("trace"):
        raise ValueError(
            f"{faults.FAULT_VAR} flips {flip[0]!r}, a traced op, in a run without --trace; allowed: --trace"
        )
    recorder = TraceRecorder(flip=flip) if spec.get("trace") else None
    result = _compute(problem, comm, device, layout, rank, recorder, flip)
    out_dir = Path(spec["layout_dir"])
    save_file({k: v.contiguous().cpu() for k, v in result.tensors.items()}, str(out_dir / f"rank{rank}.safetensors"))
    if recorder is not None:
        recorder.save(out_dir / f"rank{rank}.trace")
    verdicts = _verdicts(result, spec, problem, layout, rank)
    record = _record(problem, layout, rank, device, transport, comm, result, verdicts)
    write_json(out_dir / f"rank{rank}.json", record)
    comm.close()
    progress.close()
    dist.destroy_process_group()
    return record


def _join(problem: Problem, layout: Layout, progress: Progress) -> tuple[torch.device, str]:
    """(device, transport) of this rank, its process group up: NCCL only with one GPU per rank, else gloo."""
    device = problem.rank_device(int(os.environ.get("LOCAL_RANK", 0)))
    transport = "nccl" if device.type == "cuda" and problem.one_gpu_per_rank(layout) else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and Triton launch on the current device
    dist.init_process_group(transport, device_id=device if transport == "nccl" else None)
    progress.tick("process group up")  # phases count as progress, so a hang names its straggler
    return device, transport


def _comm(
    spec: dict, problem: Problem, layout: Layout, rank: int, device: torch.device, progress: Progress
) -> DistComm:
    """This rank's comm, after any fault aimed at it is injected (its collective hook ticks `progress`)."""
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
    assert comm is not None, layout.name  # a rank of a layout's world always has a comm
    return comm


def _compute(
    problem: Problem,
    comm: DistComm,
    device: torch.device,
    layout: Layout,
    rank: int,
    recorder: TraceRecorder | None,
    flip: tuple[str, int] | None,
) -> Computed:
    """The rank's result: one traced computation (a planted flip must hit a traced op), then the timing
    repeats, untraced, on the same inputs; the bytes of every repeat are identical."""
    inputs = prepare(problem, device)  # once: a repeat that rebuilt them would start its step late
    backend = get_backend(problem.block_backend, device)  # this rank's one backend
    result = compute(problem, comm, device, backend=backend, layout=layout, rank=rank, trace=recorder, inputs=inputs)
    if flip is not None and not recorder.flipped:  # type: ignore[union-attr]
        raise ValueError(f"{faults.FAULT_VAR} flips {flip[0]!r}, which this rank never traced; allowed: a traced op")
    for _ in range(problem.repeats - 1):
        dist.barrier()  # every rank starts the step together: its forward_s then excludes the others' digests
        result = compute(problem, comm, device, backend=backend, layout=layout, rank=rank, inputs=inputs)
    return result


def _verdicts(result: Computed, spec: dict, problem: Problem, layout: Layout, rank: int) -> dict:
    """Every tensor's verdict against the canonical result; a digests-only run's digests against the
    canonical process's, under the same per-unit names."""
    verdicts = _compare_with_canonical(result.tensors, Path(spec["canonical"]), problem, layout, rank)
    if result.digests:
        canon = json.loads(Path(spec["canonical"]).with_name("canonical.digests.json").read_text())
        verdicts |= {
            k: {"bitwise_equal": canon.get(k) == v, "sha256_a": v, "sha256_b": canon.get(k)}
            for k, v in result.digests.items()
        }
    return verdicts


def _record(
    problem: Problem,
    layout: Layout,
    rank: int,
    device: torch.device,
    transport: str,
    comm: DistComm,
    result: Computed,
    verdicts: dict,
) -> dict:
    """rank{r}.json: where the rank ran, its timings, decisions and verdicts (all_equal: every one
    bitwise), and its rows of the sequence where the problem has rows."""
    record = {
        "rank": rank,
        "layout": layout.name,
        "coords": layout.coords(rank),
        "units": list(comm.units),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device),
        "transport": transport,
        "timings": {**result.timings, "collective_s": comm.seconds},
        "decisions": comm.decisions(),
        "verdicts": verdicts,
        "digests": result.digests,
        "all_equal": all(v["bitwise_equal"] for v in verdicts.values()),
    }
    if (S := num_rows(problem)) is not None:
        rows = SeqShard(layout, S).local_rows(rank)
        record["local_rows"] = [rows.start, rows.stop]
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
