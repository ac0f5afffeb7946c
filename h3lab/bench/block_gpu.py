"""Canonical block (Triton) against the eager bf16 block (cuBLAS + SDPA) at the real H3 shapes.

`python -m h3lab.bench.block_gpu --out FILE.json [--rows 264,4096] [--reps N]` times forward and
forward+backward (median of CUDA-synchronised wall times after warm-up), records extra peak
memory over weights and inputs, the error of both against the FP64 oracle (at the first row
count), and whether repeated canonical runs give identical bytes. `ratio_fwd_bwd` divides the two
medians (eager's reps first, then canonical's); `ratio_fwd_bwd_interleaved` is the median of
per-rep ratios with the two blocks called in turn, so a drift of clocks or host load within the
run falls on both alike (the same code's ratio moved by 0.04 between calls of session 9).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from h3lab.batch import PackedBatch, packed_batch
from h3lab.bench.eager import eager_block
from h3lab.block import canonical_block
from h3lab.config import H3Config
from h3lab.env import capture
from h3lab.metrics import bitwise_equal, error_stats
from h3lab.oracle import oracle_block, rope_cos_sin
from h3lab.weights import BlockWeights, synthetic_block


def cuda_times(fn, reps: int) -> list[float]:
    """Wall seconds of `reps` CUDA-synchronised calls of `fn`, after 2 warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def interleaved_times(fns: dict[str, Callable[[], Any]], reps: int,
                      sync: Callable[[], None] = torch.cuda.synchronize) -> dict[str, list[float]]:  # fmt: skip
    """Wall seconds of `reps` synchronised calls of each fn, the fns called in turn within a rep
    (after 2 warm-up rounds), so slow drifts fall on every fn alike: {name: [seconds per rep]}."""
    for _ in range(2):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t)
    return times


def _peak_extra(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="264,4096")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--config", default="real")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    c = H3Config.named(a.config)
    dev = torch.device("cuda")
    w = synthetic_block(c, 0, seed=0).to(dev)
    record: dict = {"config": a.config, "env": capture(dev), "rows": {}}
    for i, rows in enumerate(int(r) for r in a.rows.split(",")):
        b = packed_batch(c, rows, seed=1).to(dev)
        record["rows"][rows] = r = _measure(w, b, a.reps, with_error=i == 0)
        print(rows, {k: v for k, v in r.items() if k != "error_vs_fp64"}, flush=True)
        a.out.write_text(json.dumps(record, indent=1, default=str))


def _measure(w: BlockWeights, b: PackedBatch, reps: int, with_error: bool) -> dict:
    cos, sin = (t.to(b.device).to(torch.bfloat16) for t in rope_cos_sin(b.position_ids.cpu(), w.config))

    def eager(backward: bool) -> dict:
        return eager_block(w, b, cos, sin, backward)

    def canonical() -> dict:
        return canonical_block(w, b, backend="triton").tensors()

    r = {
        "eager_fwd_median_s": statistics.median(cuda_times(lambda: eager(False), reps)),
        "eager_fwd_bwd_median_s": statistics.median(cuda_times(lambda: eager(True), reps)),
        "canonical_fwd_bwd_median_s": statistics.median(cuda_times(canonical, reps)),
        "eager_peak_extra_gib": _peak_extra(lambda: eager(True)),
        "canonical_peak_extra_gib": _peak_extra(canonical),
    }
    r["ratio_fwd_bwd"] = r["canonical_fwd_bwd_median_s"] / r["eager_fwd_bwd_median_s"]
    turns = interleaved_times({"eager": lambda: eager(True), "canonical": canonical}, reps)
    pairs = zip(turns["eager"], turns["canonical"], strict=True)
    r["ratio_fwd_bwd_interleaved"] = statistics.median([c / e for e, c in pairs])
    r["ratio_peak"] = r["canonical_peak_extra_gib"] / r["eager_peak_extra_gib"]
    one, two = canonical(), canonical()
    r["repeat_bitwise"] = all(bitwise_equal(one[k], two[k]) for k in one)
    if with_error:  # the FP64 oracle costs ~10 GB at real size: once
        ref = oracle_block(w, b).tensors()
        eag = eager(True)
        r["error_vs_fp64"] = {
            k: {"canonical_rel_l2": error_stats(one[k], ref[k].to(one[k].device))["rel_l2"],
                "eager_rel_l2": error_stats(eag[k], ref[k].to(eag[k].device))["rel_l2"]}
            for k in ref
        }  # fmt: skip
    return r


if __name__ == "__main__":
    main()
