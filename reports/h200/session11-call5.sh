#!/usr/bin/env bash
# nvidia-h200 session 11, call 5 (issue 4): the few-row pins of call 4 and ff.net.0's weight gradient
# as one GEMM over [dh | dg]: golden digests (the bits must not move), GPU tests, block bench (100
# runs), real-shape layouts, profile at 4096 rows; then a finer few-row sweep.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s11; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step golden
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1; tail -1 $W/golden.log
step gpu-tests
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graph.py tests/test_kernels_few_rows.py \
  tests/test_kernels_rowlocal.py tests/test_kernels_gemm.py > $W/t-gpu.log 2>&1
tail -4 $W/t-gpu.log; cp $W/t-gpu.log $OUT/
step block-bench
timeout 240 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 100 > $W/block.log 2>&1
python3 -c "
import json; r = json.load(open('$W/block.json'))
for n, d in r['rows'].items(): print(n, {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items() if not k.endswith('_seconds') and k != 'error_vs_fp64'})
"; cp $W/block.json $W/block.log $OUT/
step layouts
timeout 150 python3 -m h3lab run --layout tp1 tp2 tp8 tp4xcp2+sp --synthetic real --rows 264 --device cuda \
  --backend triton --digests --timeout 140 --out $W/run > $W/run.log 2>&1
tail -6 $W/run.log; cp $W/run/summary.json $OUT/real-layouts-summary.json
step profile-4096
timeout 100 python3 -m h3lab.bench.block_profile --out $W/profile --rows 264,4096 > $W/profile.log 2>&1
grep "^rows" $W/profile.log; cp $W/profile/profile.json $W/profile/profile-*.txt $W/profile.log $OUT/ 2>/dev/null
step fewrows-refine
timeout 100 python3 reports/h200/session11-fewrows.py refine > $W/fr.log 2>&1; cut -c1-120 $W/fr.log; cp $W/fr.log $OUT/
step done
