"""Fixed-order GEMMs (h3lab.triton.gemm.mm, unit_gemm.unit_mm) against cuBLAS on one GPU, as one JSON record.

    python -m h3lab.bench.gemm_bench --out reports/h200/gemm.json [--candidates all|NAME,...] [--ms 264,4096,16384]

For the pinned configuration and every candidate below (bf16 operands, real H3 shapes, M rows =
tokens) it records the median time (triton.testing.do_bench: L2 flushed before every call, CUDA
events), TFLOP/s and the ratio to cuBLAS (torch.mm, TF32 and reduced-precision reductions off);
unit-tree GEMMs are compared with ONE cuBLAS GEMM over the concatenated K. Every candidate is also
checked against the contract on this GPU: row slices (M in 1, 3, 17, 264, 4099), column slices (one
of them misaligned, so it takes the pointer path), TMA == pointer loads, bf16 output == the FP32
output rounded once, repeat runs, unit groupings TP2/4/8 == TP1, unit partials == mm partials, and
float64 error. `summary` names the fastest candidates that keep the contract (paste them into
kernels/sm90.json). About 3-4 minutes on an H200 with every candidate, most of it compiling.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from torch import Tensor

from h3lab.io.jsonfile import write_json
from h3lab.ops.fixed import round_to, unit_tree
from h3lab.triton import gemm, gemm_host, unit_gemm
from h3lab.triton.configs import node_of

BENCH_FORMAT = "h3lab-bench-gemm-v1"
BF16, F32, DEV = torch.bfloat16, torch.float32, "cuda"
TARGETS = {"mm_264": 0.6, "mm_4096+": 0.85, "unit": 0.75}  # fraction of cuBLAS (the brief's targets)


def _mm(bm: int, bn: int, w: int, s: int, split: int = 1, **kw: Any) -> dict[str, Any]:
    return {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": 64,
        "GROUP_M": 8,
        "num_warps": w,
        "num_stages": s,
        "TMA": True,
        "TMA_STORE": True,
        "EPILOGUE_SPLIT": split,
        "FLATTEN": False,
        "WARP_SPECIALIZE": False,
        **kw,
    }


def _unit(bm: int, bn: int, w: int, s: int, pending: bool, tma_store: bool = False, **kw: Any) -> dict[str, Any]:
    return {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": 64,
        "GROUP_M": 8,
        "num_warps": w,
        "num_stages": s,
        "TMA": True,
        "TMA_STORE": tma_store,
        "PENDING_IN_REGS": pending,
        "SCRATCH_TMA": True,
        **kw,
    }


# BLOCK_K stays 64 everywhere: it divides every real unit width (896, 1792, 12096) and keeps the
# per-element chain the same across candidates. Offline sm90 compiles (Triton 3.9; shared memory
# must stay <= 227 KiB = 232448 B, and FP32 outputs must fit too: row_mm and the AdaLN table use
# them): 128x256 s3 = 176 KiB bf16 / 208 KiB fp32 out (TMA store in 2 column halves), 154
# registers; 128x128 s4 = 160 / 192 KiB, 90 registers (w8); 64x256 s4 = 176 / 192 KiB; 256x128 s3
# = 208 KiB; 128x256 s4 would need 256 KiB with an FP32 output (left out). unit 128x128 w8: s3 with
# the level-0 sibling in registers = 160 KiB, 204 registers (252 with 3 pieces), no spill; s4 = 192
# KiB, 254 + 8 B spill; s4 without it = 192 KiB, 156 registers; a TMA output store adds 64 KiB.
MM_CANDIDATES = {
    "m128n256w8s3": _mm(128, 256, 8, 3, split=2),  # 2 warpgroups x m64n256: the canonical Hopper tile
    "m128n256w8s3_ptrstore": _mm(128, 256, 8, 3, TMA_STORE=False),  # epilogue straight from registers
    "m128n128w8s4": _mm(128, 128, 8, 4),  # twice the tiles: fills 132 SMs at M=264 (126 tiles at N=5376)
    "m128n128w4s4": _mm(128, 128, 4, 4),  # one warpgroup, 128 accumulator registers/thread
    "m64n256w4s4": _mm(64, 256, 4, 4, split=2),  # less padding at M=264 (320 rows computed, not 384)
    "m256n128w8s3": _mm(256, 128, 8, 3, split=2),  # tall tile: each warpgroup m64n128 x 2
}
UNIT_CANDIDATES = {
    "m128n128w8s3p": _unit(128, 128, 8, 3, pending=True),  # level-0 sibling in registers
    "m128n128w8s4p": _unit(128, 128, 8, 4, pending=True),
    "m128n128w8s4": _unit(128, 128, 8, 4, pending=False),  # every level in scratch: fewer registers
    "m128n128w8s3p_tmastore": _unit(128, 128, 8, 3, pending=True, tma_store=True),
    # the entries above run unit_gemm.unit_mm_kernel (Triton; m128n128w8s4p is the tile it runs for
    # the calls the Gluon kernel cannot take, kernels/sm90.json); IMPL gluon: h3lab.triton.unit_gemm_sm90,
    # one pipeline across unit and tile boundaries (registers and shared memory: python -m
    # h3lab.bench.compile_sm90); the calls the Gluon kernel cannot take run the Triton kernel of the
    # same config
    "gluon_s4": _unit(128, 128, 8, 4, pending=True, IMPL="gluon", LVL2_SMEM=False),
    "gluon_s3_smem": _unit(128, 128, 8, 3, pending=True, IMPL="gluon", LVL2_SMEM=True),
}
# name: (K, N, b layout): "WT" = a weight [N, K] seen as b = W.T (forward), "KN" = [K, N] rows (dX);
# K = 0: the weight-gradient form dW = dY^T X (h3lab.triton.rows.row_mm): [5376, M] @ [M, N], K = M rows
MM_SHAPES = {
    "q": (5376, 7168, "WT"),
    "qkv": (5376, 21504, "WT"),
    "to_out": (7168, 5376, "WT"),
    "ff.net.0": (5376, 28672, "WT"),
    "ff.net.2": (14336, 5376, "WT"),
    "ff.net.2.dx": (5376, 14336, "KN"),
    "ff.net.2.dw": (0, 14336, "KN"),
}
DW_ROWS = 5376  # the dW form's output rows (hidden size D)
# name: (Kp per piece, N, b layout), U = 8
UNIT_SHAPES = {
    "to_out": ((896,), 5376, "WT"),
    "ff.net.2": ((1792,), 5376, "WT"),
    "qkv.dx": ((896, 896, 896), 5376, "KN"),
    "ff.net.0.dx": ((1792, 1792), 5376, "KN"),
}


# contract-check sizes: 4111 rows (prime), slices (start, rows) of 1, 3, 17, 264, 4099 rows; q-projection
# operands (K = 5376) with W.T (N = 7168) and [K, N] (N = 4100) weights; path checks on SMALL rows
CHECK_ROWS, CHECK_K, CHECK_N = 4111, 5376, {"WT": 7168, "KN": 4100}
ROW_SLICES = ((0, 1), (7, 3), (100, 17), (1000, 264), (5, 4099))
COL_SLICES = ((0, 1), (3, 300), (256, 4000))  # [K, N] at column 3: a misaligned base -> the pointer path
SMALL = 264
TINY_UNITS = ((32,), (432,), (64, 64))  # tiny's unit widths: partial 64-chunks at each unit's end


def _randn(*shape: int, seed: int, dtype: torch.dtype = BF16) -> Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, generator=g).to(dtype)


def _b(K: int, N: int, layout: str, seed: int) -> Tensor:
    return _randn(N, K, seed=seed).t() if layout == "WT" else _randn(K, N, seed=seed)


def _mm_operands(shape: str, M: int) -> tuple[Tensor, Tensor]:
    K, N, layout = MM_SHAPES[shape]
    if K == 0:  # dY^T (column-major view of the [M, D] gradient) @ X [M, N]
        return _randn(M, DW_ROWS, seed=3).t(), _randn(M, N, seed=4)
    return _randn(M, K, seed=3), _b(K, N, layout, seed=4)


def _pieces(M: int, kps: tuple[int, ...], N: int, layout: str, seed: int) -> list[tuple[Tensor, Tensor]]:
    return [(_randn(M, 8 * kp, seed=seed + 2 * i), _b(8 * kp, N, layout, seed + 2 * i + 1)) for i, kp in enumerate(kps)]


def _same(x: Tensor, y: Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def _sha(x: Tensor) -> str:
    return hashlib.sha256(x.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def _rel64(out: Tensor, pieces: list[tuple[Tensor, Tensor]]) -> float:
    exact = sum(a.double() @ b.double() for a, b in pieces)
    return float((out.double() - exact).norm() / exact.norm())


def _ms(fn: Callable[[], Any], big: bool) -> float:
    return float(triton.testing.do_bench(fn, warmup=20 if big else 10, rep=80 if big else 40, return_mode="median"))


# ---- contract checks ----------------------------------------------------------------------------


def contract_mm(cfg: dict[str, Any]) -> dict[str, Any]:
    a = _randn(CHECK_ROWS, CHECK_K, seed=1)
    checks: dict[str, bool] = {}
    for layout, N in CHECK_N.items():
        b = _b(CHECK_K, N, layout, seed=2)
        full = gemm.mm(a, b, F32, config=cfg)
        rows = [_same(gemm.mm(a[lo : lo + m], b, F32, config=cfg), full[lo : lo + m]) for lo, m in ROW_SLICES]
        cols = [_same(gemm.mm(a, b[:, lo:hi], F32, config=cfg), full[:, lo:hi]) for lo, hi in COL_SLICES]
        checks[f"rows_{layout}"], checks[f"cols_{layout}"] = all(rows), all(cols)
        checks[f"repeat_{layout}"] = _same(gemm.mm(a, b, F32, config=cfg), full)
        a_s, full_s = a[:SMALL], full[:SMALL]
        pointer = cfg | {"TMA": False, "TMA_STORE": False}
        checks[f"tma_eq_pointer_{layout}"] = _same(gemm.mm(a_s, b, F32, config=pointer), full_s)
        a_cm = a_s.t().contiguous().t()  # column-major a: the dW form
        checks[f"a_colmajor_{layout}"] = _same(gemm.mm(a_cm, b, F32, config=cfg), full_s)
        checks[f"bf16_one_rounding_{layout}"] = _same(gemm.mm(a_s, b, BF16, config=cfg), round_to(full_s, BF16))
    rel = _rel64(full[:SMALL], [(a[:SMALL], b)])
    return {"ok": all(checks.values()) and rel < 1e-5, "checks": checks, "rel_err_f64": rel, "sha_full": _sha(full)}


def _units_of(pieces: list[tuple[Tensor, Tensor]], lo: int, hi: int) -> list[tuple[Tensor, Tensor]]:
    """The pieces a TP rank holding units [lo, hi) of 8 sees."""
    return [
        (a[:, lo * (a.shape[1] // 8) : hi * (a.shape[1] // 8)], b[lo * (b.shape[0] // 8) : hi * (b.shape[0] // 8)])
        for a, b in pieces
    ]


def contract_unit(cfg: dict[str, Any], mm_cfg: dict[str, Any]) -> dict[str, Any]:
    checks: dict[str, bool] = {}
    rel, shas = {}, {}
    tile_mm = mm_cfg | {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
    run = lambda p, u: unit_gemm.unit_mm(p, u, config=cfg)  # noqa: E731
    for name, (kps, N, layout) in UNIT_SHAPES.items():
        pieces = _pieces(SMALL, kps, N, layout, seed=10)
        full = run(pieces, 8)
        for tp in (2, 4, 8):
            per = 8 // tp
            checks[f"{name}_tp{tp}"] = _same(
                unit_tree([run(_units_of(pieces, r * per, (r + 1) * per), per) for r in range(tp)]), full
            )
        checks[f"{name}_rows"] = _same(run([(a[17:20], b) for a, b in pieces], 8), full[17:20])
        checks[f"{name}_cols"] = _same(run([(a, b[:, 3:31]) for a, b in pieces], 8), full[:, 3:31])
        checks[f"{name}_repeat"] = _same(run(pieces, 8), full)
        if cfg.get("IMPL") == "gluon":  # the Gluon kernel against the Triton kernel of the same tiles
            triton_cfg = cfg | {"IMPL": "triton"}
            for m in (1, 17, SMALL):
                p = [(a[:m], b) for a, b in pieces]
                checks[f"{name}_gluon_eq_triton_M{m}"] = _same(run(p, 8), unit_gemm.unit_mm(p, 8, config=triton_cfg))
        rel[name], shas[name] = _rel64(full, pieces), _sha(full)
        if len(kps) == 1:  # partial i == mm(a[:, unit i], b[unit i]): same tiles (must), pinned mm tiles (informative)
            for label, c in (("tree_of_mm_same_tiles", tile_mm), ("tree_of_mm_pinned_mm", mm_cfg)):
                parts = [gemm.mm(*_units_of(pieces, u, u + 1)[0], config=c) for u in range(8)]
                checks[f"{name}_{label}"] = _same(unit_tree(parts), full)
    for kps in TINY_UNITS:
        pieces = _pieces(37, kps, 192, "KN", seed=20)
        halves = [run(_units_of(pieces, 4 * h, 4 * h + 4), 4) for h in (0, 1)]
        checks[f"tiny{kps}_tp2"] = _same(halves[0] + halves[1], run(pieces, 8))
    must = {k: v for k, v in checks.items() if not k.endswith("pinned_mm")}
    return {"ok": all(must.values()) and max(rel.values()) < 1e-5, "checks": checks, "rel_err_f64": rel, "sha": shas}


# ---- timings ------------------------------------------------------------------------------------


def _kernel_resources(fn: Any) -> list[dict[str, Any]]:
    """Registers, spills and shared memory of every compiled variant of a @triton.jit kernel (best effort)."""
    out = []
    try:
        for cache in fn.device_caches.values():
            for k in cache[0].values():
                md = k.metadata
                out.append(
                    {
                        "regs": k.n_regs,
                        "spills": k.n_spills,
                        "shared": md.shared,
                        "warps": md.num_warps,
                        "stages": md.num_stages,
                    }
                )
    except Exception as e:  # the cache layout is Triton-version specific
        out.append({"error": f"{type(e).__name__}: {e}"})
    return out


def bench(names: set[str] | None, ms_list: list[int]) -> dict[str, Any]:
    node = node_of(DEV)
    mm_pin, unit_pin = gemm_host.kernel_config("gemm", node, False), gemm_host.kernel_config("unit_gemm", node, False)
    mm_c = {"pinned": mm_pin, **{n: c for n, c in MM_CANDIDATES.items() if c != mm_pin}}
    unit_c = {"pinned": unit_pin, **{n: c for n, c in UNIT_CANDIDATES.items() if c != unit_pin}}
    if names:
        mm_c = {n: c for n, c in mm_c.items() if n in names or n == "pinned"}
        unit_c = {n: c for n, c in unit_c.items() if n in names or n == "pinned"}
    rec: dict[str, Any] = {"mm": {}, "unit": {}, "cublas": {}}
    for kind, cands in (("mm", mm_c), ("unit", unit_c)):
        for name, cfg in cands.items():
            r: dict[str, Any] = {"config": cfg, "ms": {}, "tflops": {}, "ratio": {}}
            try:
                r["contract"] = contract_mm(cfg) if kind == "mm" else contract_unit(cfg, mm_pin)
            except Exception as e:  # a candidate that does not compile (shared memory) is a result too
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rec[kind][name] = r
    for M in ms_list:
        big = M >= 16384
        for shape in MM_SHAPES:
            a, b = _mm_operands(shape, M)
            key, flop = f"{shape}@{M}", 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
            rec["cublas"][f"mm:{key}"] = cb = _ms(lambda a=a, b=b: torch.mm(a, b), big)
            for r in rec["mm"].values():
                if "error" not in r:
                    try:
                        t = _ms(lambda a=a, b=b, c=r["config"]: gemm.mm(a, b, BF16, config=c), big)
                        r["ms"][key], r["tflops"][key], r["ratio"][key] = t, flop / t * 1e-9, cb / t
                    except Exception as e:
                        r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            del a, b
        for shape, (kps, N, bl) in UNIT_SHAPES.items():
            pieces = _pieces(M, kps, N, bl, seed=5)
            a_cat, b_cat = torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 0)
            if bl == "WT":
                b_cat = b_cat.t().contiguous().t()  # cuBLAS gets the same K-major weight layout
            key, flop = f"{shape}@{M}", 2.0 * M * N * a_cat.shape[1]
            rec["cublas"][f"unit:{key}"] = cb = _ms(lambda a=a_cat, b=b_cat: torch.mm(a, b), big)
            for r in rec["unit"].values():
                if "error" not in r:
                    try:
                        t = _ms(lambda p=pieces, c=r["config"]: unit_gemm.unit_mm(p, 8, config=c), big)
                        r["ms"][key], r["tflops"][key], r["ratio"][key] = t, flop / t * 1e-9, cb / t
                    except Exception as e:
                        r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            del pieces, a_cat, b_cat
        torch.cuda.empty_cache()
    a, b = _randn(SMALL, CHECK_K, seed=6), _b(CHECK_K, CHECK_N["WT"], "WT", seed=7)
    for r in rec["mm"].values():  # host cost of one launch (validation, descriptors, launch)
        if "error" not in r:
            gemm.mm(a, b, BF16, config=r["config"])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                gemm.mm(a, b, BF16, config=r["config"])
            r["host_us_per_call"] = (time.perf_counter() - t0) / 50 * 1e6
            torch.cuda.synchronize()
    rec["resources"] = {"mm": _kernel_resources(gemm.mm_kernel), "unit": _kernel_resources(unit_gemm.unit_mm_kernel)}
    return rec


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    """Per candidate: worst and geometric-mean ratio to cuBLAS per M, targets met; the fastest contract-keeping one."""
    out: dict[str, Any] = {"targets": TARGETS, "candidates": {}, "best": {}}
    for kind in ("mm", "unit"):
        scores = {}
        for name, r in rec[kind].items():
            if "error" in r or not r["ratio"]:
                out["candidates"][f"{kind}:{name}"] = {"error": r.get("error", "no timings")}
                continue
            by_m: dict[str, list[float]] = {}
            for key, ratio in r["ratio"].items():
                by_m.setdefault(key.split("@")[1], []).append(ratio)
            s = {f"M{m}": {"min": min(v), "geomean": math.exp(sum(map(math.log, v)) / len(v))} for m, v in by_m.items()}
            if kind == "mm":
                met = all(
                    v["min"] >= (TARGETS["mm_264"] if int(m[1:]) < 4096 else TARGETS["mm_4096+"]) for m, v in s.items()
                )
            else:
                met = all(v["min"] >= TARGETS["unit"] for v in s.values())
            s |= {"contract_ok": r["contract"]["ok"], "targets_met": met}
            out["candidates"][f"{kind}:{name}"] = s
            all_r = list(r["ratio"].values())
            if r["contract"]["ok"]:
                scores[name] = math.exp(sum(map(math.log, all_r)) / len(all_r))
        best = max(scores, key=scores.get) if scores else None
        out["best"][kind] = {
            "name": best,
            "geomean_ratio": scores.get(best),
            "config": rec[kind][best]["config"] if best else None,
        }
    shas = {n: r["contract"]["sha_full"] for n, r in rec["mm"].items() if "contract" in r}
    out["mm_bit_classes"] = sorted({tuple(sorted(n for n in shas if shas[n] == s)) for s in shas.values()})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="JSON record to write")
    ap.add_argument("--candidates", default="all", help="all, or comma-separated names (the pinned ones always run)")
    ap.add_argument("--ms", default="264,4096,16384", help="comma-separated row counts M")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemm_bench needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    t0 = time.perf_counter()
    names = None if args.candidates == "all" else set(args.candidates.split(","))
    env = {
        "gpu": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "node": node_of(DEV),
        "cublas": "torch.mm, allow_tf32=False, allow_bf16_reduced_precision_reduction=False",
    }
    rec = bench(names, [int(m) for m in args.ms.split(",")])
    record = {
        "format": BENCH_FORMAT,
        "env": env,
        "summary": summarize(rec),
        **rec,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, record)
    print(f"{'candidate':34s} {'contract':8s} " + " ".join(f"{'M' + m:>16s}" for m in args.ms.split(",")))
    for name, s in record["summary"]["candidates"].items():
        cells = " ".join(
            f"{s[k]['min']:6.2f}/{s[k]['geomean']:5.2f}    " if k in s else f"{'-':>16s}"
            for k in (f"M{m}" for m in args.ms.split(","))
        )
        print(f"{name:34s} {str(s.get('contract_ok', s.get('error', '')))[:8]:8s} {cells}")
    best = {k: v["name"] for k, v in record["summary"]["best"].items()}
    print(f"(min/geomean ratio to cuBLAS over shapes) best: {best}, wall {record['wall_s']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
