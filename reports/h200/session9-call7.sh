#!/usr/bin/env bash
# nvidia-h200 session 9, call 7: the GEMM GPU tests again after fixing a test whose TMA-store variant
# asked for more shared memory than the H200 has; the block bench once more (50 repeats).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s9; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step gemm-tests
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gemm.py > $W/t3.log 2>&1
tail -1 $W/t3.log; cp $W/t3.log $OUT/
step block-bench
timeout 150 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 50 > $W/block.log 2>&1
tail -2 $W/block.log; cp $W/block.json $OUT/
step done
