#!/usr/bin/env bash
# nvidia-h200 session 9, call 6 (issue 4): the final code of this session — the plan decided in numpy
# with one copy back to the device, row chains with 32 rows in flight. Golden digests, every layout at
# the real shapes (8 processes share the GPU, bytes over gloo), the block bench, the GPU tests, the
# gap profile. Results go to $OUT step by step (the lease may end mid-script).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=2  # 8 ranks share 16 cores
OUT=${OUT:-/tmp/out}; W=/tmp/s9; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step golden
for be in torch triton; do
  timeout 90 python3 -m h3lab verify --device cuda --backend $be > $W/golden-$be.log 2>&1; tail -1 $W/golden-$be.log
done
step layouts-264
timeout 230 python3 -m h3lab run --layout all --synthetic real --rows 264 --device cuda --backend triton \
  --digests --timeout 200 --out $W/run264 > $W/run264.log 2>&1
tail -9 $W/run264.log; cp $W/run264/summary.json $OUT/real-layouts-summary.json
step block-bench
OMP_NUM_THREADS=4 timeout 120 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 30 > $W/block.log 2>&1
tail -2 $W/block.log; cp $W/block.json $OUT/
step gpu-tests
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_rowlocal.py tests/test_kernels_few_rows.py > $W/t1.log 2>&1
tail -1 $W/t1.log
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gemm.py tests/test_kernels_attention.py > $W/t2.log 2>&1
tail -1 $W/t2.log; cp $W/t1.log $W/t2.log $OUT/
step profile
OMP_NUM_THREADS=4 timeout 90 python3 -m h3lab.bench.block_profile --out $W/profile --rows 264,4096 > $W/profile.log 2>&1
grep "^rows" $W/profile.log | head -2
cp $W/profile/profile.json $W/profile/gaps-*.json $OUT/
step done
