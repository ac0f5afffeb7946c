"""nvidia-h200 session 10, call 9 (issue 4): GPU-only GEMM times of the final pins (CUDA graphs).

The GEMM bench (h3lab.bench.gemm_bench) times with triton.testing.do_bench, whose per-call events
include the part of the host's launch cost that outlasts the L2 flush before it: ~130-190 us per
h3lab GEMM call against ~14 us for cuBLAS (session10/call8/host-profile.txt), which at M = 264
(kernels of 40-150 us) is a large share. Here each call is captured 10 times into one CUDA graph
and replayed (median of 30 replays / 10): the kernels' own time. Pinned configs, real shapes.
"""

import json
import os
import statistics

import torch

from h3lab.kernels import gemm, unit_gemm

BF16 = torch.bfloat16
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


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


MM = {"q": (5376, 7168), "qkv": (5376, 21504), "to_out": (7168, 5376), "ff.net.0": (5376, 28672), "ff.net.2": (14336, 5376)}
UNIT = {"to_out": ((896,), True), "ff.net.2": ((1792,), True), "qkv.dx": ((896, 896, 896), False),
        "ff.net.0.dx": ((1792, 1792), False)}
out = {"mm": {}, "unit": {}}
g = torch.Generator(device="cuda").manual_seed(3)
for M in (264, 4096, 16384):
    for name, (K, N) in MM.items():
        a = torch.randn(M, K, device="cuda", dtype=BF16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=BF16, generator=g)
        cb = graph_ms(lambda: torch.mm(a, w.t()))
        t = graph_ms(lambda: gemm.mm(a, w.t(), BF16))
        out["mm"][f"{name}@{M}"] = {"cublas_ms": cb, "ms": t, "ratio": cb / t}
    for name, (kps, wt) in UNIT.items():
        pieces = []
        for kp in kps:
            a = torch.randn(M, 8 * kp, device="cuda", dtype=BF16, generator=g)
            w = torch.randn(5376, 8 * kp, device="cuda", dtype=BF16, generator=g)
            pieces.append((a, w.t() if wt else w.t().contiguous()))
        a_cat = torch.cat([p[0] for p in pieces], 1)
        b_cat = torch.cat([p[1] for p in pieces], 0)
        if wt:
            b_cat = b_cat.t().contiguous().t()
        cb = graph_ms(lambda: torch.mm(a_cat, b_cat))
        t = graph_ms(lambda: unit_gemm.unit_mm(pieces, 8))
        out["unit"][f"{name}@{M}"] = {"cublas_ms": cb, "ms": t, "ratio": cb / t}
        del pieces, a_cat, b_cat
    print(M, {k: round(v["ratio"], 2) for kind in out.values() for k, v in kind.items() if k.endswith(f"@{M}")}, flush=True)
d = os.environ.get("OUT", "/tmp/out")
os.makedirs(d, exist_ok=True)
json.dump(out, open(os.path.join(d, "gemm-graph.json"), "w"), indent=1)
