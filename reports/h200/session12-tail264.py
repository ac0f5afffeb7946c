"""nvidia-h200 session 12, calls 2-4 (issue 4): the row tail riding on the row tiles (gemm TAIL_M/TAIL_N).

Prediction (session12-probe264.py, call 1): at M = 264 the 64x256 tiles of q were 140 (two rounds,
66 us); the 256 full rows alone are 112 tiles in one round (37.6 us). Carrying the 8 tail rows as
16x64 slices of each full tile adds 1/16 of the products and ~20% of the L2 reads: q ~40-42 us
(0.8 of cuBLAS), ff.net.0 (448 vs 560 tiles) ~150 us; to_out and ff.net.2 (84 + 21 tiles, one
round already) unchanged. Times: GPU-only (10 calls per CUDA graph, median of 30 replays).
"""

import json
import os

import torch

from h3lab.bench.timing import graph_ms
from h3lab.kernels import configs, gemm

BF16 = torch.bfloat16
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
SHAPES = {"q": (5376, 7168), "qkv": (5376, 21504), "to_out": (7168, 5376), "ff.hidden": (5376, 14336),
          "ff.net.0": (5376, 28672), "ff.net.2": (14336, 5376)}  # fmt: skip
pinned = gemm.kernel_config("gemm", configs.node_of("cuda"), ieee=False, rows=264)
plain = {k: v for k, v in pinned.items() if not k.startswith("TAIL")}
CANDIDATES = {"pinned": pinned, "no_tail": plain}
if os.environ.get("CALL") == "2":  # what call 2 ran: the first tail (an unswapped 16-row mma.sync product)
    CANDIDATES |= {"tail_s3": pinned | {"num_stages": 3}, "tail_n32": pinned | {"TAIL_N": 32}}
# call 3 ran, beside it, the swapped tail now pinned (swap_s4; swap_s3 with 3 stages) through a TAIL_SWAP
# switch that the kernel no longer has: the outputs are in session12/call3/tail-swap.log
out = {"pinned": pinned, "ms": {}, "bits": {}}
g = torch.Generator(device="cuda").manual_seed(13)
for M in (264, 520):
    for name, (K, N) in SHAPES.items():
        a = torch.randn(M, K, device="cuda", dtype=BF16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=BF16, generator=g)
        ref = gemm.mm(a, w.t(), BF16, config=plain)
        row = {"cublas": graph_ms(lambda a=a, w=w: torch.mm(a, w.t()))}
        bits = {}
        for cname, c in CANDIDATES.items():
            try:
                bits[cname] = torch.equal(gemm.mm(a, w.t(), BF16, config=c).view(torch.int16), ref.view(torch.int16))
                row[cname] = graph_ms(lambda a=a, w=w, c=c: gemm.mm(a, w.t(), BF16, config=c))
            except Exception as e:  # a candidate that does not compile is a finding
                bits[cname] = f"{type(e).__name__}: {str(e)[:300]}"
        key = f"{name}@{M}"
        out["ms"][key], out["bits"][key] = row, bits
        print(key, {k: f"{v * 1e3:.1f}us/{row['cublas'] / v:.2f}" for k, v in row.items()}, "bits", bits, flush=True)
d = os.environ.get("OUT", "/tmp/out")
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "tail264.json"), "w") as f:
    json.dump(out, f, indent=1)
