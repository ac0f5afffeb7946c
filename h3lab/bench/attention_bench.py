"""Triton attention (h3lab.triton.attention) against torch SDPA on one GPU, as one JSON record.

    python -m h3lab.bench.attention_bench --out reports/h200/attention.json

Shapes: bf16, head_dim 128, Q = K in {4096, 264} rows, H in {56 (TP1), 7 (TP8)} heads. For every
candidate configuration of each kernel (the pinned one first) it records the median time
(triton.testing.do_bench), tensor-core TFLOPS, and whether the candidate keeps the contract on this
GPU: query slices, key slices and head subsets bitwise equal to the full call, repeat runs equal,
relative L2 error against float64 (H=2, Q=K=1031). SDPA is timed per backend (default choice,
flash, cuDNN, efficient) for forward and forward+backward; `summary` compares the pinned set and the
fastest contract-keeping candidates with SDPA flash. About 1-2 minutes on an H200.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from torch import Tensor

from h3lab.io.jsonfile import write_json
from h3lab.metrics import bit_pattern
from h3lab.triton import attention as att
from h3lab.triton.configs import describe, node_of

BENCH_FORMAT = "h3lab-bench-attention-v1"
DH, DTYPE, DEVICE = 128, torch.bfloat16, "cuda"
SHAPES = ((56, 4096), (56, 264), (7, 4096), (7, 264))  # (heads, rows = queries = keys); the first ranks
CHECK_HEADS, CHECK_ROWS = 4, 1031  # contract checks: ragged for every tile size (1031 = 8 * 128 + 7)
OUTPUTS = {
    "attention_fwd": ("o", "o_ref", "lse2"),
    "attention_delta": ("delta",),
    "attention_bwd_q": ("dq",),
    "attention_bwd_kv": ("dk", "dv"),
}
_C = lambda bm, bn, w, s: {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}  # noqa: E731
# Why these: fwd 128-row query tiles = 2 warpgroups of wgmma M=64 (FA2/FA3 Hopper shape); 64 vs
# 128 keys trades exp/softmax work per MMA against shared memory (k+v per stage: 32 vs 64 KiB).
# dq mirrors fwd; dk/dv keeps 128 keys x 128 head channels x 2 FP32 accumulators (128 regs/thread at
# 8 warps) and streams 32/64 queries per step (the tutorial uses 128 x 32 at 4 warps for Dh=64).
CANDIDATES: dict[str, dict[str, dict[str, Any]]] = {
    "attention_fwd": {
        "m128n64w8s3": _C(128, 64, 8, 3),
        "m128n64w8s4": _C(128, 64, 8, 4),
        "m128n128w8s2": _C(128, 128, 8, 2),
        "m128n128w8s3": _C(128, 128, 8, 3),
        "m64n64w4s3": _C(64, 64, 4, 3),
    },
    "attention_delta": {
        "r64w4": {"BLOCK_R": 64, "num_warps": 4},
        "r32w4": {"BLOCK_R": 32, "num_warps": 4},
        "r128w8": {"BLOCK_R": 128, "num_warps": 8},
    },
    "attention_bwd_q": {
        "m128n64w8s2": _C(128, 64, 8, 2),
        "m128n64w8s3": _C(128, 64, 8, 3),
        "m128n32w8s3": _C(128, 32, 8, 3),
        "m64n64w4s3": _C(64, 64, 4, 3),
        "m64n64w8s3": _C(64, 64, 8, 3),
        "m128n128w8s2": _C(128, 128, 8, 2),
    },
    "attention_bwd_kv": {
        "n128m64w8s2": _C(64, 128, 8, 2),
        "n128m64w8s3": _C(64, 128, 8, 3),
        "n128m32w8s3": _C(32, 128, 8, 3),
        "n64m64w4s3": _C(64, 64, 4, 3),
        "n64m64w8s3": _C(64, 64, 8, 3),
        "n64m128w8s2": _C(128, 64, 8, 2),
    },
}


def _inputs(heads: int, rows: int, seed: int) -> dict[str, Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    mk = lambda: torch.randn(rows, heads, DH, device=DEVICE, generator=g).to(DTYPE)  # noqa: E731
    return {"q": mk(), "k": mk(), "v": mk(), "do": mk()}


def _calls(kernel: str, cfg: dict[str, Any], x: dict[str, Tensor], scale: float) -> Callable[..., Any]:
    """The launcher of `kernel` under `cfg`, on the named inputs (x must hold lse/delta/o_ref for bwd)."""
    if kernel == "attention_fwd":
        return lambda q=x["q"], k=x["k"], v=x["v"]: att.attention_fwd(q, k, v, scale, DTYPE, config=cfg)
    if kernel == "attention_delta":
        return lambda do=x["do"], o_ref=x["o_ref"]: att.attention_delta(do, o_ref, config=cfg)
    fn = att.attention_bwd_q if kernel == "attention_bwd_q" else att.attention_bwd_kv
    return lambda q=x["q"], k=x["k"], v=x["v"], do=x["do"], lse=x["lse"], delta=x["delta"]: fn(
        q, do, (lse,), delta, k, v, scale, config=cfg
    )


# forward and delta that produce the backward candidates' inputs: the pinned ones, or (if a pinned
# one does not compile here) these small tiles, so the backward candidates are still measured
STATS_CFG: dict[str, dict[str, Any] | None] = {"attention_fwd": None, "attention_delta": None}
SAFE_CFG = {"attention_fwd": _C(64, 64, 4, 2), "attention_delta": {"BLOCK_R": 32, "num_warps": 4}}


def _with_stats(x: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """x plus the forward's o_ref/lse and delta (the inputs every backward candidate shares)."""
    fwd_cfg, delta_cfg = STATS_CFG["attention_fwd"], STATS_CFG["attention_delta"]
    _, o_ref, (lse,) = att.attention_fwd(x["q"], x["k"], x["v"], scale, DTYPE, config=fwd_cfg)
    return {**x, "o_ref": o_ref, "lse": lse, "delta": att.attention_delta(x["do"], o_ref, config=delta_cfg)}


