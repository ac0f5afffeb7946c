#!/usr/bin/env bash
# H200 session 3: the canonical block against the eager block (after the rounding fix), every layout
# at the real H3 shapes with the Triton kernels (8 processes share the GPU, bytes over gloo), and a
# 50-block real-shape chain under tp1 and tp2.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD OMP_NUM_THREADS=2  # 8 ranks share 16 cores (CPU weight generation)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 -m h3lab.bench.block_gpu --out "$OUT/block.json" --rows 264,4096 --reps 10 2>&1 | tail -3
timeout 300 python3 -m h3lab run --layout all --synthetic real --rows 264 --device cuda --backend triton --digests \
  --timeout 200 --out /tmp/real > "$OUT/real-layouts.log" 2>&1; tail -10 "$OUT/real-layouts.log"
cp /tmp/real/summary.json "$OUT/real-layouts-summary.json"
timeout 150 python3 -m h3lab run --layout tp1 tp2 --synthetic real --rows 264 --blocks 0-49 --device cuda \
  --backend triton --digests --timeout 140 --out /tmp/chain > "$OUT/chain50.log" 2>&1; tail -5 "$OUT/chain50.log"
cp /tmp/chain/summary.json "$OUT/chain50-summary.json" 2>/dev/null
