#!/usr/bin/env bash
# nvidia-h200 session 12, call 5 (issue 4): the row tail kept to bf16 outputs: every GPU test, golden
# digests, the real-shape layouts (eight processes on the GPU), the block and its kernel profile at 264 rows.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s12; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step gpu-tests
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors tests > $W/t-gpu.log 2>&1
grep -E "passed|failed|FAILED|^ERROR" $W/t-gpu.log | tail -12; cp $W/t-gpu.log $OUT/
step golden
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1; tail -1 $W/golden.log; cp $W/golden.log $OUT/
step layouts
timeout 150 python3 -m h3lab run --layout tp1 tp2 tp8 tp4xcp2+sp --synthetic real --rows 264 --device cuda \
  --backend triton --digests --timeout 140 --out $W/run > $W/run.log 2>&1
tail -6 $W/run.log; cp $W/run/summary.json $OUT/real-layouts-summary.json
step block-bench
timeout 120 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264 --reps 100 > $W/block.log 2>&1
python3 -c "
import json; r = json.load(open('$W/block.json'))
for n, d in r['rows'].items(): print(n, {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items() if not k.endswith('_seconds') and k != 'error_vs_fp64'})
"; cp $W/block.json $W/block.log $OUT/
step profile
timeout 80 python3 -m h3lab.bench.block_profile --out $W/profile --rows 264 > $W/profile.log 2>&1
grep "^rows" $W/profile.log; cp $W/profile/profile.json $W/profile/profile-*.txt $W/profile.log $OUT/ 2>/dev/null
step done
