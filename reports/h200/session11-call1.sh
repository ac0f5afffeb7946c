#!/usr/bin/env bash
# nvidia-h200 session 11, call 1 (issue 4): the block captured in a CUDA graph (h3lab.graph) against
# the eager step, byte for byte; the session-10 changes not yet run on a GPU (GEMM, few-row and
# row-local GPU tests, golden digests); the block bench with graph timings; GEMM tiles at 264 rows.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s11; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step graph-tests
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graph.py > $W/t-graph.log 2>&1
tail -15 $W/t-graph.log; cp $W/t-graph.log $OUT/
step golden
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1; tail -1 $W/golden.log
step block-bench
timeout 170 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 30 > $W/block.log 2>&1
tail -4 $W/block.log; cp $W/block.json $W/block.log $OUT/
step gemm264
timeout 80 python3 reports/h200/session11-gemm264.py > $W/g264.log 2>&1; tail -14 $W/g264.log; cp $W/g264.log $OUT/
step kernel-tests
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gemm.py tests/test_kernels_few_rows.py \
  tests/test_kernels_rowlocal.py > $W/t-kern.log 2>&1
tail -4 $W/t-kern.log; cp $W/t-kern.log $OUT/
step done