def choose_stats_configs(scale: float) -> dict[str, str]:
    """Pinned forward/delta if they run on this GPU, else SAFE_CFG; returns what was chosen and why."""
    chosen = {}
    x = _inputs(2, 300, seed=0)
    for kernel in STATS_CFG:
        try:
            _with_stats(x, scale)
            chosen[kernel] = "pinned"
        except Exception as e:
            STATS_CFG[kernel] = SAFE_CFG[kernel]
            chosen[kernel] = f"fallback {SAFE_CFG[kernel]} ({type(e).__name__}: {str(e)[:200]})"
    return chosen


def _flat(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bit_pattern(a), bit_pattern(b))


def contract_check(kernel: str, cfg: dict[str, Any], scale: float) -> dict[str, Any]:
    """Bitwise invariance of one candidate on this GPU (H=4, Q=K=1031) and its float64 agreement."""
    rows = CHECK_ROWS
    x = _with_stats(_inputs(CHECK_HEADS, rows, seed=7), scale)
    full = _flat(_calls(kernel, cfg, x, scale)())
    rep = _flat(_calls(kernel, cfg, x, scale)())
    checks: dict[str, bool] = {"repeat": all(_same(a, b) for a, b in zip(full, rep, strict=True))}
    query_side = kernel != "attention_bwd_kv"
    for lo, hi in (
        (1, rows - 1),
        (rows // 8 + 1, rows // 2 + 3),
        (rows // 2, rows // 2 + 1),
    ):  # 1031: 1:1030, 129:518, 515:516
        part = dict(x)
        if query_side:  # these queries only ([Q, H, Dh] on dim 0, [H, Q] statistics on dim 1)
            part.update({a: x[a][lo:hi] for a in ("q", "do", "o_ref")} | {a: x[a][:, lo:hi] for a in ("lse", "delta")})
        else:  # these keys only, against every query
            part.update({a: x[a][lo:hi] for a in ("k", "v")})
        got = _flat(_calls(kernel, cfg, part, scale)())
        want = [t[lo:hi] if t.shape[0] == rows else t[:, lo:hi] for t in full]
        checks[f"rows {lo}:{hi}"] = all(_same(a, b) for a, b in zip(got, want, strict=True))
    for hs in (slice(1, 3), [3, 0]):  # CHECK_HEADS = 4
        part = {a: (t[:, hs] if t.dim() == 3 else t[hs]).contiguous() for a, t in x.items()}
        got = _flat(_calls(kernel, cfg, part, scale)())
        want = [t[:, hs] if t.shape[0] == rows else t[hs] for t in full]
        checks[f"heads {hs}"] = all(_same(a, b) for a, b in zip(got, want, strict=True))
    return {"ok": all(checks.values()), "checks": checks, "rel_l2_vs_float64": _accuracy(kernel, cfg, scale)}


def _accuracy(kernel: str, cfg: dict[str, Any], scale: float) -> dict[str, float]:
    x = _with_stats(_inputs(2, CHECK_ROWS, seed=8), scale)
    q, k, v, do = (x[n].double().requires_grad_(n != "do") for n in ("q", "k", "v", "do"))
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    o.backward(do)
    ref = {
        "attention_fwd": [o, o, torch.logsumexp(s, -1) / math.log(2)],
        "attention_delta": [(do * o).sum(-1).T],
        "attention_bwd_q": [q.grad],
        "attention_bwd_kv": [k.grad, v.grad],
    }[kernel]
    got = _flat(_calls(kernel, cfg, x, scale)())
    err = [float((a.double() - r.detach()).norm() / r.detach().norm()) for a, r in zip(got, ref, strict=True)]
    return dict(zip(OUTPUTS[kernel], err, strict=True))


def _ms(fn: Callable[[], Any], grad_to_none: list[Tensor] | None = None) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, grad_to_none=grad_to_none, return_mode="median"))


