#!/usr/bin/env bash
# nvidia-h200 session 12, call 2 (issue 4): the row tail on the GPU: GEMM times (session12-tail264.py),
# every GPU test, golden digests, the real-shape layouts, the block at 264 rows.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s12; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step tail264
CALL=2 timeout 150 python3 reports/h200/session12-tail264.py > $W/tail.log 2>&1; tail -14 $W/tail.log; cp $W/tail.log $OUT/
step golden
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1; tail -1 $W/golden.log; cp $W/golden.log $OUT/
step gpu-tests
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --ignore=tests/test_notebooks.py tests > $W/t-gpu.log 2>&1
grep -E "passed|failed|Error" $W/t-gpu.log | tail -8; cp $W/t-gpu.log $OUT/
step done
