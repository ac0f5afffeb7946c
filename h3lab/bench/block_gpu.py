"""Canonical block (Triton) against the eager bf16 block (cuBLAS + SDPA) at the real H3 shapes.

`python -m h3lab.bench.block_gpu --out FILE.json [--rows 264,4096] [--reps N] [--no-graphs]` times
forward and forward+backward (median of CUDA-synchronised wall times after warm-up), records extra
peak memory over weights and inputs, the error of both against the FP64 oracle (at the first row
count; above 4096 rows its attention in query chunks of at most 2 GiB of scores, so any length
runs: `score_bytes`), and whether repeated canonical runs give identical bytes. `ratio_fwd_bwd` divides the two
medians (eager's reps first, then canonical's); `ratio_fwd_bwd_interleaved` is the median of
per-rep ratios with the two blocks called in turn, so a drift of clocks or host load within the
run falls on both alike (the sequential ratio of unchanged code moves between runs) — but then
each block also runs at the SM clock the other leaves behind (on the H200 the eager block is
power-bound at a lower clock than the canonical one), so the sequential medians are the figure of
a model that runs one kind of block back to back.

Both blocks are also timed captured in CUDA graphs (h3lab.block.graph: the canonical block as a
`GraphedBlock`, the eager one's autograd step captured whole), which takes the host's launch cost
out of the step: `canonical_graph_*` against eager as people run it (`ratio_graph_vs_eager`) and
against eager captured too (`ratio_graph_vs_eager_graph`), with the row plan decided ahead, and
decided in each call (`canonical_graph_decide_*`); `graph_bitwise`: a replay's bytes equal
the eager canonical step's; `*_graph_pool_gib`: the memory a capture keeps (reserved, not freed
until the graph is dropped). `--no-graphs` leaves the graphs out (at long sequences the host's
launch cost is a small part of the step, and each capture keeps its own memory pool).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from h3lab.backend import get_backend
from h3lab.batch import PackedBatch, packed_batch
from h3lab.block import canonical_block
from h3lab.block.graph import GraphedBlock, capture
from h3lab.config import H3Config
from h3lab.io.env import capture as capture_env
from h3lab.io.jsonfile import write_json
from h3lab.metrics import bitwise_equal, error_stats
from h3lab.reference.eager import eager_block
from h3lab.reference.oracle import oracle_block, rope_cos_sin
from h3lab.weights import BlockWeights, synthetic_block

DENSE_ORACLE_ROWS = 4096  # up to here the oracle's plain [H, S, S] attention (the figures before)
ORACLE_SCORE_BYTES = 2 * 2**30  # above it, query chunks of at most this many bytes of FP64 scores


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


def interleaved_times(
    fns: dict[str, Callable[[], Any]], reps: int, sync: Callable[[], None] = torch.cuda.synchronize
) -> dict[str, list[float]]:
    """Wall seconds of `reps` synchronised calls of each fn, the fns called in turn within a rep
    (after 2 warm-up rounds), so slow drifts fall on every fn alike: {name: [seconds per rep]}.
    Odd reps call them in reverse order (ABBA), so whatever the previous call leaves behind (a hot
    GPU, a cold CPU cache for the host code) falls on each fn alike too."""
    for _ in range(2):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps):
        for name, fn in list(fns.items())[:: -1 if rep % 2 else 1]:
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t)
    return times


def _reserved() -> int:
    """Bytes the allocator holds once its cache is emptied: a live graph's pool stays (torch.cuda.graph
    empties the cache when it starts capturing, so a plain difference of memory_reserved can be < 0)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def _peak_extra(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; refuses what cannot run (row counts, reps) before any GPU work."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="264,4096")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--config", default="real")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="leave out the CUDA-graph timings")
    a = ap.parse_args(argv)
    if a.reps < 2:
        ap.error(f"--reps {a.reps}; allowed: >= 2 (interleaved turns split the reps by order)")
    parts = a.rows.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        ap.error(f"--rows {a.rows!r}; allowed: positive integers, comma-separated")
    a.rows = [int(p) for p in parts]
    return a


def oracle_score_bytes(rows: int) -> int | None:
    """The oracle's attention: plain up to DENSE_ORACLE_ROWS rows, in query chunks above."""
    return None if rows <= DENSE_ORACLE_ROWS else ORACLE_SCORE_BYTES


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    c = H3Config.named(a.config)
    dev = torch.device("cuda")
    w = synthetic_block(c, 0, seed=0).to(dev)
    record: dict = {"config": a.config, "env": capture_env(dev), "rows": {}}
    for i, rows in enumerate(a.rows):
        b = packed_batch(c, rows, seed=1).to(dev)
        record["rows"][rows] = r = _measure(w, b, a.reps, with_error=i == 0, graphs=a.graphs)
        print(rows, {k: v for k, v in r.items() if k != "error_vs_fp64" and not k.endswith("_seconds")}, flush=True)
        write_json(a.out, record)
        del b
        torch.cuda.empty_cache()


def eager_step(w: BlockWeights, b: PackedBatch) -> Callable[[bool], dict]:
    """The eager bf16 block (cuBLAS + SDPA) on (w, b) as a call; its argument: with the backward."""
    cos, sin = (t.to(b.device).to(torch.bfloat16) for t in rope_cos_sin(b.position_ids.cpu(), w.config))
    return lambda backward: eager_block(w, b, cos, sin, backward)


