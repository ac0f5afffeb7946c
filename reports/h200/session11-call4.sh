#!/usr/bin/env bash
# nvidia-h200 session 11, call 4 (issue 4): tile candidates of the AdaLN few-row kernels (session11-fewrows.py).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s11; mkdir -p "$OUT" $W
echo "== fewrows $(date +%T)"
timeout 300 python3 reports/h200/session11-fewrows.py 2>&1 | tee $W/fr.log | cut -c1-200
cp $W/fr.log $OUT/
echo "== done $(date +%T)"
