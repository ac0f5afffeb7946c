#!/usr/bin/env bash
# nvidia-h200 session 12, call 8 (issue 4): the final code on a fresh machine: golden digests, the block
# bench at 264 and 4096 rows (100 runs), GPU-only GEMM ratios (session10-call9.py), the rows bench.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s12; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step golden
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1; tail -1 $W/golden.log; cp $W/golden.log $OUT/
step block-bench
timeout 200 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 100 > $W/block.log 2>&1
python3 -c "
import json; r = json.load(open('$W/block.json'))
for n, d in r['rows'].items(): print(n, {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items() if not k.endswith('_seconds') and k != 'error_vs_fp64'})
"; cp $W/block.json $W/block.log $OUT/
step gemm-graph
timeout 120 python3 reports/h200/session10-call9.py > $W/gg.log 2>&1; cat $W/gg.log
step rows-bench
timeout 150 python3 -m h3lab.bench.rows_bench --out $W/rows.json --reps 20 > $W/rows.log 2>&1
grep -E "six_sets|BITS|Error" $W/rows.log | head -14; cp $W/rows.json $W/rows.log $OUT/ 2>/dev/null
step done
