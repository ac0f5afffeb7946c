"""nvidia-h200 session 10, call 3 (issue 4): the unit-tree GEMMs' GPU time without the host.

Each variant is captured 10 times into one CUDA graph and replayed: the median over 30 replays of
(graph time / 10) is the kernel's own GPU time (no launch gaps); `host_us` is the Python+launch cost
of one call (a loop of 200 calls, no sync inside). Shapes as call 2, M = 4096 and 264.
"""

import json
import os
import statistics
import sys
import time

import torch

from h3lab.kernels import gemm, unit_gemm

BF16 = torch.bfloat16
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
base = gemm.kernel_config("unit_gemm", "sm90", ieee=False)
cfgs = {
    "gluon_s4": base | {"IMPL": "gluon", "num_stages": 4, "LVL2_SMEM": False},
    "gluon_s3_smem": base | {"IMPL": "gluon", "num_stages": 3, "LVL2_SMEM": True},
    "triton": base | {"IMPL": "triton"},
}
if os.environ.get("NESTED_TOO"):  # call 5: the chunk loop alone in its own loop, the tree between units
    cfgs |= {"gluon_s4_nested": cfgs["gluon_s4"] | {"NESTED": True},
             "gluon_s3_smem_nested": cfgs["gluon_s3_smem"] | {"NESTED": True}}
if os.environ.get("PAIRED_TOO"):  # call 6: nested against paired (units 2p, 2p+1 in two accumulators)
    cfgs = {"triton": cfgs["triton"], "gluon_s4_nested": cfgs["gluon_s4"] | {"NESTED": True},
            "gluon_s4_paired": cfgs["gluon_s4"] | {"PAIRED": True}}


def graph_ms(fn, inner=10, reps=30):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(inner):
                fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / inner)
    return statistics.median(out)


def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


out = {}
for M in [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "4096,264").split(",")]:
    for name, kps, wt in (("to_out", (896,), True), ("ff.net.2", (1792,), True), ("qkv.dx", (896, 896, 896), False),
                          ("ff.net.0.dx", (1792, 1792), False)):
        g = torch.Generator(device="cuda").manual_seed(1)
        pieces = []
        for kp in kps:
            a = torch.randn(M, 8 * kp, device="cuda", dtype=BF16, generator=g)
            w = torch.randn(5376, 8 * kp, device="cuda", dtype=BF16, generator=g)
            pieces.append((a, w.t() if wt else w.t().contiguous()))
        a_cat = torch.cat([p[0] for p in pieces], 1)
        b_cat = torch.cat([p[1] for p in pieces], 0)
        if wt:
            b_cat = b_cat.t().contiguous().t()
        fns = {"cublas": lambda: torch.mm(a_cat, b_cat)}
        for cname, cfg in cfgs.items():
            fns[f"{cname}_U8"] = lambda c=cfg: unit_gemm.unit_mm(pieces, 8, config=c)
            fns[f"{cname}_U1"] = lambda c=cfg: unit_gemm.unit_mm([(a_cat, b_cat)], 1, config=c)
        r = {k: {"gpu_ms": graph_ms(f), "host_us": host_us(f)} for k, f in fns.items()}
        for k in r:
            r[k]["ratio"] = r["cublas"]["gpu_ms"] / r[k]["gpu_ms"]
        out[f"{name}@{M}"] = r
        print(f"{name}@{M}", " ".join(f"{k}={v['ratio']:.2f}/{v['host_us']:.0f}us" for k, v in r.items()), flush=True)
        del pieces, a_cat, b_cat
d = os.environ.get("OUT", "/tmp/out")
os.makedirs(d, exist_ok=True)
json.dump(out, open(os.path.join(d, "unit-graph.json"), "w"), indent=1)
