"""The float32 modules' chain GEMM (h3lab.triton.chain) over its tiles, at the training step's shapes.

    python -m h3lab.bench.chain_bench --out FILE.json [--candidates all|pinned]

Per shape (M, K, N of the step's calls at 4096 rows, real config: the heads' projection and its
weight gradient over rows, the time embedder's few-row layers, an embedder's weight gradient) and
per candidate tile (BLOCK_M, BLOCK_N, UNROLL, num_warps): median milliseconds (CUDA events, after a
call that compiles) and whether its bytes equal the pinned tile's (every tile must: each output
element is one chain over k, fixed by the reference). cuBLAS's FP32 GEMM of the shape is timed
beside it as what a user would run instead (other bits: not a chain). The record names the fastest
candidate per shape and the one fastest over all shapes together (the sum of their medians), the
tile to pin.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path
from typing import Any

import torch

from h3lab.bench.attention_long import timed
from h3lab.io.env import capture as capture_env
from h3lab.io.jsonfile import write_json
from h3lab.metrics import bitwise_equal
from h3lab.triton import chain, configs

BENCH_FORMAT = "h3lab-bench-chain-v1"
# (what, M, K, N, a's dtype): the chain calls of a training step at 4096 rows (real config)
SHAPES = (
    ("head projection", 4096, 5376, 96, torch.float32),
    ("head projection dW over rows", 96, 4096, 5376, torch.float32),
    ("time embedder linear_2", 3, 5376, 2688, torch.float32),
    ("time embedder linear_1", 3, 256, 5376, torch.float32),
    ("embedder dW over rows", 5376, 4096, 96, torch.bfloat16),
)
TILES = [
    {"BLOCK_M": m, "BLOCK_N": n, "UNROLL": u, "num_warps": w}
    for m, n, u, w in itertools.chain(
        itertools.product((16, 32, 64), (32, 64), (1, 4, 8), (4,)), [(16, 32, 8, 2), (32, 32, 8, 2), (16, 16, 8, 1)]
    )
]


def bench_shape(what: str, M: int, K: int, N: int, a_dtype: torch.dtype, tiles: list[dict]) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(M + K + N)
    a = torch.randn(M, K, device="cuda", generator=g).to(a_dtype)
    b = torch.randn(N, K, device="cuda", generator=g).t()  # a weight's transpose, as the modules pass it
    pinned = configs.pinned("chain", configs.node_of(a.device))
    want = chain.chain_mm(a, b)
    rec: dict[str, Any] = {"what": what, "M": M, "K": K, "N": N, "a_dtype": str(a_dtype), "tiles": []}
    for tile in tiles:
        got = chain.chain_mm(a, b, config=tile)
        t = timed(lambda tile=tile: chain.chain_mm(a, b, config=tile))
        rec["tiles"].append(tile | {"ms": t["ms"], "spread_ms": t["spread_ms"], "bitwise": bitwise_equal(got, want)})
    rec["pinned_ms"] = timed(lambda: chain.chain_mm(a, b))["ms"]
    rec["pinned"] = {k: pinned[k] for k in chain.CONFIG_KEYS}
    rec["cublas_fp32_ms"] = timed(lambda: a.float() @ b)["ms"]
    if rec["tiles"]:  # --candidates pinned times the pin alone: no fastest, no comparison
        best = min(rec["tiles"], key=lambda r: r["ms"])
        rec["fastest"] = {k: best[k] for k in (*chain.CONFIG_KEYS, "ms")}
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--candidates", choices=("all", "pinned"), default="all")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("chain_bench needs a CUDA device")
    tiles = TILES if a.candidates == "all" else []
    t0 = time.perf_counter()
    record: dict[str, Any] = {"format": BENCH_FORMAT, "env": capture_env(torch.device("cuda")), "shapes": []}
    for shape in SHAPES:
        record["shapes"].append(r := bench_shape(*shape, tiles))
        record["wall_s"] = round(time.perf_counter() - t0, 1)
        write_json(a.out, record)
        print(
            r["what"],
            "pinned",
            round(r["pinned_ms"], 3),
            "fastest",
            r.get("fastest"),
            "cublas",
            round(r["cublas_fp32_ms"], 3),
        )
    if tiles:
        totals = [sum(s["tiles"][i]["ms"] for s in record["shapes"]) for i in range(len(tiles))]
        i = min(range(len(tiles)), key=totals.__getitem__)
        record["fastest_overall"] = tiles[i] | {
            "sum_ms": totals[i],
            "pinned_sum_ms": sum(s["pinned_ms"] for s in record["shapes"]),
        }
        record["all_bitwise"] = all(t["bitwise"] for s in record["shapes"] for t in s["tiles"])
        write_json(a.out, record)
        print("fastest overall", record["fastest_overall"], "all bitwise", record["all_bitwise"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
