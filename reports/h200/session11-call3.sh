#!/usr/bin/env bash
# nvidia-h200 session 11, call 3 (issue 4): the interleaving experiment (session11-call3.py) and the
# block profile at 264 rows (where the captured canonical block's kernels take 1.9x eager's).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s11; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step interleave
timeout 200 python3 reports/h200/session11-call3.py > $W/il.log 2>&1; cut -c1-600 $W/il.log
step profile-264
timeout 150 python3 -m h3lab.bench.block_profile --out $W/profile --rows 264 > $W/profile.log 2>&1
tail -3 $W/profile.log; cp $W/profile/profile.json $W/profile/profile-264.txt $W/profile.log $OUT/ 2>/dev/null
step done
