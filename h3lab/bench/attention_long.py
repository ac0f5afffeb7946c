"""Attention at the sequence lengths H3 trains on: pinned and candidate kernels against SDPA, one JSON.

    python -m h3lab.bench.attention_long --out FILE.json [--rows 4096,16384,32768,65536] [--heads 56]

One packed request per row count: `rows` query rows (padding among them, as the block passes its
local rows) and `rows - rows // 64` active keys in canonical order (the block drops padding keys),
56 heads x 128 channels, bf16, fresh N(0, 1) inputs. Per row count and variant: forward and
backward milliseconds (median of CUDA-event timed calls after one warm-up, which compiles), the
peak memory the call adds over its inputs (GiB), whether its bytes equal the pinned kernels' (o,
lse, dq, dk, dv), and the relative L2 error against float64 on 256 query rows and 256 key rows
(every key or query behind them, in FP64 chunks). SDPA runs on the same data, each backend alone
(cuDNN, flash; memory-efficient up to 16384 rows), forward and forward+backward; `sdpa_best` names
the fastest and `ratio_*` divide our times by its. Variants: `VARIANTS`, forward configurations
(the pinned set first); every variant's backward is what the block runs without CP
(h3lab.triton.attention.attention_bwd: fused on sm90, the two kernels elsewhere) on its own
forward's statistics.

Where the time goes: `kernels` times each pinned launcher alone (forward, delta, dq, dk/dv, and the
whole backward `bwd` as the block calls it) with its tensor-core TFLOP/s (h3lab.triton.attention.flops:
the split backward does 7 GEMM-sized products, a fused one 5), `sdpa.cudnn.kernels_ms` lists
cuDNN's own kernels under torch.profiler, and
`gemm_ceiling_tflops` is a cuBLAS bf16 8192^3 GEMM in the same run: the tensor-core rate a kernel
with no softmax work can reach. `summary.bound` gives the rate the backward (`bwd`: fused or split)
would need for 0.9 of SDPA's forward+backward speed.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from h3lab.io.jsonfile import write_json
from h3lab.metrics import bit_pattern
from h3lab.triton import attention as att
from h3lab.triton.configs import describe, node_of

BENCH_FORMAT = "h3lab-bench-attention-long-v2"  # v2: a variant is a forward config
DH, DTYPE = 128, torch.bfloat16
CHECK_ROWS = 256  # query rows and key rows whose results are checked against float64
NODE: str | None = None  # the launchers' node type: None = the device's (CPU tests name "sm90")
# forward configs (None: the pinned one): the pointer kernel with the pinned tile (pinned before the
# TMA forward, the same bytes; its addresses cost registers the descriptors do not), and a TMA
# forward with 64-key tiles (another bit class: it rescales its running sums at other keys)
_FWD = lambda bn, s, tma: {"BLOCK_M": 128, "BLOCK_N": bn, "num_warps": 8, "num_stages": s, "TMA": tma}  # noqa: E731
# the warp-specialised Gluon forwards (h3lab.triton.attention_fwd_sm90): the pinned forward's bytes
_GLUON = _FWD(128, 3, True) | {"IMPL": "gluon"}
VARIANTS: dict[str, dict[str, Any] | None] = {
    "pinned": None,
    "fwd_pointer_n128s3": _FWD(128, 3, False),
    "fwd_tma_n64s3": _FWD(64, 3, True),
    "fwd_gluon_ws": _GLUON,
    "fwd_gluon_pingpong": _GLUON | {"PINGPONG": True},
    "fwd_gluon_ws_s3": _GLUON | {"GLUON_STAGES": 3},
    "fwd_gluon_pingpong_s3": _GLUON | {"PINGPONG": True, "GLUON_STAGES": 3},
}


def timed(fn: Callable[[], Any], budget_s: float = 0.4, min_reps: int = 2, max_reps: int = 20) -> dict[str, Any]:
    """Median milliseconds of CUDA-event timed calls of `fn` after one warm-up call (which compiles):
    as many calls as fit in `budget_s` (at least min_reps, at most max_reps)."""
    fn()
    torch.cuda.synchronize()
    times: list[float] = []
    t0 = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - t0 < budget_s):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": statistics.median(times), "reps": len(times), "spread_ms": [min(times), max(times)]}


def peak_gib(fn: Callable[[], Any]) -> float:
    """GiB the call allocates at its peak over what was allocated before (its outputs included)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def gemm_ceiling_tflops() -> float:
    """TFLOP/s of a cuBLAS bf16 8192 x 8192 x 8192 GEMM (median of CUDA-event timed calls)."""
    a = torch.randn(8192, 8192, device="cuda").to(DTYPE)
    ms = timed(lambda: a @ a, budget_s=0.2, min_reps=5)["ms"]
    return 2 * 8192**3 / ms / 1e9


