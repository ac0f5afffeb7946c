#!/usr/bin/env bash
# H200 session 2: golden digests, the canonical block against the eager block, and the tiny-config
# layout sweeps (deterministic and baseline) behind the published H200 report.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import json; from h3lab.env import capture; json.dump(capture('cuda'), open('$OUT/env.json', 'w'), indent=1)"
for b in torch triton; do timeout 150 python3 -m h3lab verify --device cuda --backend $b --record 2>&1 | tail -2; done
cp kernels/golden/H200.json "$OUT/golden-H200.json"
timeout 200 python3 -m h3lab.bench.block_gpu --out "$OUT/block.json" --rows 264,4096 --reps 10 2>&1 | tail -4
for mode in deterministic baseline; do
  timeout 130 python3 -m h3lab run --layout all --synthetic tiny --rows 264 --device cuda --backend triton \
    --mode $mode --out /tmp/h200/$mode > "/tmp/h200-$mode.log" 2>&1; tail -9 "/tmp/h200-$mode.log"
done
tar czf - --exclude='rank*.safetensors' --exclude='rank*.log' --exclude='*.heartbeat' -C /tmp h200 | split -b 15m - "$OUT/h200-runs.tgz."
ls -la "$OUT"
