#!/usr/bin/env bash
# nvidia-h200 session 10, call 7 (issue 4): the final code, the Gluon unit-tree GEMM pinned in
# kernels/sm90.json. Golden digests (torch and triton), the GEMM GPU tests, the GEMM bench (pinned
# and the Triton unit kernel), GPU-only unit times, the block bench, four layouts at the real shapes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=2
OUT=${OUT:-/tmp/out}; W=/tmp/s10; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step golden
for be in triton torch; do
  timeout 60 python3 -m h3lab verify --device cuda --backend $be > $W/golden-$be.log 2>&1; tail -1 $W/golden-$be.log
done
step gemm-tests
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gemm.py > $W/t-gemm.log 2>&1
tail -2 $W/t-gemm.log; cp $W/t-gemm.log $OUT/
step gemm-bench
OMP_NUM_THREADS=4 timeout 150 python3 -m h3lab.bench.gemm_bench --out $W/gemm.json --candidates m128n128w8s4p \
  --ms 264,4096,16384 > $W/gemm.log 2>&1
tail -6 $W/gemm.log; cp $W/gemm.json $W/gemm.log $OUT/
step block-bench
OMP_NUM_THREADS=4 timeout 120 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 30 > $W/block.log 2>&1
tail -2 $W/block.log; cp $W/block.json $OUT/
step layouts
timeout 150 python3 -m h3lab run --layout tp1 tp2 tp8 tp4xcp2+sp --synthetic real --rows 264 --device cuda \
  --backend triton --digests --timeout 140 --out $W/run > $W/run.log 2>&1
tail -6 $W/run.log; cp $W/run/summary.json $OUT/real-layouts-summary.json
step done
