#!/usr/bin/env bash
# Issue 18 on one H200 (kind nvidia-h200), from the repository root: bash reports/h200/longseq-gpu.sh
# Writes 8 files under $OUT; about 6 minutes on a fresh machine (Triton compiles included), at most
# 595 s (the timeouts below).
#  1. the attention GPU tests: the pinned kernels' contract, the TMA forward and the fused backward
#     against the pinned bytes; a hang of the fused backward's turns is cut at 120 s, and then the
#     fused backward is left out of the benchmark
#  2. attention at 4096, 16384, 32768, 65536 rows: pinned and TMA forwards with SDPA, then the fused
#     backwards in a run of their own (a hang there loses only that run)
#  3. the block against eager at 16384 and 32768 rows (no CUDA graphs; FP64 error at 16384)
#  4. where the block's time goes at 32768 rows
set -u
export PYTHONPATH=$PWD
T=$(mktemp -d)
L="$OUT/run.log"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.draw --format=csv > "$L" 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu \
  tests/test_kernels_attention.py tests/test_kernels_attention_long.py > "$OUT/tests.log" 2>&1
rc=$?
echo "pytest rc $rc" >> "$L"
A="python3 -m h3lab.bench.attention_long --rows 4096,16384,32768,65536"
timeout 120 $A --out "$OUT/attention-long.json" --variants fwd_tma_n128s3,fwd_tma_n64s3 > "$OUT/attention.log" 2>&1
echo "attention_long rc $?" >> "$L"
if [ "$rc" -ne 124 ]; then
  timeout 100 $A --out "$OUT/attention-fused.json" --variants fused_m64s2,fused_m32s3 --no-sdpa >> "$OUT/attention.log" 2>&1
  echo "attention_long fused rc $?" >> "$L"
fi
timeout 180 python3 -m h3lab.bench.block_gpu --out "$OUT/block-long.json" --rows 16384,32768 --reps 3 --no-graphs >> "$L" 2>&1
echo "block_gpu rc $?" >> "$L"
timeout 75 python3 -m h3lab.bench.block_profile --out "$T/profile" --rows 32768 --reps 3 >> "$L" 2>&1
echo "block_profile rc $?" >> "$L"
cp "$T/profile/profile.json" "$T/profile/profile-32768.txt" "$OUT/" 2>> "$L"
