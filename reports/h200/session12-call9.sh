#!/usr/bin/env bash
# nvidia-h200 session 12, call 9 (issue 4): the real-shape layouts with the final code (row chains side
# by side changed the backward's launches for every layout): tp1, tp2, tp8, tp4xcp2+sp at 264 rows.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s12; mkdir -p "$OUT" $W
echo "== layouts $(date +%T)"
timeout 200 python3 -m h3lab run --layout tp1 tp2 tp8 tp4xcp2+sp --synthetic real --rows 264 --device cuda \
  --backend triton --digests --timeout 180 --out $W/run > $W/run.log 2>&1
tail -6 $W/run.log; cp $W/run/summary.json $OUT/real-layouts-summary.json
echo "== done $(date +%T)"
