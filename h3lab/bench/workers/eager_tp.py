"""Worker: the eager, non-deterministic block (h3lab.reference.eager) at a layout, timed on every rank.

    python -m h3lab.bench.workers.eager_tp OUT_DIR --config real --rows 264,4096 --device cuda [--reps 10]
    python -m h3lab.bench.workers.eager_tp OUT_DIR --config tiny --rows 32 --layouts tp2+sp,cp2 --save

Launched only through `h3lab.launch.launcher.launch` with one process per rank (NCCL on distinct GPUs,
gloo on CPU). Without --layouts: Megatron TP over all ranks (the default group). Writes
OUT_DIR/rank{r}.json: per row count the median forward and forward+backward seconds
(CUDA-synchronised, after warm-up), and with --save the rank's out, dx and dW as safetensors
(rank{r}.safetensors, or rank{r}.<layout>.safetensors per layout), for the CPU tests that check
the sharding against the unsharded eager block.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor

from h3lab.batch import packed_batch
from h3lab.bench.workers.eager_layouts import eager_groups, eager_inputs, eager_parallel
from h3lab.config import H3Config
from h3lab.io.jsonfile import write_json
from h3lab.launch.lifeline import exit_now, watch
from h3lab.parallel.layout import parse_layouts
from h3lab.reference.eager import eager_block, tp_shard
from h3lab.reference.oracle import rope_cos_sin
from h3lab.weights import BlockWeights, synthetic_block


def _median_s(fn, reps: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _measure(
    w: BlockWeights, shard: dict[str, Tensor], rows: int, reps: int, device: torch.device, save: Path | None
) -> dict[str, float]:
    b = packed_batch(w.config, rows, seed=1).to(device)
    cos, sin = (t.to(device).to(torch.bfloat16) for t in rope_cos_sin(b.position_ids.cpu(), w.config))

    def step(backward: bool) -> dict[str, Tensor]:
        return eager_block(w, b, cos, sin, backward, shard=shard)

    if save is not None:
        save_file({k: v.contiguous().cpu() for k, v in step(True).items()}, str(save))
    return {
        "fwd_median_s": _median_s(lambda: step(False), reps, device),
        "fwd_bwd_median_s": _median_s(lambda: step(True), reps, device),
    }


def _layouts(a: argparse.Namespace, w: BlockWeights, rank: int, world: int, device: torch.device) -> dict:
    """Each layout of --layouts at the first row count: median seconds, and with --save its tensors."""
    out = {}
    rows = int(a.rows.split(",")[0])
    full = packed_batch(w.config, rows, seed=1).to(device)
    for layout in parse_layouts(a.layouts):
        if layout.world != world:
            raise ValueError(f"layout {layout.name} needs {layout.world} ranks; allowed: layouts of {world} ranks")
        inp = eager_inputs(w, full, layout, rank)
        par = eager_parallel(layout, eager_groups(layout, rank))

        def step(backward: bool, inp=inp, par=par) -> dict[str, Tensor]:
            return eager_block(w, inp.batch, inp.cos, inp.sin, backward, shard=inp.shard, parallel=par)

        if a.save:
            name = layout.name.replace("+", "_").replace(":", "_")
            save_file(
                {k: v.contiguous().cpu() for k, v in step(True).items()}, str(a.out / f"rank{rank}.{name}.safetensors")
            )
        out[layout.name] = {"fwd_bwd_median_s": _median_s(lambda step=step: step(True), a.reps, device)}
    return out


def main(argv: list[str]) -> int:
    watch(exit_now(), parent_signal=signal.SIGKILL)  # no orphan when the agent or runner is gone
    ap = argparse.ArgumentParser(prog="h3lab.bench.workers.eager_tp")
    ap.add_argument("out", type=Path)
    ap.add_argument("--config", default="real")
    ap.add_argument("--rows", default="264,4096")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--save", action="store_true", help="also write each rank's tensors (first row count)")
    ap.add_argument("--layouts", default="", help="comma-separated layouts of this world size (tp2+sp, cp2, ...)")
    a = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    a.out.mkdir(parents=True, exist_ok=True)
    c = H3Config.named(a.config)
    w = synthetic_block(c, 0, seed=0, device=device)  # the generator of the device: the same on every rank
    record: dict = {"rank": rank, "world": world, "device": str(device), "backend": dist.get_backend(), "rows": {}}
    if a.layouts:
        record["layouts"] = _layouts(a, w, rank, world, device)
    else:
        shard = tp_shard(w, rank, world)
        for i, rows in enumerate(int(r) for r in a.rows.split(",")):
            save = a.out / f"rank{rank}.safetensors" if a.save and i == 0 else None
            record["rows"][rows] = _measure(w, shard, rows, a.reps, device, save)
    write_json(a.out / f"rank{rank}.json", record)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
