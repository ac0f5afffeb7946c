#!/usr/bin/env bash
# nvidia-h200-x2 session 6, after the few-row AdaLN kernels and the cached index checks (issue 4)
# and the current-device fix for one process per GPU (issue 7): kernel tests, golden digests,
# the block benchmark and profile, every layout at real shapes (tp2 over NCCL on the two GPUs,
# the rest sharing them over gloo), and tp2 over NCCL at 4096 rows. Run from the repository root.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s6; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
finish() { tar czf $OUT/s6.tar.gz -C /tmp s6; cp kernels/golden/H200.json $OUT/ 2>/dev/null; }
trap finish EXIT

step gpu-tests
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_few_rows.py \
  tests/test_kernels_rowlocal.py > $W/gpu-tests.log 2>&1; tail -3 $W/gpu-tests.log

step golden
export CUDA_VISIBLE_DEVICES=0
timeout 60 python3 -m h3lab verify --device cuda --backend torch > $W/golden-torch.log 2>&1; tail -2 $W/golden-torch.log
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden-triton-before.log 2>&1
grep -iE "differ|fail|pass" $W/golden-triton-before.log | head -8
timeout 90 python3 -m h3lab verify --device cuda --backend triton --record > $W/golden-record.log 2>&1
timeout 60 python3 -m h3lab verify --device cuda --backend triton > $W/golden-triton-after.log 2>&1; tail -1 $W/golden-triton-after.log

step block-bench
timeout 150 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 10 > $W/block.log 2>&1
tail -2 $W/block.log
unset CUDA_VISIBLE_DEVICES

step layouts-264
timeout 230 python3 -m h3lab run --layout all --synthetic real --rows 264 --device cuda --backend triton \
  --digests --repeats 3 --timeout 200 --out $W/run264 > $W/run264.log 2>&1
tail -9 $W/run264.log; find $W/run264 -name '*.safetensors' -delete

step tp2-4096
timeout 110 python3 -m h3lab run --layout tp1 tp2 --synthetic real --rows 4096 --device cuda --backend triton \
  --digests --repeats 3 --timeout 100 --out $W/run4096 > $W/run4096.log 2>&1
tail -4 $W/run4096.log; find $W/run4096 -name '*.safetensors' -delete

step profile
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m h3lab.bench.block_profile --out $W/profile --rows 264,4096 \
  > $W/profile.log 2>&1; grep "^rows" $W/profile.log
step done
