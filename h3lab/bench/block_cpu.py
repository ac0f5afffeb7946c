"""Wall time of the canonical block (forward + dX + every dW) on CPU, written as one JSON record.

    python -m h3lab.bench.block_cpu --config tiny --rows 264 --repeats 10 --out runs/bench/tiny.json

Weights are the synthetic block 0 (bf16, as the real checkpoint stores them) and a bf16 packed
batch; building them is timed separately and never counted. Each repeat is one `canonical_block`
call; the sha256 of every repeat's `out` is recorded, so a record also shows the repeats agreed
byte for byte. Load averages before and after are recorded too: on a 2-core machine any other
busy process shows up directly in the figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from h3lab.batch import packed_batch
from h3lab.block import canonical_block
from h3lab.config import NAMED_CONFIGS, H3Config
from h3lab.io.jsonfile import write_json
from h3lab.metrics import sha256_tensor
from h3lab.weights import synthetic_block

BENCH_FORMAT = "h3lab-bench-block-cpu-v1"


def machine_info() -> dict[str, Any]:
    """What the figures depend on: CPU model and count, threads, memory, torch and its CPU kernels."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    model = names[0] if names else platform.processor() or "unknown"
    return {
        "cpu_model": model,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def bench(config_name: str, rows: int, repeats: int, warmup: int, seed: int) -> dict[str, Any]:
    """Time `repeats` canonical_block calls after `warmup` untimed ones; returns the JSON record."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    config = H3Config.named(config_name)
    start = time.perf_counter()
    weights = synthetic_block(config, 0, seed=seed)
    batch = packed_batch(config, rows, seed=seed + 1)
    setup_s = time.perf_counter() - start
    for _ in range(warmup):
        canonical_block(weights, batch)
    load_before = os.getloadavg()
    seconds, hashes = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        result = canonical_block(weights, batch)
        seconds.append(time.perf_counter() - start)
        hashes.append(sha256_tensor(result.out))
    load_after = os.getloadavg()  # 1-min average above ~2 (this run's threads) means other work shared the CPUs
    return {
        "format": BENCH_FORMAT,
        "what": "canonical_block (default torch backend): forward, dX, every dW, d temb of one block; bf16",
        "config": config_name,
        "rows": rows,
        "block_params": sum(t.numel() for t in weights.values()),
        "seed": seed,
        "warmup": warmup,
        "repeats": repeats,
        "seconds": seconds,
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "setup_s": setup_s,
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),  # Linux: KiB
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "out_sha256": hashes[0],
        "repeats_bitwise_equal": len(set(hashes)) == 1,
        "machine": machine_info(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h3lab.bench.block_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny", choices=NAMED_CONFIGS)
    parser.add_argument("--rows", type=int, default=264)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first (use 0 for the real config)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON file (default runs/bench/block-cpu-<config>-<time>.json)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out or f"runs/bench/block-cpu-{args.config}-{stamp}.json")
    record = bench(args.config, args.rows, args.repeats, args.warmup, args.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, record)
    print(
        f"{args.config}, {args.rows} rows: median {record['median_s']:.3f} s "
        f"(min {record['min_s']:.3f}, max {record['max_s']:.3f}, {args.repeats} repeats, "
        f"{record['machine']['torch_threads']} threads), bitwise equal: {record['repeats_bitwise_equal']}; {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
