#!/usr/bin/env bash
# nvidia-h200 session 11, call 8 (issue 4): the final code's real-shape layouts (tp1, tp2, tp8,
# tp4xcp2+sp at 264 rows, eight processes on the GPU) and GPU-only GEMM ratios (session10-call9.py).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s11; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step layouts
timeout 150 python3 -m h3lab run --layout tp1 tp2 tp8 tp4xcp2+sp --synthetic real --rows 264 --device cuda \
  --backend triton --digests --timeout 140 --out $W/run > $W/run.log 2>&1
tail -6 $W/run.log; cp $W/run/summary.json $OUT/real-layouts-summary.json
step gemm-graph
timeout 150 python3 reports/h200/session10-call9.py > $W/gg.log 2>&1; cat $W/gg.log
step done
