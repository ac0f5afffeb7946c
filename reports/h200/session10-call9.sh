#!/usr/bin/env bash
# nvidia-h200 session 10, call 9 (issue 4): the final code's GPU-only GEMM times (CUDA graphs), the
# block bench with 50 runs, and the block's idle-gap profile at 4096 rows.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s10; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step gemm-graph
timeout 120 python3 reports/h200/session10-call9.py > $W/gg.log 2>&1; cat $W/gg.log
step block-bench
timeout 150 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 50 > $W/block.log 2>&1
tail -2 $W/block.log; cp $W/block.json $OUT/
step profile
timeout 100 python3 -m h3lab.bench.block_profile --out $W/profile --rows 4096 > $W/profile.log 2>&1
grep "^rows" $W/profile.log | head -2; cp $W/profile/profile.json $W/profile/gaps-*.json $W/profile.log $OUT/ 2>/dev/null
step done
