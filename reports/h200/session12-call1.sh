#!/usr/bin/env bash
# nvidia-h200 session 12, call 1 (issue 4): the clean-up commit 874c398 on the GPU (every GPU test,
# golden digests) and the 264-row probe (session12-probe264.py: tail tiles' bits and times).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s12; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
step probe264
timeout 200 python3 reports/h200/session12-probe264.py > $W/probe.log 2>&1; cat $W/probe.log | tail -30; cp $W/probe.log $OUT/
step golden
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1; tail -1 $W/golden.log; cp $W/golden.log $OUT/
step gpu-tests
timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests > $W/t-gpu.log 2>&1
tail -5 $W/t-gpu.log; cp $W/t-gpu.log $OUT/
step done
