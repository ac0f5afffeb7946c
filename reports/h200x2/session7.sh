#!/usr/bin/env bash
# nvidia-h200-x2 session 7 (issue 4), after removing the last per-call host copies, the dW
# re-assembly copies and the stacked AdaLN-row copy (no arithmetic change): row-kernel tests, the
# golden digests (must still reproduce), the block benchmark and profile, every layout at real
# shapes (tp2 over NCCL, the rest sharing the two GPUs over gloo), tp2 over NCCL at 4096 rows.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s7; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
trap 'tar czf $OUT/s7.tar.gz -C /tmp s7' EXIT

export CUDA_VISIBLE_DEVICES=0
step gpu-tests
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_rowlocal.py \
  tests/test_kernels_few_rows.py > $W/gpu-tests.log 2>&1; tail -1 $W/gpu-tests.log
step golden
for be in torch triton; do
  timeout 60 python3 -m h3lab verify --device cuda --backend $be > $W/golden-$be.log 2>&1; tail -1 $W/golden-$be.log
done
step block-bench
timeout 150 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 20 > $W/block.log 2>&1
tail -2 $W/block.log
step profile
timeout 60 python3 -m h3lab.bench.block_profile --out $W/profile --rows 264,4096 > $W/profile.log 2>&1
grep "^rows" $W/profile.log
unset CUDA_VISIBLE_DEVICES

step layouts-264
timeout 230 python3 -m h3lab run --layout all --synthetic real --rows 264 --device cuda --backend triton \
  --digests --repeats 3 --timeout 200 --out $W/run264 > $W/run264.log 2>&1
tail -9 $W/run264.log; find $W/run264 -name '*.safetensors' -delete
step tp2-4096
timeout 100 python3 -m h3lab run --layout tp1 tp2 --synthetic real --rows 4096 --device cuda --backend triton \
  --digests --repeats 3 --timeout 90 --out $W/run4096 > $W/run4096.log 2>&1
tail -4 $W/run4096.log; find $W/run4096 -name '*.safetensors' -delete
step done
