"""Deterministic collectives' bandwidth against the backend's own sums, nccl-tests conventions.

    python -m h3lab.bench.collectives --out FILE.json --ranks 2 [--mib 1,4,16,64,256,1024] \\
        [--local-sizes 2] [--segment-mib 32] [--device cuda]

or `run_collectives_bench(...)`. One launch of `h3lab.bench.workers.collective_check --bench` with one
process per GPU (NCCL; gloo on CPU): for all_reduce and reduce_scatter of FP32 partials of each
size, gather_tree, scatter_tree (and pipelined in segments with `segment_mib`), the hierarchical
tree per local size, and the backend's own SUM. Each call is timed by CUDA events after a barrier
and a device synchronisation; a row's time is the slowest rank's median. Bus bandwidth as
nccl-tests reports it, with S the input bytes per rank: all_reduce S/t * 2(P-1)/P, reduce_scatter
S/t * (P-1)/P. Every one of ours is checked bit for bit against the balanced tree of every
member's partial, computed locally on each rank; the backend's sum is compared too (at P = 2 its
one add per element is the tree; above it need not be).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from h3lab.io.env import capture
from h3lab.io.jsonfile import write_json
from h3lab.launch.launcher import launch

SCATTER_TARGET = 0.85  # of the backend all_reduce's bus bandwidth, for messages of >= 64 MiB


def run_collectives_bench(
    ranks: int,
    mib: list[float],
    *,
    out: Path,
    device: str | None = None,
    iters: int = 20,
    warmup: int = 3,
    local_sizes: list[int] | None = None,
    segment_mib: float | None = None,
    timeout_s: float = 900.0,
) -> dict:
    """Run the bench on `ranks` processes; returns its record (also written to `out`).

    Raises:
        ValueError: fewer GPUs than ranks, or no sizes.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.device_count() < ranks:
        raise ValueError(f"{ranks} ranks need {ranks} GPUs, {torch.cuda.device_count()} visible")
    if not mib or ranks < 2:
        raise ValueError(f"mib={mib}, ranks={ranks}; allowed: at least one size and 2 or more ranks")
    work = out.parent / f"{out.stem}.ranks"
    args = [str(work), "--bench", "--device", device, "--backend", "nccl" if device == "cuda" else "gloo"]
    args += ["--bench-mib", ",".join(str(m) for m in mib), "--iters", str(iters), "--warmup", str(warmup)]
    args += ["--local-sizes", ",".join(str(v) for v in local_sizes or [])]
    if segment_mib:
        args += ["--segment-mib", str(segment_mib)]
    res = launch(
        "h3lab.bench.workers.collective_check", args, nproc_per_node=ranks, log_dir=work / "logs", timeout_s=timeout_s
    )
    recs = [json.loads((work / f"rank{r}.json").read_text()) for r in range(ranks) if (work / f"rank{r}.json").exists()]
    rows = summarize(recs) if len(recs) == ranks else []
    record = {
        "ranks": ranks,
        "device": device,
        "launch": {"ok": res.ok, "returncode": res.returncode, "elapsed_s": res.elapsed_s},
        "rows": rows,
        "table": table(rows),
        "env": capture(device),
    }
    if not res.ok:
        record["launch"]["agent_log_tail"] = "\n".join(p.read_text()[-4000:] for p in res.agent_logs if p.exists())
    write_json(out, record)
    return json.loads(out.read_text())


def summarize(recs: list[dict]) -> list[dict]:
    """One row per (op, size, algorithm): the slowest rank's median, bus bandwidth, the ratio to the
    backend's bus bandwidth, and whether every rank's result was the tree's bits."""
    keyed: dict[tuple, list[dict]] = {}
    for rec in recs:
        for row in rec["bench"]:
            keyed.setdefault((row["op"], row["mib"], row["name"]), []).append(row)
    rows = []
    for (op, mib, name), per_rank in keyed.items():
        worst = max(per_rank, key=lambda r: r["median_s"])
        rows.append(
            {
                "op": op,
                "mib": mib,
                "name": name,
                "median_s": worst["median_s"],
                "bus_bw_gbs": worst["bus_bw_gbs"],
                "bitwise_equal_tree": all(r["bitwise_equal_tree"] for r in per_rank),
            }
        )
    backend = {(r["op"], r["mib"]): r["bus_bw_gbs"] for r in rows if r["name"] == "backend"}
    for r in rows:
        ref = backend.get((r["op"], r["mib"]))
        r["vs_backend"] = r["bus_bw_gbs"] / ref if ref else None
        r["vs_backend_all_reduce"] = r["bus_bw_gbs"] / backend[("all_reduce", r["mib"])] if backend else None
        if r["name"].startswith("scatter_tree") and r["op"] == "all_reduce" and r["mib"] >= 64:
            r["meets_target"] = r["vs_backend"] is not None and r["vs_backend"] >= SCATTER_TARGET
    return rows


def table(rows: list[dict]) -> str:
    """Fixed-width text: op, MiB, algorithm, ms, bus GB/s, ratio to the backend, bits."""
    lines = [f"{'op':>14} {'MiB':>7} {'algorithm':>26} {'ms':>9} {'busBW GB/s':>11} {'vs backend':>10} {'bits':>6}"]
    for r in rows:
        ratio = "-" if r["vs_backend"] is None else f"{r['vs_backend']:.2f}"
        bits = "tree" if r["bitwise_equal_tree"] else "other"
        lines.append(
            f"{r['op']:>14} {r['mib']:>7g} {r['name']:>26} {r['median_s'] * 1e3:>9.3f} {r['bus_bw_gbs']:>11.1f} "
            f"{ratio:>10} {bits:>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m h3lab.bench.collectives", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib", default="1,4,16,64,256,1024")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--local-sizes", default="", help="hierarchical trees to time, e.g. 2 (at 4 ranks)")
    ap.add_argument("--segment-mib", type=float, default=None, help="also scatter_tree pipelined in segments")
    ap.add_argument("--timeout", type=float, default=900.0)
    a = ap.parse_args(argv)
    try:
        record = run_collectives_bench(
            a.ranks,
            [float(m) for m in a.mib.split(",") if m],
            out=a.out,
            device=a.device,
            iters=a.iters,
            warmup=a.warmup,
            local_sizes=[int(v) for v in a.local_sizes.split(",") if v],
            segment_mib=a.segment_mib,
            timeout_s=a.timeout,
        )
    except ValueError as err:
        ap.error(str(err))
    print(record["table"])
    return 0 if record["launch"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
