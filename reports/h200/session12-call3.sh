#!/usr/bin/env bash
# nvidia-h200 session 12, call 3 (issue 4): the swapped row tail (wgmma) against the mma.sync one. It ran an
# intermediate kernel with a TAIL_SWAP switch, since removed (the swapped tail is the only one now): call 4 reruns.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s12; mkdir -p "$OUT" $W
echo "== tail264-swap $(date +%T)"
SWAP=1 timeout 200 python3 reports/h200/session12-tail264.py > $W/tail-swap.log 2>&1; tail -14 $W/tail-swap.log; cp $W/tail-swap.log $OUT/
echo "== done $(date +%T)"
