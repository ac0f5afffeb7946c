#!/usr/bin/env bash
# nvidia-h200 session 12, call 4 (issue 4): the pinned swapped row tail: GEMM times against the plain
# tiling (session12-tail264.py), golden digests, every GPU test (modules needing diffusers or jupytext,
# not installed on the node, are reported as collection errors and the rest run).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s12; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step tail264
timeout 100 python3 reports/h200/session12-tail264.py > $W/tail.log 2>&1; tail -12 $W/tail.log; cp $W/tail.log $OUT/
step golden
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1; tail -1 $W/golden.log; cp $W/golden.log $OUT/
step gpu-tests
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors tests > $W/t-gpu.log 2>&1
grep -E "passed|failed|FAILED|^ERROR" $W/t-gpu.log | tail -12; cp $W/t-gpu.log $OUT/
step done