def _measure(w: BlockWeights, b: PackedBatch, reps: int, with_error: bool, graphs: bool = True) -> dict:
    eager = eager_step(w, b)
    be = get_backend("triton", b.device)

    def canonical() -> dict:
        return canonical_block(w, b, backend=be).tensors()

    r = {
        "eager_fwd_median_s": statistics.median(cuda_times(lambda: eager(False), reps)),
        "eager_fwd_bwd_median_s": statistics.median(cuda_times(lambda: eager(True), reps)),
        "canonical_fwd_bwd_median_s": statistics.median(cuda_times(canonical, reps)),
        "eager_peak_extra_gib": _peak_extra(lambda: eager(True)),
        "canonical_peak_extra_gib": _peak_extra(canonical),
    }
    r["ratio_fwd_bwd"] = r["canonical_fwd_bwd_median_s"] / r["eager_fwd_bwd_median_s"]
    turns = interleaved_times({"eager": lambda: eager(True), "canonical": canonical}, reps)
    r |= _interleaved(turns, "ratio_fwd_bwd_interleaved")
    r["ratio_peak"] = r["canonical_peak_extra_gib"] / r["eager_peak_extra_gib"]
    one, two = canonical(), canonical()
    r["repeat_bitwise"] = all(bitwise_equal(one[k], two[k]) for k in one)
    del two
    if graphs:
        r |= _graphs(w, b, one, lambda: eager(True), reps, r["eager_fwd_bwd_median_s"])
    if with_error:  # the FP64 oracle costs ~10 GB at 4096 rows, ~1.2 MB per row above: once
        r["error_vs_fp64"] = _errors(w, b, one, eager(True))
    return r


def _errors(w: BlockWeights, b: PackedBatch, canonical: dict, eager: dict) -> dict:
    """Relative L2 error of each tensor of both blocks against the FP64 oracle (or why none)."""
    score_bytes = oracle_score_bytes(b.num_rows)
    try:
        ref = oracle_block(w, b, score_bytes=score_bytes).tensors()
    except torch.OutOfMemoryError as e:  # recorded: the timings above stand without it
        return {"skipped": f"the FP64 oracle ran out of memory at {b.num_rows} rows: {str(e)[:200]}"}
    out: dict[str, Any] = {"oracle_score_bytes": score_bytes}
    for k in ref:
        out[k] = {
            "canonical_rel_l2": error_stats(canonical[k], ref[k].to(canonical[k].device))["rel_l2"],
            "eager_rel_l2": error_stats(eager[k], ref[k].to(eager[k].device))["rel_l2"],
        }
    return out


def _graphs(
    w: BlockWeights, b: PackedBatch, eager_bytes: dict, eager: Callable[[], Any], reps: int, eager_s: float
) -> dict:
    """Both blocks captured in CUDA graphs: times, the memory a capture keeps, the replay's bits."""
    r: dict[str, Any] = {}
    before = _reserved()
    graphed = GraphedBlock(w, b)
    r["canonical_graph_pool_gib"] = (_reserved() - before) / 2**30
    rows = graphed.decide(b)  # decided ahead, once: the same batch every rep
    replay = lambda: graphed(b, decided_rows=rows)  # noqa: E731
    got = replay().tensors()
    r["graph_bitwise"] = all(bitwise_equal(got[k], eager_bytes[k]) for k in eager_bytes)
    r["canonical_graph_fwd_bwd_median_s"] = statistics.median(cuda_times(replay, reps))
    r["ratio_graph_vs_eager"] = r["canonical_graph_fwd_bwd_median_s"] / eager_s
    # the row plan decided in each call, as for a new batch without deciding ahead (a host sync,
    # the host's sorting and two copies in the step)
    r["canonical_graph_decide_fwd_bwd_median_s"] = statistics.median(cuda_times(lambda: graphed(b), reps))
    r["ratio_graph_decide_vs_eager"] = r["canonical_graph_decide_fwd_bwd_median_s"] / eager_s
    try:  # recorded, not fatal: the eager block's autograd step is torch's to capture
        before = _reserved()
        eager_graph, _ = capture(eager)
        r["eager_graph_pool_gib"] = (_reserved() - before) / 2**30
    except RuntimeError as e:
        r["eager_graph_error"] = repr(e)
        return r
    r["eager_graph_fwd_bwd_median_s"] = statistics.median(cuda_times(eager_graph.replay, reps))
    r["ratio_graph_vs_eager_graph"] = r["canonical_graph_fwd_bwd_median_s"] / r["eager_graph_fwd_bwd_median_s"]
    turns = interleaved_times({"eager": eager_graph.replay, "canonical": replay}, reps)
    return r | _interleaved(turns, "ratio_graph_vs_eager_graph_interleaved")


def _interleaved(turns: dict[str, list[float]], key: str) -> dict[str, Any]:
    """The median of per-rep ratios, each rep's seconds, and the ratio with canonical called first and
    second in its rep (ABBA order: even reps eager first), to see what the order does."""
    ratios = [c / e for e, c in zip(turns["eager"], turns["canonical"], strict=True)]
    return {
        key: statistics.median(ratios),
        f"{key}_canonical_second": statistics.median(ratios[0::2]),
        f"{key}_canonical_first": statistics.median(ratios[1::2]),
        f"{key}_seconds": turns,
    }


if __name__ == "__main__":
    main()
