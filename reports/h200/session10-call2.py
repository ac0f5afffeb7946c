"""nvidia-h200 session 10, call 2 (issue 4): where the unit-tree GEMM loses against cuBLAS.

For to_out (one piece, b = W.T) and ff.net.0.dx (two pieces, b = [K, N]) at M = 4096: the Gluon and
the Triton unit kernels with 8 units (the tree) and with 1 unit (the same K as one chain, no tree),
the plain fixed-order mm with the same 128x128 tile, and cuBLAS. Medians of triton.testing.do_bench.
"""

import json
import os
import sys

import torch
import triton

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
mm128 = gemm.kernel_config("gemm", "sm90", ieee=False, rows=4096) | {"BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 4}
out = {}
M = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
for name, kps, wt in (("to_out", (896,), True), ("ff.net.2", (1792,), True), ("ff.net.0.dx", (1792, 1792), False)):
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
    flop = 2.0 * M * 5376 * a_cat.shape[1]
    r = {"cublas": triton.testing.do_bench(lambda: torch.mm(a_cat, b_cat), rep=200)}
    r["mm128_bf16"] = triton.testing.do_bench(lambda: gemm.mm(a_cat, b_cat, BF16, config=mm128), rep=200)
    r["mm128_f32"] = triton.testing.do_bench(lambda: gemm.mm(a_cat, b_cat, torch.float32, config=mm128), rep=200)
    for cname, cfg in cfgs.items():
        for u in (8, 1):
            p = pieces if u == 8 else [(a_cat, b_cat)]
            r[f"{cname}_U{u}"] = triton.testing.do_bench(lambda p=p, u=u, c=cfg: unit_gemm.unit_mm(p, u, config=c), rep=200)
    out[name] = {k: {"ms": v, "ratio": r["cublas"] / v, "tflops": flop / v * 1e-9} for k, v in r.items()}
    print(name, " ".join(f"{k}={v['ratio']:.2f}" for k, v in out[name].items()), flush=True)
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp/out"), f"unit-split-M{M}.json"), "w"), indent=1)
