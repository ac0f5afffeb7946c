#!/usr/bin/env bash
# nvidia-h200 session 9, call 1 (issue 4): where the 5.4 ms the host adds to the block at 4096 rows
# goes, before changing anything: every sync site, and the GPU's idle gaps charged to block ops.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s9; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step syncs
timeout 120 python3 -m h3lab.bench.sync_sites --rows 4096 2>&1 | tail -30
step profile
timeout 180 python3 -m h3lab.bench.block_profile --out $W/profile --rows 264,4096 > $W/profile.log 2>&1
grep "^rows" $W/profile.log; tail -3 $W/profile.log
cp $W/profile/profile.json $W/profile/gaps-*.json $OUT/
python3 -c "
import json
for r in (264, 4096):
    g = json.load(open('$W/profile/gaps-%d.json' % r))
    print(r, 'span', round(g['span_us']), 'busy', round(g['busy_us']), 'idle', round(g['idle_us']), 'gaps', g['gaps'])
    for k, v in list(g['idle_by_op_us'].items())[:15]: print('   ', k, round(v))
    for x in g['largest'][:12]: print('   gap', round(x['gap_us']), x['after_op'], '->', x['before_kernel'][:50], x['syncs'])
"
step done
