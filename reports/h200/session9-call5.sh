#!/usr/bin/env bash
# nvidia-h200 session 9, call 5 (issue 4): row chains with 64 rows in flight (was 16; bits by construction the same, golden
# digests check); a sweep of the row-chain settings; wall against the block's own event laps.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s9; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step golden
for be in triton; do
  timeout 90 python3 -m h3lab verify --device cuda --backend $be > $W/golden-$be.log 2>&1; tail -1 $W/golden-$be.log
done
step gpu-tests
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_rowlocal.py > $W/gpu-tests.log 2>&1
tail -1 $W/gpu-tests.log
step rows-bench
timeout 90 python3 -m h3lab.bench.rows_bench --out $W/rows.json > $W/rows.log 2>&1; cat $W/rows.log | grep -v Warn; cp $W/rows.json $OUT/
step block-bench
timeout 150 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 20 > $W/block.log 2>&1
tail -2 $W/block.log; cp $W/block.json $OUT/
step profile
timeout 180 python3 -m h3lab.bench.block_profile --out $W/profile --rows 264,4096 > $W/profile.log 2>&1
grep "^rows" $W/profile.log | head -2
cp $W/profile/profile.json $W/profile/gaps-*.json $W/profile/profile-*.txt $OUT/
python3 -c "
import json
for r in (264, 4096):
    g = json.load(open('$W/profile/gaps-%d.json' % r))
    print(r, 'span', round(g['span_us']), 'busy', round(g['busy_us']), 'idle', round(g['idle_us']), 'gaps', g['gaps'])
    for k, v in list(g['idle_by_op_us'].items())[:12]: print('   ', k, round(v))
    for x in g['largest'][:8]: print('   gap', round(x['gap_us']), x['after_op'], '->', x['before_kernel'][:50], x['syncs'])
"
step done
