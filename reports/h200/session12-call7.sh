#!/usr/bin/env bash
# nvidia-h200 session 12, call 7 (issue 4): the row chains side by side (rows.chain_sums: the block's
# 4 + 6 chain sets in two launches instead of ten): every GPU test, golden digests, the rows bench,
# the block bench at 264 and 4096 rows and its kernel profile at 4096.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s12; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step gpu-tests
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors tests > $W/t-gpu.log 2>&1
grep -E "passed|failed|FAILED|^ERROR" $W/t-gpu.log | tail -12; cp $W/t-gpu.log $OUT/
step golden
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1; tail -1 $W/golden.log; cp $W/golden.log $OUT/
step rows-bench
timeout 90 python3 -m h3lab.bench.rows_bench --out $W/rows.json --reps 20 > $W/rows.log 2>&1
grep -E "six_sets|BITS|Error" $W/rows.log | head -14; cp $W/rows.json $W/rows.log $OUT/
step block-bench
timeout 200 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 50 > $W/block.log 2>&1
python3 -c "
import json; r = json.load(open('$W/block.json'))
for n, d in r['rows'].items(): print(n, {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items() if not k.endswith('_seconds') and k != 'error_vs_fp64'})
"; cp $W/block.json $W/block.log $OUT/
step profile
timeout 80 python3 -m h3lab.bench.block_profile --out $W/profile --rows 4096 > $W/profile.log 2>&1
grep "^rows" $W/profile.log; cp $W/profile/profile.json $W/profile/profile-*.txt $W/profile.log $OUT/ 2>/dev/null
step done
