"""nvidia-h200 session 11, call 3 (issue 4): why interleaved turns time the canonical block slower.

In call 2 (block.json) the captured canonical block took 26.5 ms per step run back to back but
27.5-28.8 ms when its steps alternated with the eager block's (which got faster: 23.0 -> 21.4-21.9).
Here, at 4096 rows, with every step a graph replay (no host in the way):
- A/A': two captures of the canonical block, back to back each, then alternating: if alternating two
  identical workloads costs too, it is switching memory (TLB, L2), not the eager block;
- eager/canonical back to back and alternating again, with the SM clock and power read after each
  step (NVML through torch.cuda, when it is installed).
"""

import json
import os
import statistics
import time

import torch

from h3lab.batch import packed_batch
from h3lab.bench.eager import eager_block
from h3lab.config import H3Config
from h3lab.graph import GraphedBlock, capture
from h3lab.oracle import rope_cos_sin
from h3lab.weights import synthetic_block

torch.backends.cuda.matmul.allow_tf32 = False
REPS = 40


def nvml():
    try:
        return {"sm_mhz": torch.cuda.clock_rate(), "power_mw": torch.cuda.power_draw()}
    except Exception as e:  # no pynvml on this node: recorded once
        return {"nvml": repr(e)[:120]}


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, nvml()


def run(pattern, fns):
    for f in fns.values():
        f()
    log = {k: [] for k in fns}
    for i in range(REPS):
        for name in pattern(i):
            log[name].append(timed(fns[name]))
    return {k: {"median_ms": 1e3 * statistics.median(t for t, _ in v), "samples": v} for k, v in log.items()}


c = H3Config.real()
w = synthetic_block(c, 0, seed=0).to("cuda")
b = packed_batch(c, 4096, seed=1).to("cuda")
cos, sin = (t.to("cuda").to(torch.bfloat16) for t in rope_cos_sin(b.position_ids.cpu(), c))
A, A2 = GraphedBlock(w, b), GraphedBlock(w, b)
rows = A.decide(b)
eager_graph, _ = capture(lambda: eager_block(w, b, cos, sin, True))
fns = {"A": lambda: A(b, decided_rows=rows), "A2": lambda: A2(b, decided_rows=rows), "eager": eager_graph.replay}
out = {
    "A_then_A2": run(lambda i: ["A"] * 1, {"A": fns["A"]}) | run(lambda i: ["A2"], {"A2": fns["A2"]}),
    "A_A2_alternating": run(lambda i: ["A", "A2"], {"A": fns["A"], "A2": fns["A2"]}),
    "eager_then_canonical": run(lambda i: ["eager"], {"eager": fns["eager"]}) | run(lambda i: ["A"], {"A": fns["A"]}),
    "eager_canonical_alternating": run(lambda i: ["eager", "A"], {"eager": fns["eager"], "A": fns["A"]}),
    "canonical_twice_eager_twice": run(lambda i: ["A", "A", "eager", "eager"], {"eager": fns["eager"], "A": fns["A"]}),
}
for k, v in out.items():
    print(k, {n: round(x["median_ms"], 2) for n, x in v.items()},
          {n: x["samples"][-1][1] for n, x in v.items()}, flush=True)
d = os.environ.get("OUT", "/tmp/out")
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "interleave.json"), "w") as f:
    json.dump(out, f, indent=1)
