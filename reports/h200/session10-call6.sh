#!/usr/bin/env bash
# nvidia-h200 session 10, call 6 (issue 4): the Gluon unit-tree GEMM, nested loops against paired units (two
# accumulators, one wait per pair). Bitwise test (every variant), GPU-only times (CUDA graphs).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s10; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step gluon-test
timeout 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_kernels_gemm.py -k gluon > $W/t-gluon.log 2>&1
tail -3 $W/t-gluon.log; cp $W/t-gluon.log $OUT/
step graph-bench
PAIRED_TOO=1 timeout 200 python3 reports/h200/session10-call3.py 4096,264 > $W/graph.log 2>&1; cut -c1-600 $W/graph.log
step done
