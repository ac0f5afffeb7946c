#!/usr/bin/env bash
# H200 session 1: the Triton kernels' GPU tests and microbenchmarks (run from the repo root through
# the device tool; results land in $OUT). Each step has its own time limit so one failure cannot
# eat the whole session.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"
for t in rowlocal attention gemm; do
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_$t.py 2>&1 | tail -25 > "$OUT/test_$t.txt"
  tail -3 "$OUT/test_$t.txt"
done
timeout 230 python3 -m h3lab.bench.gemm_bench --out "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1; tail -30 "$OUT/gemm.log"
timeout 170 python3 -m h3lab.bench.attention_bench --out "$OUT/attention.json" > "$OUT/attention.log" 2>&1; tail -20 "$OUT/attention.log"