def bench_candidates(scale: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = node_of(DEVICE)
    for kernel, cands in CANDIDATES.items():
        pinned = att.config_for(kernel, DH, node)
        named = {"pinned": pinned, **{n: c for n, c in cands.items() if c != pinned}}
        out[kernel] = {}
        for name, cfg in named.items():
            rec: dict[str, Any] = {"config": cfg, "ms": {}, "tflops": {}}
            try:
                rec["contract"] = contract_check(kernel, cfg, scale)
                for heads, rows in SHAPES:
                    x = _with_stats(_inputs(heads, rows, seed=1), scale)
                    ms = _ms(_calls(kernel, cfg, x, scale))
                    key = f"H{heads}_N{rows}"
                    rec["ms"][key] = ms
                    fl = att.flops(rows, rows, heads, DH).get(kernel.removeprefix("attention_"))
                    rec["tflops"][key] = fl / ms * 1e-9 if fl else None
            except Exception as e:  # a candidate that does not compile (shared memory) is a result too
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out[kernel][name] = rec
    return out


def _sdpa_ms(q: Tensor, k: Tensor, v: Tensor, do: Tensor, scale: float) -> dict[str, float]:
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fwd() -> Tensor:
        return sdpa(q, k, v, scale=scale)

    def fwd_bwd() -> None:
        sdpa(q, k, v, scale=scale).backward(do)

    with torch.no_grad():
        fwd_ms = _ms(fwd)
    fb_ms = _ms(fwd_bwd, grad_to_none=[q, k, v])
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms, "bwd_ms": fb_ms - fwd_ms}


def bench_sdpa(scale: float) -> dict[str, Any]:
    """SDPA on the same bf16 data as [1, H, N, Dh] views of our [N, H, Dh] layout, per backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    out: dict[str, Any] = {}
    for name, be in backends.items():
        out[name] = {}
        for heads, rows in SHAPES:
            x = _inputs(heads, rows, seed=1)
            q, k, v = (x[n].transpose(0, 1).unsqueeze(0).detach().requires_grad_() for n in ("q", "k", "v"))
            do = x["do"].transpose(0, 1).unsqueeze(0)
            try:
                with sdpa_kernel([be]) if be is not None else contextlib.nullcontext():
                    out[name][f"H{heads}_N{rows}"] = _sdpa_ms(q, k, v, do, scale)
            except Exception as e:  # a backend this build or GPU lacks
                out[name][f"H{heads}_N{rows}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return out


def summarize(cands: dict[str, Any], sdpa: dict[str, Any]) -> dict[str, Any]:
    """Pinned set and best contract-keeping set: fwd, bwd (delta + dq + dk/dv), fwd+bwd, ratio to SDPA."""
    big = "H{}_N{}".format(*SHAPES[0])
    best = {}
    for kernel, recs in cands.items():
        ok = {n: r for n, r in recs.items() if "error" not in r and r["contract"]["ok"]}
        best[kernel] = min(ok, key=lambda n: ok[n]["ms"][big]) if ok else None
    # what to paste into kernels/<node>.json under kernels.<name>.by_head_dim."128" to pin the best
    pins = {k: cands[k][n]["config"] for k, n in best.items() if n is not None}
    out: dict[str, Any] = {"best_at": big, "best": best, "suggested_pins": pins, "shapes": {}}
    for heads, rows in SHAPES:
        key = f"H{heads}_N{rows}"
        row: dict[str, Any] = {}
        for label, pick in (("pinned", dict.fromkeys(cands, "pinned")), ("best", best)):
            try:
                t = {k: cands[k][pick[k]]["ms"][key] for k in cands}
            except (KeyError, TypeError):
                row[label] = None
                continue
            bwd = t["attention_delta"] + t["attention_bwd_q"] + t["attention_bwd_kv"]
            row[label] = {"fwd_ms": t["attention_fwd"], "bwd_ms": bwd, "fwd_bwd_ms": t["attention_fwd"] + bwd}
            for be in ("flash", "default", "cudnn"):
                ref = sdpa.get(be, {}).get(key, {})
                if "fwd_bwd_ms" in ref:
                    row[label][f"ratio_fwd_bwd_vs_sdpa_{be}"] = row[label]["fwd_bwd_ms"] / ref["fwd_bwd_ms"]
                    row[label][f"ratio_fwd_vs_sdpa_{be}"] = row[label]["fwd_ms"] / ref["fwd_ms"]
        out["shapes"][key] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="JSON record to write")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_bench needs a CUDA device")
    t0 = time.perf_counter()
    scale = DH**-0.5
    env = {
        "gpu": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "triton": triton.__version__,
    }
    stats_from = choose_stats_configs(scale)
    cands = bench_candidates(scale)
    sdpa = bench_sdpa(scale)
    pinned = {k: c for k, c in describe(node_of(DEVICE))["kernels"].items() if k in OUTPUTS}
    record = {
        "format": BENCH_FORMAT,
        "env": env,
        "pinned": pinned,
        "backward_inputs_from": stats_from,
        "head_dim": DH,
        "dtype": "bfloat16",
        "shapes": [{"heads": h, "rows": n} for h, n in SHAPES],
        "summary": summarize(cands, sdpa),
        "candidates": cands,
        "sdpa": sdpa,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, record)
    print(json.dumps({"env": env, "summary": record["summary"], "wall_s": record["wall_s"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
