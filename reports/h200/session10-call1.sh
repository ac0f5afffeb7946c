#!/usr/bin/env bash
# nvidia-h200 session 10, call 1 (issue 4): the Gluon unit-tree GEMM (h3lab.kernels.unit_gemm_sm90).
# Bitwise against the Triton kernel (GPU test), the GEMM bench with both Gluon variants, then with
# the fastest unit candidate pinned in a copy of kernels/: golden digests and the block bench.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s10; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step env
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)"
step gluon-test
timeout 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_kernels_gemm.py -k gluon > $W/t-gluon.log 2>&1
tail -3 $W/t-gluon.log; cp $W/t-gluon.log $OUT/
step gemm-bench
timeout 260 python3 -m h3lab.bench.gemm_bench --out $W/gemm.json --candidates gluon_s4,gluon_s3_smem \
  --ms 264,4096,16384 > $W/gemm.log 2>&1
tail -12 $W/gemm.log; cp $W/gemm.json $W/gemm.log $OUT/
step pin
rm -rf $W/kernels; cp -r kernels $W/kernels
python3 - "$W" <<'PY'
import json, sys
w = sys.argv[1]
rec = json.load(open(f"{w}/gemm.json"))
best = rec["summary"]["best"]["unit"]
print("best unit:", best["name"], best["geomean_ratio"])
pin = json.load(open(f"{w}/kernels/sm90.json"))
cfg = rec["unit"]["gluon_s4"]["config"] if best["name"] not in ("gluon_s4", "gluon_s3_smem") else best["config"]
pin["kernels"]["unit_gemm"].update({k: v for k, v in cfg.items()})
json.dump(pin, open(f"{w}/kernels/sm90.json", "w"), indent=2)
print("pinned for the block:", pin["kernels"]["unit_gemm"])
PY
step golden
H3LAB_KERNELS_DIR=$W/kernels timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1
tail -1 $W/golden.log; cp $W/golden.log $OUT/
step block-bench
H3LAB_KERNELS_DIR=$W/kernels timeout 150 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 \
  --reps 30 > $W/block.log 2>&1
tail -2 $W/block.log; cp $W/block.json $OUT/
step done