def fused_backward() -> bool:
    """Whether attention_bwd is one fused launch on this node (its pinned dq is the Gluon kernel's)."""
    return att.config_for("attention_bwd_q", DH, NODE or node_of(torch.device("cuda"))).get("IMPL") == "gluon"


def kernel_times(x: dict[str, Tensor], scale: float) -> dict[str, Any]:
    """Each pinned kernel alone: milliseconds (median) and tensor-core TFLOP/s."""
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    _, o_ref, stats = att.attention_fwd(q, k, v, scale, DTYPE, node=NODE)
    delta = att.attention_delta(do, o_ref, node=NODE)
    calls = {
        "fwd": lambda: att.attention_fwd(q, k, v, scale, DTYPE, node=NODE),
        "delta": lambda: att.attention_delta(do, o_ref, node=NODE),
        "bwd_q": lambda: att.attention_bwd_q(q, do, stats, delta, k, v, scale, node=NODE),
        "bwd_kv": lambda: att.attention_bwd_kv(q, do, stats, delta, k, v, scale, node=NODE),
        "bwd": lambda: att.attention_bwd(q, do, stats, delta, k, v, scale, node=NODE),
    }
    fl = att.flops(q.shape[0], k.shape[0], q.shape[1], DH)
    fl["bwd"] = fl["bwd_fused"] if fused_backward() else fl["bwd"]
    out: dict[str, Any] = {}
    for name, fn in calls.items():
        t = timed(fn)
        out[name] = {"ms": t["ms"], "spread_ms": t["spread_ms"]}
        if name in fl:
            out[name]["tflops"] = fl[name] / t["ms"] / 1e9
    return out


