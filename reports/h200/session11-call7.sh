#!/usr/bin/env bash
# nvidia-h200 session 11, call 7 (issue 4): the final code (GraphedBlock, the row plan decided ahead,
# ff.net.0's weight gradient as one GEMM, the few-row tiles of calls 4-5; row chains still the Triton
# kernel): golden digests, GPU tests, block bench (100 runs), profile at 264 and 4096 rows.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s11; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step golden
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1; tail -1 $W/golden.log; cp $W/golden.log $OUT/
step gpu-tests
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graph.py tests/test_kernels_few_rows.py \
  tests/test_kernels_rowlocal.py > $W/t-gpu.log 2>&1
tail -3 $W/t-gpu.log; cp $W/t-gpu.log $OUT/gpu-tests.log
step block-bench
timeout 220 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 100 > $W/block.log 2>&1
python3 -c "
import json; r = json.load(open('$W/block.json'))
for n, d in r['rows'].items(): print(n, {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items() if not k.endswith('_seconds') and k != 'error_vs_fp64'})
"; cp $W/block.json $W/block.log $OUT/
step profile
timeout 100 python3 -m h3lab.bench.block_profile --out $W/profile --rows 264,4096 > $W/profile.log 2>&1
grep "^rows" $W/profile.log; cp $W/profile/profile.json $W/profile/profile-*.txt $W/profile.log $OUT/ 2>/dev/null
step done
