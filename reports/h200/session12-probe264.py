"""nvidia-h200 session 12, call 1 (issue 4): why the GEMM at 264 rows is slow, and what a row tail costs.

264 = 4 x 64 + 8. With the pinned 64x256 tiles, q (5376 -> 7168) has 5 x 28 = 140 tiles on 132 SMs:
two rounds of a 64-row tile (~33 us each), the second for 8 tiles, and 28 of the 140 tiles hold 8
real rows in 64. Prediction: if the 8 tail rows ran as their own small tiles on the 20 SMs the 112
full tiles leave free, q would take about one round (~35 us, 0.9 of cuBLAS's 32.8 us).

Two questions, answered here before any kernel is written:
1. Bits: does a tail tile give the pinned tile's bits? Candidates: BLOCK_M 16/32 (mma.sync, not
   wgmma) and the swapped product c^T = W a^T (wgmma with the 8 rows as the N side). Compared byte
   for byte with the pinned 64x256 result.
2. Time: the 256-row part alone (112 tiles), each tail candidate alone, and both at once on two
   streams in one graph (an upper bound for one kernel that gives the tail to the spare SMs).
"""

import json
import os

import torch

from h3lab.bench.timing import graph_ms
from h3lab.kernels import gemm

BF16 = torch.bfloat16
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
SHAPES = {"q": (5376, 7168), "to_out": (7168, 5376), "ff.net.0": (5376, 28672), "ff.net.2": (14336, 5376)}


def cfg(bm, bn, w, s, tma=True, store=False):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": w, "num_stages": s,
            "TMA": tma, "TMA_STORE": store}  # fmt: skip


TAIL_DIRECT = {"m16n256w4s4": cfg(16, 256, 4, 4), "m16n128w4s4": cfg(16, 128, 4, 4), "m16n64w4s6": cfg(16, 64, 4, 6),
               "m32n128w4s4": cfg(32, 128, 4, 4), "m16n128w2s4": cfg(16, 128, 2, 4)}  # fmt: skip
TAIL_SWAP = {"s64n16w4s6": cfg(64, 16, 4, 6), "s128n16w4s6": cfg(128, 16, 4, 6), "s128n16w8s6": cfg(128, 16, 8, 6),
             "s256n16w8s4": cfg(256, 16, 8, 4), "s64n16w4s8": cfg(64, 16, 4, 8)}  # fmt: skip

out = {"bits": {}, "ms": {}}
g = torch.Generator(device="cuda").manual_seed(12)
for name, (K, N) in SHAPES.items():
    a = torch.randn(264, K, device="cuda", dtype=BF16, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=BF16, generator=g)
    ref = gemm.mm(a, w.t(), BF16)
    full, tail = a[:256], a[256:]
    bits, ms = {}, {}
    for cname, c in TAIL_DIRECT.items():
        try:
            got = gemm.mm(tail, w.t(), BF16, config=c)
            whole = gemm.mm(a, w.t(), BF16, config=c)
            bits[cname] = {"tail": torch.equal(got.view(torch.int16), ref[256:].view(torch.int16)),
                           "all_rows": torch.equal(whole.view(torch.int16), ref.view(torch.int16))}  # fmt: skip
            ms[f"tail:{cname}"] = graph_ms(lambda c=c: gemm.mm(tail, w.t(), BF16, config=c))
        except Exception as e:  # a candidate that does not compile is a finding, not a crash
            bits[cname] = f"{type(e).__name__}: {str(e)[:200]}"
    for cname, c in TAIL_SWAP.items():
        try:
            got = gemm.mm(w, tail.t(), BF16, config=c).t()
            whole = gemm.mm(w, a.t(), BF16, config=c).t()
            bits[cname] = {"tail": torch.equal(got.contiguous().view(torch.int16), ref[256:].view(torch.int16)),
                           "all_rows": torch.equal(whole.contiguous().view(torch.int16), ref.view(torch.int16))}  # fmt: skip
            ms[f"tail:{cname}"] = graph_ms(lambda c=c: gemm.mm(w, tail.t(), BF16, config=c))
        except Exception as e:
            bits[cname] = f"{type(e).__name__}: {str(e)[:200]}"
    ms["cublas"] = graph_ms(lambda: torch.mm(a, w.t()))
    ms["pinned"] = graph_ms(lambda: gemm.mm(a, w.t(), BF16))
    ms["full256"] = graph_ms(lambda: gemm.mm(full, w.t(), BF16))
    side = torch.cuda.Stream()
    for cname, c in list(TAIL_DIRECT.items()) + list(TAIL_SWAP.items()):
        if not isinstance(bits.get(cname), dict):
            continue
        swap = cname in TAIL_SWAP

        def both(c=c, swap=swap):
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            gemm.mm(full, w.t(), BF16)
            with torch.cuda.stream(side):
                gemm.mm(w, tail.t(), BF16, config=c) if swap else gemm.mm(tail, w.t(), BF16, config=c)
            main.wait_stream(side)

        ms[f"both:{cname}"] = graph_ms(both)
    out["bits"][name], out["ms"][name] = bits, ms
    best = min((v, k) for k, v in ms.items() if k.startswith("both:")) if any(k.startswith("both:") for k in ms) else None
    print(name, "cublas", round(ms["cublas"] * 1e3, 1), "pinned", round(ms["pinned"] * 1e3, 1), "full256",
          round(ms["full256"] * 1e3, 1), "best-both", best and (round(best[0] * 1e3, 1), best[1]), flush=True)  # fmt: skip
    print("  bits", {k: v if isinstance(v, str) else f"{int(v['tail'])}{int(v['all_rows'])}" for k, v in bits.items()})
    print("  tails", {k[5:]: round(v * 1e3, 1) for k, v in ms.items() if k.startswith("tail:")}, flush=True)
d = os.environ.get("OUT", "/tmp/out")
os.makedirs(d, exist_ok=True)
json.dump(out, open(os.path.join(d, "probe264.json"), "w"), indent=1)
