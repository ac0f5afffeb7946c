"""Benchmark records as the report's timing tables: the steady-state figures of `python -m h3lab.bench.*`.

Speed in a published report comes from here only: each benchmark warms up, then times many calls
(medians, spreads), and records the machine and the commit it ran at. A correctness run's per-rank
seconds (one step, compilation included) are never shown as speed.

`TABLES` maps a benchmark's name (its name in h3lab.bench.registry; the workbench does not import
the benchmarks) to a function from its JSON record to one table. `provenance` says where a record
was measured: the machine and the commit, or that the record holds no commit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from h3lab.io.env import code_label

MS = 1e3  # seconds -> milliseconds


def load(path: str | Path) -> Any:
    """A benchmark's JSON record; ValueError naming the file when it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"benchmark record {str(path)!r} cannot be read ({err}); allowed: a JSON file") from None


def _env(record: Any) -> dict[str, Any]:
    if isinstance(record, list):  # per-rank or per-row-count lists: the first entry's
        return _env(record[0]) if record and isinstance(record[0], dict) else {}
    if "env" in record:
        return record["env"] or {}
    bench = record.get("benchmarks")  # the CPU block's aggregate record
    return {"git": {"describe": bench[-1].get("commit")}} if bench else {}


def provenance(record: Any, ran_at: str | None = None) -> dict[str, str]:
    """{"machine": ..., "commit": ...} as the record states them; a record without a commit takes
    `ran_at`, what is known of the checkout that ran it (`h3lab publish` records it), else "not recorded"."""
    env = _env(record)
    gpus = env.get("gpus") or []
    machine = (
        f"{len(gpus)} x {gpus[0]['name']}"
        if gpus
        else env.get("gpu") or (env.get("cpu") or {}).get("model") or env.get("node_type") or "not recorded"
    )
    cpu = (record.get("benchmarks") or [record])[-1].get("machine", {}) if isinstance(record, dict) else {}
    if cpu.get("cpu_model"):  # block_cpu
        machine = f"{cpu['cpu_model']}, {cpu.get('logical_cpus')} CPUs ({cpu.get('torch_threads')} threads)"
    git = env.get("git") or {}
    commit = code_label(git) or (record.get("commit") if isinstance(record, dict) else None)
    return {"machine": machine, "commit": commit or ran_at or "not recorded"}


def block_gpu(record: dict) -> pd.DataFrame:
    """Per row count: eager and canonical fwd+bwd (ms), their ratio, both captured in CUDA graphs, peak memory."""
    rows = []
    for n, r in record["rows"].items():
        rows.append(
            {
                "rows": int(n),
                "eager ms": r.get("eager_fwd_bwd_median_s", float("nan")) * MS,
                "canonical ms": r.get("canonical_fwd_bwd_median_s", float("nan")) * MS,
                "canonical / eager": r.get("ratio_fwd_bwd"),
                "canonical in a graph ms": r.get("canonical_graph_fwd_bwd_median_s", float("nan")) * MS,
                "graph / eager": r.get("ratio_graph_vs_eager"),
                "eager extra GiB": r.get("eager_peak_extra_gib"),
                "canonical extra GiB": r.get("canonical_peak_extra_gib"),
                "repeats bitwise": r.get("repeat_bitwise"),
            }
        )
    return pd.DataFrame(rows).set_index("rows")


def block_cpu(record: dict) -> pd.DataFrame:
    """Per configuration: the canonical block's fwd+bwd seconds on CPU (median, min, max), peak RSS, and the
    machine's 1-minute load average before (on 2 cores any other busy process shows in the figures)."""
    runs = record.get("benchmarks") or [record]
    cols = ("config", "rows", "repeats", "median_s", "min_s", "max_s", "peak_rss_gib", "repeats_bitwise_equal")
    rows = [{c: r.get(c) for c in cols} | {"load before": (r.get("load_average_before") or [None])[0]} for r in runs]
    return pd.DataFrame(rows).set_index("config")


def gemm(record: dict) -> pd.DataFrame:
    """Per pinned kernel, shape and row count: cuBLAS ms, ours ms, our speed as a fraction of cuBLAS's."""
    rows = []
    for kernel in ("mm", "unit"):
        pinned = record.get(kernel, {}).get("pinned")
        for key, ms in (pinned or {}).get("ms", {}).items():
            shape, m = key.rsplit("@", 1)
            rows.append(
                {
                    "kernel": "fixed-order GEMM" if kernel == "mm" else "unit-tree GEMM",
                    "shape": shape,
                    "rows": int(m),
                    "cuBLAS ms": record.get("cublas", {}).get(f"{kernel}:{key}"),
                    "ours ms": ms,
                    "speed vs cuBLAS": pinned.get("ratio", {}).get(key),  # cuBLAS ms / ours ms
                }
            )
    return pd.DataFrame(rows).set_index(["kernel", "shape", "rows"])


