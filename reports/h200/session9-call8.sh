#!/usr/bin/env bash
# nvidia-h200 session 9, call 8: after the review fixes (RoPE keeps torch.round's signed zero, the
# plan refuses metadata written before its read and checks keys before positions, int64 segment
# starts): golden digests, the kernel tests, two layouts at the real shapes, the block bench.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=2
OUT=${OUT:-/tmp/out}; W=/tmp/s9; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step golden
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden.log 2>&1; tail -1 $W/golden.log
step tests
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_rowlocal.py tests/test_kernels_few_rows.py > $W/t1.log 2>&1
tail -1 $W/t1.log
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gemm.py -k scratch > $W/t2.log 2>&1
tail -1 $W/t2.log; cp $W/t1.log $W/t2.log $OUT/
step layouts
timeout 110 python3 -m h3lab run --layout tp1 tp4xcp2+sp --synthetic real --rows 264 --device cuda --backend triton \
  --digests --timeout 100 --out $W/run > $W/run.log 2>&1
tail -4 $W/run.log; cp $W/run/summary.json $OUT/layouts-summary.json
step bench
OMP_NUM_THREADS=4 timeout 70 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 20 > $W/block.log 2>&1
tail -2 $W/block.log; cp $W/block.json $OUT/
step done
