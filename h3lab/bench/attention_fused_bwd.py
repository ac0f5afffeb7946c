"""The split attention backward (the Triton kernels) against fused ones with dq summed in key-block order.

    python -m h3lab.bench.attention_fused_bwd --out FILE.json [--rows 16384,32768] [--heads 56] [--repeats 200]

Per row count (attention_long's inputs: one packed request, bf16, 56 heads x 128): the split
backward (delta, the Triton dq kernel at SPLIT_DQ, the pinned dk/dv kernel; 7 GEMM-sized products:
sm90's pin before its dq became the Gluon kernel's, `--gluon`, which kernels/sm90.json pins now) and
h3lab.triton.attention_fused (delta, one kernel; 5 products, dq added per key block in order behind
a turn counter), both on the pinned forward's statistics: median milliseconds (CUDA events, after a
warm-up that compiles), whether the fused dk, dv bytes equal the pinned ones, dq's relative L2
distance to the pinned dq (another summation order, so other bits), and whether `--repeats` fused
calls give one set of bytes (a turn released before its adds are visible shows here: FlashAttention
issue #2244). The fused kernel runs in both launch orders (attention_args.ORDERS): "fused" is
heads_first, "keys_first" the order that makes a head's key blocks wait in a wavefront; both must
give the same bytes. What the figure answers: the cost of an ordered dq when the compute warps wait
their turn themselves. Two diagnostics split that cost (attention_args.DQ_MODES; their dq is never
used): "unordered" adds the same partials without turns (in both launch orders), "skipped" (recorded
as no_dq) drops dq's product and adds. `--gluon` adds h3lab.triton.attention_fused_sm90 (sm90): its
bytes against the Triton candidate's dq and the split dk, dv, in both launch orders and over
`--repeats` calls, its time as "gluon" (keys_first, its default) and "gluon_heads_first", and its
diagnostics as "gluon_unordered" and "gluon_no_dq".
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from h3lab.bench.attention_long import DH, DTYPE, make_inputs, parse_rows, timed
from h3lab.io.env import capture as capture_env
from h3lab.io.jsonfile import write_json
from h3lab.metrics import bitwise_equal
from h3lab.triton import attention as att
from h3lab.triton.attention_fused import attention_bwd_fused

BENCH_FORMAT = "h3lab-bench-attention-fused-bwd-v4"  # v2: keys_first; v3: diagnostics; v4: Gluon's
FUSED = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}  # the dk/dv kernel's tile
SPLIT_DQ = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "TMA": True}  # the Triton dq kernel


def bench_rows(rows: int, heads: int, repeats: int = 2, node: str | None = None, gluon: bool = False) -> dict[str, Any]:
    x = make_inputs(rows, heads, seed=rows)
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    scale = DH**-0.5
    _, o_ref, stats = att.attention_fwd(q, k, v, scale, DTYPE, node=node)

    def split() -> tuple:
        delta = att.attention_delta(do, o_ref, node=node)
        dq = att.attention_bwd_q(q, do, stats, delta, k, v, scale, node=node, config=SPLIT_DQ)
        return (dq, *att.attention_bwd_kv(q, do, stats, delta, k, v, scale, node=node))

    def fused(order: str = "heads_first", dq_mode: str = "ordered") -> tuple:
        delta = att.attention_delta(do, o_ref, node=node)
        return attention_bwd_fused(q, do, stats, delta, k, v, scale, config=FUSED, order=order, dq_mode=dq_mode)

    def gluon_fused(order: str = "keys_first", dq_mode: str = "ordered") -> tuple:
        from h3lab.triton.attention_fused_sm90 import attention_bwd_fused_sm90

        delta = att.attention_delta(do, o_ref, node=node)
        return attention_bwd_fused_sm90(q, do, stats, delta, k, v, scale, order=order, dq_mode=dq_mode)

    want, got = split(), fused()
    calls, same = _repeats_bitwise(fused, got, repeats)
    other = fused("keys_first")
    dq_gap = float((got[0].double() - want[0].double()).norm() / want[0].double().norm())
    rec: dict[str, Any] = {"rows": rows, "keys": k.shape[0], "heads": heads, "fused_config": FUSED}
    rec["bitwise_vs_split"] = {"dk": bitwise_equal(got[1], want[1]), "dv": bitwise_equal(got[2], want[2])}
    rec["dq_rel_l2_vs_split"] = dq_gap
    rec["fused_calls"], rec["fused_repeat_bitwise"] = calls, same  # calls < --repeats: the last one differed
    rec["orders_bitwise"] = all(bitwise_equal(a, b) for a, b in zip(got, other, strict=True))
    if gluon:
        rec["gluon"] = _gluon_bits(gluon_fused, got, want, repeats)
    del want, got, other
    sides = _timed_sides(split, fused) | (_gluon_sides(gluon_fused) if gluon else {})
    for name, fn in sides.items():
        t = timed(fn)
        rec[f"{name}_ms"], rec[f"{name}_spread_ms"] = t["ms"], t["spread_ms"]
        if name != "split":
            rec[f"{name}_over_split"] = rec[f"{name}_ms"] / rec["split_ms"]
    return rec


def _gluon_bits(gluon: Callable[..., tuple], fused: tuple, split: tuple, repeats: int) -> dict[str, Any]:
    """The Gluon candidate's bytes: dq against the Triton candidate's, dk and dv against the split
    kernels', whether heads_first gives them too, and whether `repeats` calls give one set of bytes."""
    got = gluon()
    out = {"dq_vs_fused": bitwise_equal(got[0], fused[0])}
    out |= {"dk_vs_split": bitwise_equal(got[1], split[1]), "dv_vs_split": bitwise_equal(got[2], split[2])}
    out["orders_bitwise"] = all(bitwise_equal(a, b) for a, b in zip(got, gluon("heads_first"), strict=True))
    calls, same = _repeats_bitwise(gluon, got, repeats)
    return out | {"calls": calls, "repeat_bitwise": same}