def chain(record: dict) -> pd.DataFrame:
    """Per shape of the float32 modules' chain GEMM: the pinned tile's ms, the fastest candidate's,
    cuBLAS's FP32 GEMM (other bits), and whether every candidate gave the pinned bytes."""
    rows = []
    for r in record["shapes"]:
        fastest = r.get("fastest") or {}
        rows.append(
            {
                "shape": f"{r['what']} {r['M']}x{r['K']}x{r['N']}",
                "pinned ms": r["pinned_ms"],
                "fastest ms": fastest.get("ms"),
                "fastest tile": "x".join(str(fastest[k]) for k in ("BLOCK_M", "BLOCK_N", "UNROLL", "num_warps"))
                if fastest
                else None,
                "cuBLAS FP32 ms": r["cublas_fp32_ms"],
                "all tiles bitwise": all(t["bitwise"] for t in r["tiles"]) if r["tiles"] else None,
            }
        )
    return pd.DataFrame(rows).set_index("shape")


def attention(record: dict) -> pd.DataFrame:
    """Per shape: the pinned kernels' fwd and bwd ms, and fwd+bwd against SDPA's default and flash."""
    rows = []
    for shape, r in record["summary"]["shapes"].items():
        p = r["pinned"]
        rows.append(
            {
                "shape": shape,
                "fwd ms": p["fwd_ms"],
                "bwd ms": p["bwd_ms"],
                "time / SDPA default": p.get("ratio_fwd_bwd_vs_sdpa_default"),  # fwd+bwd, ours over theirs
                "time / SDPA flash": p.get("ratio_fwd_bwd_vs_sdpa_flash"),
            }
        )
    return pd.DataFrame(rows).set_index("shape")


def attention_long(record: dict) -> pd.DataFrame:
    """Per row count: the pinned kernels' fwd and bwd ms, peak GiB, bits, against the fastest SDPA backend;
    where the time goes (each kernel's tensor-core TFLOP/s) and what bounds the backward (the rate the
    split dq + dk/dv kernels run at, and the rate 0.9 of SDPA's speed needs; the record's
    gemm_ceiling_tflops is a cuBLAS GEMM's rate on the same GPU)."""
    rows = []
    for n, r in record["rows"].items():
        p = r["variants"]["pinned"]
        summary = r.get("summary") or {}
        kernels = r.get("kernels") or {}
        bound = summary.get("bound") or {}
        rows.append(
            {
                "rows": int(n),
                "fwd ms": p.get("fwd_ms"),
                "bwd ms": p.get("bwd_ms"),
                "bwd peak GiB": (p.get("peak_gib") or {}).get("bwd"),
                "repeats bitwise": p.get("repeat_bitwise"),
                "fastest SDPA": summary.get("sdpa_best"),
                "fwd speed vs it": (summary.get("pinned") or {}).get("speed_fwd_vs_sdpa"),
                "speed vs it": (summary.get("pinned") or {}).get("speed_fwd_bwd_vs_sdpa"),
                "fwd TFLOP/s": (kernels.get("fwd") or {}).get("tflops"),
                "dq TFLOP/s": (kernels.get("bwd_q") or {}).get("tflops"),
                "dk/dv TFLOP/s": (kernels.get("bwd_kv") or {}).get("tflops"),
                "bwd TFLOP/s": bound.get("bwd_tflops", bound.get("split_bwd_tflops")),  # older records: split
                "bwd TFLOP/s for 0.9": bound.get("bwd_tflops_for_0.9", bound.get("split_bwd_tflops_for_0.9")),
                "GEMM ceiling TFLOP/s": record.get("gemm_ceiling_tflops"),
            }
        )
    return pd.DataFrame(rows).set_index("rows")


