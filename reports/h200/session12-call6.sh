#!/usr/bin/env bash
# nvidia-h200 session 12, call 6 (issue 4): d temb as explicit FMA chains and row chains with prefetched
# indices (session12-probe-chains.py): bits against the pinned kernels, GPU-only times.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s12; mkdir -p "$OUT" $W
echo "== probe-chains $(date +%T)"
timeout 400 python3 reports/h200/session12-probe-chains.py > $W/chains.log 2>&1; tail -20 $W/chains.log; cp $W/chains.log $OUT/
echo "== done $(date +%T)"
