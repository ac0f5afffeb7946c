#!/usr/bin/env bash
# nvidia-h200 session 11, call 9 (issue 4): after the review fixes (the row plan's ready event and
# stream, the device context, one in-place rule): graph GPU tests (a plan decided on a side stream,
# the in-place signature replayed), golden digests, block bench with the plan decided in each call.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s11; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step graph-tests
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graph.py > $W/t-graph.log 2>&1
tail -3 $W/t-graph.log; cp $W/t-graph.log $OUT/
step golden
timeout 45 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1; tail -1 $W/golden.log; cp $W/golden.log $OUT/
step block-bench
timeout 100 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 30 > $W/block.log 2>&1
python3 -c "
import json; r = json.load(open('$W/block.json'))
for n, d in r['rows'].items(): print(n, {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items() if 'graph' in k and not k.endswith('_seconds')})
"; cp $W/block.json $W/block.log $OUT/
step done