def attention_fused(record: dict) -> pd.DataFrame:
    """Per row count: the split backward's and the fused one's ms in both launch orders (a v1 record
    timed keys first only, as "fused"), their ratios, the fused dk/dv bits against the split ones,
    the fused dq's distance to the split dq, whether it repeats, whether both orders give its bytes;
    from v3 the diagnostics' ratios (dq added without turns, no dq at all; None before) and, where it
    ran, the Gluon candidate's (from v4 also in the other launch order, without turns and without its
    dq adds, and whether its bits held)."""
    v1 = record.get("format", "").endswith("-v1")
    rows = []
    for n, r in record["rows"].items():
        bits = r.get("bitwise_vs_split") or {}
        heads = (None, None) if v1 else (r.get("fused_ms"), r.get("fused_over_split"))
        keys = (
            (r.get("fused_ms"), r.get("fused_over_split"))
            if v1
            else (r.get("keys_first_ms"), r.get("keys_first_over_split"))
        )
        rows.append(
            {
                "rows": int(n),
                "split ms": r.get("split_ms"),
                "heads-first ms": heads[0],
                "heads-first / split": heads[1],
                "keys-first ms": keys[0],
                "keys-first / split": keys[1],
                "unordered / split": r.get("unordered_over_split"),
                "unordered keys-first / split": r.get("unordered_keys_first_over_split"),
                "no dq / split": r.get("no_dq_over_split"),
                "gluon / split": r.get("gluon_over_split"),  # with --gluon only
                "gluon heads-first / split": r.get("gluon_heads_first_over_split"),  # v4 on
                "gluon unordered / split": r.get("gluon_unordered_over_split"),  # v4 on
                "gluon no dq adds / split": r.get("gluon_no_dq_over_split"),  # v4 on
                # its dq the Triton candidate's, dk and dv the split's, orders alike, every call alike
                "gluon bitwise": all(v for k, v in r["gluon"].items() if k != "calls") if "gluon" in r else None,
                "dk, dv bitwise": bool(bits) and all(bits.values()),
                "dq rel L2 vs split": r.get("dq_rel_l2_vs_split"),
                "fused repeats bitwise": r.get("fused_repeat_bitwise"),
                "orders bitwise": r.get("orders_bitwise"),
            }
        )
    return pd.DataFrame(rows).set_index("rows")


def profile(record: list) -> pd.DataFrame:
    """Per row count: the block's wall and kernel ms, what the host adds, launches, the GPU's idle ms;
    with an eager profile, both blocks' kernel ms by role (attention, GEMM, other) and the canonical
    block's extra per role."""
    rows = []
    for r in record:
        row = {
            "rows": r["rows"],
            "wall ms": r["wall_median_s"] * MS,
            "kernels ms": r["kernel_s"] * MS,
            "host adds ms": r["host_added_s"] * MS,
            "launches": r.get("launches"),
            "GPU idle ms": (r.get("marked_run") or {}).get("idle_us", float("nan")) / MS,
        }
        if "eager" in r:
            row["eager wall ms"] = r["eager"]["wall_median_s"] * MS
            for role, ms in r["by_role_ms"].items():
                row[f"{role} ms"] = ms
                row[f"eager {role} ms"] = r["eager"]["by_role_ms"][role]
                row[f"extra {role} ms"] = r["extra_ms_by_role"][role]
        rows.append(row)
    return pd.DataFrame(rows).set_index("rows")


LAYOUT_COLUMNS = {
    "det_ms": "det step ms",
    "eager_ms": "eager step ms",
    "ratio": "det / eager",
    "overhead": "overhead vs tp1",
    "det_collective_share": "det collective share",
    "det_step_extra_gib": "det step GiB",
    "eager_step_extra_gib": "eager step GiB",
}


def layouts(record: dict) -> pd.DataFrame:
    """Per layout and row count: the deterministic and the eager step (median ms), their ratio, memory, bits."""
    rows = []
    for r in record.get("comparison", []):
        bits = r.get("bits_vs_tp1")
        verdict = None if bits is None else "equal" if bits["equal"] else "DIFFER"
        rows.append({"layout": r["layout"], "rows": r["rows"]} | {v: r.get(k) for k, v in LAYOUT_COLUMNS.items()})
        rows[-1]["bits vs tp1"] = verdict
    return pd.DataFrame(rows).set_index(["layout", "rows"]) if rows else pd.DataFrame()


def collectives(record: dict | list) -> pd.DataFrame:
    """Per operation, size and algorithm: the slowest rank's median ms and bus bandwidth (GB/s), and the
    ratio to the backend's own sum. Reads the per-rank lists of older records too."""
    if isinstance(record, dict):
        rows = [
            {
                "op": r["op"],
                "MiB": f"{r['mib']:g}",
                "algorithm": r["name"],
                "ms": r["median_s"] * MS,
                "bus GB/s": r["bus_bw_gbs"],
                "vs backend": r.get("vs_backend"),
            }
            for r in record.get("rows", [])
        ]
        return pd.DataFrame(rows).set_index(["op", "MiB", "algorithm"]) if rows else pd.DataFrame()
    per_rank = pd.DataFrame([b | {"rank": r["rank"]} for r in record for b in r["bench"] if "median_s" in b])
    slowest = per_rank.groupby(["mib", "name"], sort=False)[["median_s", "bus_bw_gbs"]].agg(
        {"median_s": "max", "bus_bw_gbs": "min"}
    )
    slowest["median_s"] *= MS
    slowest.index = slowest.index.set_levels([f"{m:g}" for m in slowest.index.levels[0]], level=0)
    return slowest.rename(columns={"median_s": "ms", "bus_bw_gbs": "bus GB/s"}).rename_axis(["MiB", "algorithm"])


