#!/usr/bin/env bash
# H200 session 4: the 50-block real-shape chain under tp1 and tp2 (Triton kernels, digests-only),
# with a cProfile of the parent process (the canonical chain) to see where its time goes.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 460 python3 -m cProfile -o "$OUT/chain50.prof" -m h3lab run --layout tp1 tp2 --synthetic real --rows 264 \
  --blocks 0-49 --device cuda --backend triton --digests --timeout 200 --out /tmp/chain > "$OUT/chain50.log" 2>&1
tail -5 "$OUT/chain50.log"; cp /tmp/chain/summary.json "$OUT/chain50-summary.json" 2>/dev/null
