"""One rank of a layout: run the block on its rows and units, compare its shards, write them out.

Launched only by h3lab.runner through h3lab.launch: `python -m h3lab.workers.block SPEC.json`.
The rank writes, under the layout directory: rank{r}.log (stdout and stderr), rank{r}.status.json
(running / done / error / terminated, updated at every collective call so a hang can be traced
to the straggler), rank{r}.safetensors (its out/dx rows, its dW unit slices, replicated grads)
and rank{r}.json (verdicts against the canonical block, timings, collective decisions).

H3LAB_FAULT=<raise|hang|kill>:<rank> injects a fault on one rank after the process group is up
(fault-handling tests; documented, never set by the runner itself).
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
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from h3lab.block import block_step
from h3lab.distcomm import Progress, build_comm
from h3lab.layouts import Layout
from h3lab.metrics import compare
from h3lab.problem import Problem
from h3lab.seqshard import SeqShard
from h3lab.units import UNIT_GRAD_FIELDS, unit_slice, unit_weights
from h3lab.weights import BlockWeights


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def _redirect_output(log: Path) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1), os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)


def _inject_fault(rank: int) -> None:
    spec = os.environ.get("H3LAB_FAULT", "")
    if not spec:
        return
    kind, _, target = spec.partition(":")
    if int(target) != rank:
        return
    print(f"H3LAB_FAULT: injecting {kind!r} on rank {rank}", flush=True)
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank}")
    if kind == "hang":
        time.sleep(3600)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"H3LAB_FAULT kind {kind!r}; allowed: raise, hang, kill")


HEARTBEAT_S = 0.2


def _start_heartbeat(path: Path) -> None:
    """Write the time every 0.2 s from a thread; it keeps beating while the main thread waits in a
    collective (torch releases the GIL there), so the rank whose beat stopped first died first."""

    def beat() -> None:
        while True:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(repr(time.time()))
            tmp.replace(path)
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, daemon=True, name="h3lab-heartbeat").start()


def run_rank(spec: dict) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_dir = Path(spec["layout_dir"])
    status = out_dir / f"rank{rank}.status.json"
    _redirect_output(out_dir / f"rank{rank}.log")

    progress = Progress(status)

    def on_term(signum: int, _frame: object) -> None:  # the agent or the runner stops us
        record = {"state": "terminated", "signal": signum, "time": time.time(), "calls": progress.calls}
        _write_json(status, record | {"site": progress.site})
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    progress.tick("start")
    _start_heartbeat(out_dir / f"rank{rank}.heartbeat")
    try:
        record = _run(spec, rank, world, progress)
    except BaseException as err:
        _write_json(
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
    _write_json(status, {"state": "done", "time": time.time(), "all_equal": record["all_equal"]})
    return 0


def _run(spec: dict, rank: int, world: int, progress: Progress) -> dict:
    layout = Layout.parse(spec["layout"])
    if layout.world != world:
        raise ValueError(f"layout {layout.name} needs {layout.world} ranks, torchrun started {world}")
    problem = Problem.from_dict(spec["problem"])
    device = problem.rank_device(int(os.environ.get("LOCAL_RANK", 0)))
    transport = "nccl" if device.type == "cuda" and problem.one_gpu_per_rank(layout) else "gloo"
    dist.init_process_group(transport, device_id=device if transport == "nccl" else None)
    progress.tick("process group up")  # phases count as progress, so a hang names its straggler
    _inject_fault(rank)
    progress.tick("fault check")
    weights, batch = problem.weights(device), problem.batch(device)
    shard = SeqShard(layout, batch.num_rows)
    comm = build_comm(
        layout,
        rank,
        mode=problem.mode,
        algorithm=spec.get("algorithm", "auto"),
        device=device,
        act_dtype=batch.hidden_states.dtype,
        progress=progress,
    )
    local = shard.coshard(batch, rank)
    uw = unit_weights(weights, comm.units)
    step = block_step(uw, local, comm, backend=problem.block_backend)
    for _ in range(problem.repeats - 1):  # timing repeats; the bytes of every repeat are identical
        step = block_step(uw, local, comm, backend=problem.block_backend)
    tensors = _rank_tensors(step)
    rank_file = Path(spec["layout_dir"]) / f"rank{rank}.safetensors"
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(rank_file))
    verdicts = _compare_with_canonical(step, Path(spec["canonical"]), weights, shard, rank)
    record = {
        "rank": rank,
        "layout": layout.name,
        "coords": layout.coords(rank),
        "units": list(comm.units),
        "local_rows": [shard.local_rows(rank).start, shard.local_rows(rank).stop],
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device),
        "transport": transport,
        "timings": {**step.timings, "collective_s": comm.seconds},
        "decisions": comm.decisions(),
        "verdicts": verdicts,
        "all_equal": all(v["bitwise_equal"] for v in verdicts.values()),
    }
    _write_json(Path(spec["layout_dir"]) / f"rank{rank}.json", record)
    comm.close()
    dist.destroy_process_group()
    return record


def _rank_tensors(step) -> dict[str, torch.Tensor]:
    out = {"out": step.out, "dx": step.dx, "dtemb": step.dtemb}
    out |= {f"dw.{k}": v for k, v in step.dw_replicated.items()}
    out |= {f"dw.{k}@u{u}": t for k, per in step.dw_units.items() for u, t in per.items()}
    return out


def _compare_with_canonical(step, canonical_path: Path, weights: BlockWeights, shard: SeqShard, rank: int) -> dict:
    """This rank's shards against the same slices of the canonical block, byte for byte."""
    canon = load_file(str(canonical_path))
    dev = step.out.device
    S = shard.num_rows
    rows = shard.local_rows(rank)
    real = slice(rows.start, min(rows.stop, S))  # rows past S are SeqShard padding
    n = max(0, real.stop - real.start)
    verdicts = {
        "out": compare(step.out[:n].cpu(), canon["out"][real]).to_dict(),
        "dx": compare(step.dx[:n].cpu(), canon["dx"][real]).to_dict(),
        "dtemb": compare(step.dtemb.cpu(), canon["dtemb"]).to_dict(),
    }
    dw_full = BlockWeights(weights.config, {k[3:]: v for k, v in canon.items() if k.startswith("dw.")}, "canonical")
    full_units = unit_weights(dw_full)
    for name, t in step.dw_replicated.items():
        verdicts[f"dw.{name}"] = compare(t.cpu(), canon[f"dw.{name}"]).to_dict()
    for name, per in step.dw_units.items():
        assert name in UNIT_GRAD_FIELDS, name
        for u, t in per.items():
            verdicts[f"dw.{name}@u{u}"] = compare(t.cpu(), unit_slice(full_units, name, u).contiguous()).to_dict()
    del dev
    return verdicts


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    return run_rank(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