def train_step(record: dict) -> pd.DataFrame:
    """Per side (canonical, eager): the training step's median, min and max ms, its phases' medians (ms),
    peak GiB on CUDA; then the ratio of medians, the loss gap at the first step and whether the
    canonical step repeated bit for bit."""
    rows = []
    for side in record.get("order", ["canonical", "eager"]):
        r = record[side]
        rows.append(
            {"side": side}
            | {f"{k} ms": r["timed"][f"{k}_s"] * MS for k in ("median", "min", "max")}
            | {f"{k} ms": v * MS for k, v in r["phases_median_s"].items()}
            | {"peak GiB": (r.get("memory") or {}).get("peak_gib")}
        )
    df = pd.DataFrame(rows).set_index("side")
    first = (record.get("losses") or [{}])[0]
    df["canonical / eager"] = [record.get("ratio_median"), None]
    df["loss gap, first step"] = [first.get("rel_gap"), None]
    df["repeats bitwise"] = [(record["canonical"].get("repeat") or {}).get("bitwise"), None]
    return df


def train_profile(record: dict) -> pd.DataFrame:
    """Per part of the step: both sides' GPU ms and their ratio, then each side's launches and host ms
    (the profiled step's: a part whose host ms exceed its GPU ms waits for the host)."""
    parts = record["parts"]
    rows = []
    for row in record["side_by_side"]:
        c, e = parts["canonical"].get(row["part"], {}), parts["eager"].get(row["part"], {})
        rows.append(
            {"part": row["part"], "canonical GPU ms": row["canonical_ms"], "eager GPU ms": row["eager_ms"]}
            | {"canonical / eager": row["ratio"]}
            | {"canonical launches": c.get("launches"), "eager launches": e.get("launches")}
            | {"canonical host ms": c.get("host_ms"), "eager host ms": e.get("host_ms")}
        )
    return pd.DataFrame(rows).set_index("part")


def parallelize_step(record: dict) -> pd.DataFrame:
    """Per layout, rank and side (tp1: parallelize_flow, trainer, eager, parallelize_custom; tp2: each
    rank's parallelize_custom): the step's median, min and max ms, peak GiB on CUDA, the median against
    tp1's trainer, and the bitwise verdict the side has (parallelize_flow against trainer, tp2 against tp1)."""
    layouts = record.get("layouts", {})
    trainer = layouts["tp1"][0]["sides"]["trainer"]["timed"]["median_s"]
    bitwise = record.get("bitwise", {})
    verdict = {("tp1", "parallelize_flow"): bitwise.get("parallelize_flow = trainer")}
    rows = []
    for layout, ranks in layouts.items():
        for r in ranks:
            for side, v in r["sides"].items():
                tp2 = bitwise.get("tp2 = tp1 (parallelize_custom, every rank)") if layout != "tp1" else None
                rows.append(
                    {"layout": layout, "rank": r["rank"], "side": side}
                    | {f"{k} ms": v["timed"][f"{k}_s"] * MS for k in ("median", "min", "max")}
                    | {"peak GiB": (v.get("memory") or {}).get("peak_gib")}
                    | {"median / trainer": v["timed"]["median_s"] / trainer}
                    | {"bitwise": verdict.get((layout, side), tp2)}
                )
    return pd.DataFrame(rows).set_index(["layout", "rank", "side"])


TABLES: dict[str, Callable[[Any], pd.DataFrame]] = {
    "train_step": train_step,
    "train_step_depth": train_step,  # the same record at the deepest depth that fits the node
    "train_profile": train_profile,
    "parallelize_step": parallelize_step,
    "block": block_gpu,
    "block_long": block_gpu,
    "block_cpu": block_cpu,
    "gemm": gemm,
    "chain": chain,
    "attention": attention,
    "attention_long": attention_long,
    "attention_fused": attention_fused,
    "profile": profile,
    "layouts": layouts,
    "collectives": collectives,
}


def table(name: str, record: Any) -> pd.DataFrame:
    """The table of benchmark `name`; ValueError naming the allowed names for an unknown one."""
    if name not in TABLES:
        raise ValueError(f"no table for benchmark {name!r}; allowed: {sorted(TABLES)}")
    return TABLES[name](record)