def _repeats_bitwise(fn: Callable[[], tuple], first: tuple, repeats: int) -> tuple[int, bool]:
    """(calls made, whether each gave `first`'s bytes): `fn` called until `repeats` calls in all, `first`
    counted, stopping at the first call whose bytes differ."""
    calls, same = 1, True
    while same and calls < repeats:
        same, calls = all(bitwise_equal(a, b) for a, b in zip(first, fn(), strict=True)), calls + 1
    return calls, same


def _timed_sides(split: Callable[[], tuple], fused: Callable[..., tuple]) -> dict[str, Callable[[], tuple]]:
    """What is timed, by the record's name for it: the pinned split, the fused kernel in each launch
    order, and the diagnostics (module docstring)."""
    return {
        "split": split,
        "fused": fused,
        "keys_first": lambda: fused("keys_first"),
        "unordered": lambda: fused(dq_mode="unordered"),
        "unordered_keys_first": lambda: fused("keys_first", "unordered"),
        "no_dq": lambda: fused(dq_mode="skipped"),
    }


def _gluon_sides(gluon: Callable[..., tuple]) -> dict[str, Callable[[], tuple]]:
    """The Gluon candidate's timed sides: its default (keys_first), the other launch order, and its
    diagnostics (dq added without turns, no dq adds)."""
    return {
        "gluon": gluon,
        "gluon_heads_first": lambda: gluon("heads_first"),
        "gluon_unordered": lambda: gluon(dq_mode="unordered"),
        "gluon_no_dq": lambda: gluon(dq_mode="skipped"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rows", default="16384,32768")
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--repeats", type=int, default=2, help="fused calls whose bytes must all be equal (>= 2)")
    ap.add_argument("--gluon", action="store_true", help="also check and time the Gluon candidate (sm90)")
    a = ap.parse_args(argv)
    if a.repeats < 2:
        ap.error(f"--repeats {a.repeats}; allowed: >= 2")
    try:
        rows = parse_rows(a.rows)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("attention_fused_bwd needs a CUDA device")
    t0 = time.perf_counter()
    record: dict[str, Any] = {"format": BENCH_FORMAT, "env": capture_env(torch.device("cuda")), "rows": {}}
    for n in rows:
        record["rows"][n] = r = bench_rows(n, a.heads, a.repeats, gluon=a.gluon)
        record["wall_s"] = round(time.perf_counter() - t0, 1)
        write_json(a.out, record)
        print(n, {k: v for k, v in r.items() if not k.endswith("spread_ms")}, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
