"""The row-chain kernels (row_sum, segment_sum) against their launch settings, at the block's shapes.

`python -m h3lab.bench.rows_bench --out FILE.json [--rows 4096]` times row_sum over [R, 5376] and
[R, 7168] FP32 rows, segment_sum into 6 segments, and the block's six-set group one call after
another and in one launch (rows.chain_sums) for every (block_n, unroll) candidate, and
checks that each candidate gives the bits of the pinned one (the chains' bits depend on neither).
A chain is serial over rows, so a program's speed is the loads it keeps in flight (unroll) and the
kernel's is programs x unroll x block_n x 4 bytes in flight against the memory latency.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from h3lab.bench.block_gpu import cuda_times
from h3lab.io.jsonfile import write_json
from h3lab.metrics import bitwise_equal
from h3lab.rowplan import index_cache
from h3lab.triton import configs, rows

CANDIDATES = [(32, 16), (32, 32), (32, 64), (32, 128), (16, 64), (64, 64)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    node = configs.node_of(dev)
    pinned = configs.pinned("rows", node)
    g = torch.Generator(device=dev).manual_seed(0)
    R = a.rows
    order = torch.randperm(R, device=dev, generator=g)
    segment = torch.randint(0, 6, (R,), device=dev, generator=g)
    cases = {
        "row_sum_5376": lambda: rows.row_sum(x5, order, node=node),
        "row_sum_7168": lambda: rows.row_sum(x7, order, node=node),
        "segment_sum_5376": lambda: rows.segment_sum(x5, segment, 6, order, node=node),
        # the block's last six chain sets (norm1, norm_q, norm_k weights; three AdaLN table columns),
        # one launch after another and in one launch (rows.chain_sums): the same bits, side by side
        "six_sets_apart": lambda: (
            [rows.row_sum(x, order, node=node) for x in (x5, x7, x7b)]
            + [rows.segment_sum(x, segment, 6, order, node=node) for x in tables]
        ),
        "six_sets_one_launch": lambda: rows.chain_sums([x5, x7, x7b], tables, segment, 6, order, node=node),
    }
    x5 = torch.randn(R, 5376, device=dev, generator=g)
    x7 = torch.randn(R, 7168, device=dev, generator=g)
    x7b = torch.randn(R, 7168, device=dev, generator=g)
    tables = [torch.randn(R, 5376, device=dev, generator=g) for _ in range(3)]
    records, reference = [], {name: _flat(fn()) for name, fn in cases.items()}
    if not bitwise_equal(reference["six_sets_one_launch"], reference["six_sets_apart"]):
        raise AssertionError("rows.chain_sums differs from the single calls")
    with index_cache():  # index facts once, as inside a block step: the times are the kernels'
        for block_n, unroll in CANDIDATES:
            _sweep(block_n, unroll, pinned, cases, reference, records, a.reps)
    write_json(a.out, {"rows": R, "pinned": pinned, "records": records})


def _sweep(block_n: int, unroll: int, pinned: dict, cases: dict, reference: dict, records: list, reps: int) -> None:
    real = configs.pinned
    cfg = pinned | {"block_n": block_n, "unroll": unroll}
    configs.pinned = lambda kernel, n: dict(cfg) if kernel == "rows" else real(kernel, n)
    try:
        for name, fn in cases.items():
            if name.startswith("six_sets") and unroll > 64:  # 6 sets x 128 unrolled rows: not compiled in 150 s (H200)
                continue
            same = bitwise_equal(_flat(fn()), reference[name])
            ms = statistics.median(cuda_times(fn, reps)) * 1e3
            records.append({"case": name, "block_n": block_n, "unroll": unroll, "ms": ms, "same_bits": same})
            print(name, block_n, unroll, f"{ms:.3f} ms", "same bits" if same else "BITS DIFFER", flush=True)
    finally:
        configs.pinned = real


def _flat(out: torch.Tensor | list | tuple) -> torch.Tensor:
    """One tensor of every output's elements, in order (chain_sums returns two lists)."""
    if isinstance(out, torch.Tensor):
        return out.reshape(-1)
    return torch.cat([_flat(o) for o in out]) if out else torch.zeros(0)


if __name__ == "__main__":
    main()
