"""nvidia-h200 session 10, call 8 (issue 4): where the host time of one GEMM launch goes.

200 calls of gemm.mm and unit_gemm.unit_mm (pinned Gluon, and the Triton kernel) at the real shapes,
264 rows, under cProfile (no sync inside the loop); the top functions by own time, per call.
"""

import cProfile
import io
import os
import pstats
import time

import torch

from h3lab.kernels import gemm, unit_gemm

BF16 = torch.bfloat16
g = torch.Generator(device="cuda").manual_seed(1)
a = torch.randn(264, 7168, device="cuda", dtype=BF16, generator=g)
w = torch.randn(5376, 7168, device="cuda", dtype=BF16, generator=g)
dq = [torch.randn(264, 5376, device="cuda", dtype=BF16, generator=g) for _ in range(3)]
wq = [torch.randn(5376, 5376, device="cuda", dtype=BF16, generator=g) for _ in range(3)]
base = gemm.kernel_config("unit_gemm", "sm90", ieee=False)
calls = {
    "mm": lambda: gemm.mm(a, w.t(), BF16),
    "unit_gluon_to_out": lambda: unit_gemm.unit_mm([(a, w.t())], 8),
    "unit_triton_to_out": lambda: unit_gemm.unit_mm([(a, w.t())], 8, config=base | {"IMPL": "triton"}),
    "unit_gluon_qkv_dx": lambda: unit_gemm.unit_mm(list(zip(dq, wq)), 8),
}
out = []
for name, fn in calls.items():
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        fn()
    dt = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    out.append(f"===== {name}: {dt:.1f} us per call (no profiler)\n" + s.getvalue())
    print(out[-1][:3500], flush=True)
d = os.environ.get("OUT", "/tmp/out")
os.makedirs(d, exist_ok=True)
open(os.path.join(d, "host-profile.txt"), "w").write("\n".join(out))