def cudnn_kernels(f: Callable[[], Any]) -> list[tuple[str, float]]:
    """cuDNN's kernels in one forward+backward under torch.profiler: (name, ms), longest first."""
    from torch.profiler import ProfilerActivity, profile

    f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    ev = [(e.key[:100], e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(ev, key=lambda t: -t[1])[:6]


def make_inputs(rows: int, heads: int, seed: int) -> dict[str, Tensor]:
    """q, dO [rows, H, Dh]; k, v [keys, H, Dh], keys = rows - rows // 64 (the padding rows drop out)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    keys = rows - rows // 64
    mk = lambda n: torch.randn(n, heads, DH, device="cuda", generator=g).to(DTYPE)  # noqa: E731
    return {"q": mk(rows), "k": mk(keys), "v": mk(keys), "do": mk(rows)}


def run_variant(x: dict[str, Tensor], fwd_cfg: dict | None, scale: float) -> dict[str, Callable]:
    """The variant's forward and the pinned backward as calls; backward inputs from this variant's forward."""
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]

    def fwd() -> tuple:
        return att.attention_fwd(q, k, v, scale, DTYPE, node=NODE, config=fwd_cfg)

    _, o_ref, (lse,) = fwd()

    def backward() -> tuple:
        d = att.attention_delta(do, o_ref, node=NODE)
        return att.attention_bwd(q, do, (lse,), d, k, v, scale, node=NODE)

    return {"fwd": fwd, "bwd": backward}


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bit_pattern(a), bit_pattern(b))


def reference64(x: dict[str, Tensor], scale: float, rows: Tensor, keys: Tensor) -> dict[str, Tensor]:
    """float64 o, lse2, dq of the query rows `rows` and dk, dv of the key rows `keys`, against every
    key / query, in chunks of 64 query rows (the [H, chunk, N] scores, never [H, N, N])."""
    q, k, v, do = (x[n].double().transpose(0, 1).contiguous() for n in ("q", "k", "v", "do"))  # [H, N, Dh]

    def chunk(part: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        s = q[:, part] @ k.transpose(1, 2) * scale  # [H, c, K]
        lse = torch.logsumexp(s, -1)
        p = (s - lse[..., None]).exp()
        o = p @ v
        delta = (do[:, part] * o).sum(-1)
        return p, o, lse, delta

    out: dict[str, list[Tensor]] = {n: [] for n in ("o", "lse", "dq")}
    for part in rows.split(64):
        p, o, lse, delta = chunk(part)
        ds = p * (do[:, part] @ v.transpose(1, 2) - delta[..., None])
        out["o"].append(o.transpose(0, 1))
        out["lse"].append(lse / math.log(2))
        out["dq"].append((ds @ k * scale).transpose(0, 1))
    dk = torch.zeros(q.shape[0], len(keys), DH, dtype=torch.float64, device=q.device)
    dv = torch.zeros_like(dk)
    for part in torch.arange(q.shape[1], device=q.device).split(64):  # every query, the checked keys
        p, _, _, delta = chunk(part)
        p = p[..., keys]
        ds = p * (do[:, part] @ v[:, keys].transpose(1, 2) - delta[..., None])
        dv += p.transpose(1, 2) @ do[:, part]
        dk += ds.transpose(1, 2) @ q[:, part] * scale
    cat = {n: torch.cat(t, 1 if n == "lse" else 0) for n, t in out.items()}
    return cat | {"dk": dk.transpose(0, 1), "dv": dv.transpose(0, 1)}


def errors(got: dict[str, Tensor], ref: dict[str, Tensor], rows: Tensor, keys: Tensor) -> dict[str, float]:
    pick = {"o": got["o"][rows], "lse": got["lse"][:, rows], "dq": got["dq"][rows]}
    pick |= {"dk": got["dk"][keys], "dv": got["dv"][keys]}
    return {n: float((pick[n].double() - ref[n]).norm() / ref[n].norm()) for n in ref}


def sdpa(x: dict[str, Tensor], scale: float, rows: int) -> dict[str, Any]:
    """SDPA per backend on [1, H, N, Dh] views of the same data: forward, forward+backward, peak."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    if rows <= 16384:  # the memory-efficient kernel is far slower than these two at long rows
        backends["efficient"] = SDPBackend.EFFICIENT_ATTENTION
    q, k, v = (x[n].transpose(0, 1).unsqueeze(0).detach().requires_grad_() for n in ("q", "k", "v"))
    do = x["do"].transpose(0, 1).unsqueeze(0)
    f = torch.nn.functional.scaled_dot_product_attention
    out: dict[str, Any] = {}
    for name, be in backends.items():
        try:
            with sdpa_kernel([be]):
                with torch.no_grad():
                    fwd = timed(lambda: f(q, k, v, scale=scale))
                fb = timed(lambda: torch.autograd.grad(f(q, k, v, scale=scale), (q, k, v), do))
                peak = peak_gib(lambda: torch.autograd.grad(f(q, k, v, scale=scale), (q, k, v), do))
            out[name] = {"fwd_ms": fwd["ms"], "fwd_bwd_ms": fb["ms"], "bwd_ms": fb["ms"] - fwd["ms"], "peak_gib": peak}
        except Exception as e:  # a backend this build or GPU lacks is a result too
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        if name == "cudnn":  # apart: a profiler that fails costs the list, not cuDNN's timings
            try:
                with sdpa_kernel([be]):
                    grads = lambda: torch.autograd.grad(f(q, k, v, scale=scale), (q, k, v), do)  # noqa: E731
                    out[name]["kernels_ms"] = cudnn_kernels(grads)
            except Exception as e:
                out[name]["kernels_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    ok = {n: r for n, r in out.items() if "fwd_bwd_ms" in r}
    if ok:
        out["best"] = min(ok, key=lambda n: ok[n]["fwd_bwd_ms"])
        out["best_fwd"] = min(ok, key=lambda n: ok[n]["fwd_ms"])
    return out


def bench_rows(
    rows: int, heads: int, scale: float, variants: dict, save: Callable[[dict], None], with_sdpa: bool = True
) -> dict[str, Any]:
    """The record of one row count; `save` gets it after each variant (a hung or failed candidate
    leaves the ones before it on disk)."""
    x = make_inputs(rows, heads, seed=rows)
    gen = torch.Generator().manual_seed(1)
    dev = x["q"].device
    check_rows = torch.randperm(rows, generator=gen)[:CHECK_ROWS].sort().values.to(dev)
    check_keys = torch.randperm(x["k"].shape[0], generator=gen)[:CHECK_ROWS].sort().values.to(dev)
    ref = reference64(x, scale, check_rows, check_keys)
    rec: dict[str, Any] = {"rows": rows, "keys": x["k"].shape[0], "heads": heads, "variants": {}}
    rec["fused_backward"] = fused_backward()
    pinned_bytes: dict[str, Tensor] | None = None
    for name, fwd_cfg in variants.items():
        r: dict[str, Any] = {"fwd_config": fwd_cfg or "pinned"}
        try:
            calls = run_variant(x, fwd_cfg, scale)
            (o, _, (lse,)), (dq, dk, dv) = calls["fwd"](), calls["bwd"]()
            got = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
            r["rel_l2_vs_float64"] = errors(got, ref, check_rows, check_keys)
            if pinned_bytes is None:
                pinned_bytes = got
            r["bitwise_vs_pinned"] = {n: _same(got[n], pinned_bytes[n]) for n in got}
            r["repeat_bitwise"] = all(_same(a, b) for a, b in zip(calls["bwd"](), (dq, dk, dv), strict=True))
            del got, o, lse, dq, dk, dv
            fwd, bwd_t = timed(calls["fwd"]), timed(calls["bwd"])
            r |= {"fwd_ms": fwd["ms"], "bwd_ms": bwd_t["ms"], "fwd_bwd_ms": fwd["ms"] + bwd_t["ms"]}
            r |= {"reps": [fwd["reps"], bwd_t["reps"]], "spread_ms": [fwd["spread_ms"], bwd_t["spread_ms"]]}
            r["peak_gib"] = {"fwd": peak_gib(calls["fwd"]), "bwd": peak_gib(calls["bwd"])}
            del calls
        except Exception as e:  # a candidate that does not compile or run is a result too
            r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rec["variants"][name] = r
        save(rec)
        torch.cuda.empty_cache()
        print(rows, name, {k: v for k, v in r.items() if k in ("fwd_ms", "bwd_ms", "bitwise_vs_pinned", "error")})
    rec["kernels"] = kernel_times(x, scale)
    save(rec)
    rec["sdpa"] = sdpa(x, scale, rows) if with_sdpa else {}
    return rec | {"summary": summarize(rec)}


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    """Each variant's speed as a fraction of the fastest SDPA backend's (>= 1 is faster): forward
    against the fastest forward, forward+backward against the fastest forward+backward."""
    s = rec["sdpa"]
    if "best" not in s:
        return {"error": "no SDPA backend ran"}
    fb, f = s[s["best"]]["fwd_bwd_ms"], s[s["best_fwd"]]["fwd_ms"]
    out: dict[str, Any] = {"sdpa_best": s["best"], "sdpa_best_fwd": s["best_fwd"], "sdpa_fwd_bwd_ms": fb}
    for name, r in rec["variants"].items():
        if "fwd_ms" in r:
            out[name] = {"speed_fwd_vs_sdpa": f / r["fwd_ms"], "speed_fwd_bwd_vs_sdpa": fb / r["fwd_bwd_ms"]}
    same = {n: r for n, r in rec["variants"].items() if "fwd_ms" in r and all(r["bitwise_vs_pinned"].values())}
    if same:  # the variant with the fastest forward among those that keep the pinned bytes
        best = min(same, key=lambda n: same[n]["fwd_ms"])
        ms = same[best]["fwd_bwd_ms"]
        out["best_same_bits"] = {"variant": best, "fwd_bwd_ms": ms, "speed_fwd_bwd_vs_sdpa": fb / ms}
    if "kernels" in rec:  # the backward rate 0.9 of SDPA's speed needs, with the pinned forward and delta
        kt = rec["kernels"]
        left_ms = fb / 0.9 - kt["fwd"]["ms"] - kt["delta"]["ms"]
        fl = att.flops(rec["rows"], rec["keys"], rec["heads"], DH)
        fused = rec.get("fused_backward", False)
        bwd_flops = fl["bwd_fused" if fused else "bwd"]
        bwd_ms = kt["bwd"]["ms"] if "bwd" in kt else kt["bwd_q"]["ms"] + kt["bwd_kv"]["ms"]
        need = bwd_flops / left_ms / 1e9 if left_ms > 0 else None
        out["bound"] = {"backward": "fused" if fused else "split", "bwd_tflops": bwd_flops / bwd_ms / 1e9}
        out["bound"]["bwd_tflops_for_0.9"] = need
    return out


def parse_rows(text: str) -> list[int]:
    """`--rows` as positive ints, e.g. "4096,16384"; raises ValueError naming the bad entry."""
    rows = []
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < 128:
            raise ValueError(f"--rows entry {part!r}; allowed: integers >= 128, comma-separated")
        rows.append(int(part))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rows", default="4096,16384,32768,65536")
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {list(VARIANTS)} (pinned always runs)")
    ap.add_argument("--no-sdpa", dest="sdpa", action="store_false", help="leave SDPA out (timed by another run)")
    a = ap.parse_args(argv)
    try:
        rows = parse_rows(a.rows)
    except ValueError as e:
        ap.error(str(e))
    unknown = set(a.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"--variants {sorted(unknown)} unknown; allowed: {list(VARIANTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("attention_long needs a CUDA device")
    chosen = {n: v for n, v in VARIANTS.items() if n == "pinned" or n in a.variants.split(",")}
    t0, scale = time.perf_counter(), DH**-0.5
    node = node_of("cuda")
    record: dict[str, Any] = {
        "format": BENCH_FORMAT,
        "env": {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(),
        },
        "pinned": {k: c for k, c in describe(node)["kernels"].items() if k.startswith("attention")},
        "variants": {n: f or "pinned" for n, f in chosen.items()},
        "gemm_ceiling_tflops": gemm_ceiling_tflops(),
        "rows": {},
    }
    for n in rows:

        def save(rec: dict, n: int = n) -> None:
            record["rows"][n] = rec
            record["wall_s"] = round(time.perf_counter() - t0, 1)
            write_json(a.out, record)

        with contextlib.suppress(torch.OutOfMemoryError):
            save(bench_rows(n, a.heads, scale, chosen, save, with_sdpa=a.sdpa))
        print(n, record["rows"].get(n, {}).get("summary", "out of memory"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
