#!/usr/bin/env bash
# nvidia-h200 session 10, call 4 (issue 4): the Gluon unit-tree GEMM with paired accumulators (an even
# and an odd unit in their own registers, the pair's node climbing the tree while the next chunk's
# wgmma runs). Bitwise against the Triton kernel, GPU-only times from CUDA graphs (session10-call3.py),
# then the faster Gluon variant pinned in a copy of kernels/: golden digests and the block bench.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s10; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step gluon-test
timeout 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_kernels_gemm.py -k gluon > $W/t-gluon.log 2>&1
tail -3 $W/t-gluon.log; cp $W/t-gluon.log $OUT/
step graph-bench
timeout 150 python3 reports/h200/session10-call3.py 4096,264 > $W/graph.log 2>&1; cat $W/graph.log | cut -c1-400
step pin
rm -rf $W/kernels; cp -r kernels $W/kernels
python3 - "$W" "$OUT" <<'PY'
import json, math, sys
w, out = sys.argv[1], sys.argv[2]
rec = json.load(open(f"{out}/unit-graph.json"))
score = {}
for v in ("gluon_s4", "gluon_s3_smem", "triton"):
    rs = [r[f"{v}_U8"]["ratio"] for k, r in rec.items() if k.endswith("@4096")]
    score[v] = math.exp(sum(map(math.log, rs)) / len(rs))
print("geomean U8 ratio @4096:", score)
best = max(("gluon_s4", "gluon_s3_smem"), key=score.get)
pin = json.load(open(f"{w}/kernels/sm90.json"))
pin["kernels"]["unit_gemm"].update({"IMPL": "gluon", "num_stages": 4 if best == "gluon_s4" else 3,
                                    "LVL2_SMEM": best != "gluon_s4"})
json.dump(pin, open(f"{w}/kernels/sm90.json", "w"), indent=2)
print("pinned for the block:", best)
PY
step golden
H3LAB_KERNELS_DIR=$W/kernels timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1
tail -1 $W/golden.log; cp $W/golden.log $OUT/
step block-bench
H3LAB_KERNELS_DIR=$W/kernels timeout 150 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 \
  --reps 30 > $W/block.log 2>&1
tail -2 $W/block.log; cp $W/block.json $OUT/
step done
