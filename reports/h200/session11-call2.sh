#!/usr/bin/env bash
# nvidia-h200 session 11, call 2 (issue 4): GraphedBlock replaying batches with new metadata (the
# row plan decided per call), the block bench with 100 runs, ABBA-interleaved turns and the graph
# pool, and the real-shape layouts after the row-plan refactor.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s11; mkdir -p "$OUT" $W
step() { echo "== $1 $(date +%T)"; }
step graph-tests
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graph.py > $W/t-graph.log 2>&1
tail -15 $W/t-graph.log; cp $W/t-graph.log $OUT/
step block-bench
timeout 240 python3 -m h3lab.bench.block_gpu --out $W/block.json --rows 264,4096 --reps 100 > $W/block.log 2>&1
tail -4 $W/block.log | cut -c1-1500; cp $W/block.json $W/block.log $OUT/
step layouts
timeout 150 python3 -m h3lab run --layout tp1 tp2 tp8 tp4xcp2+sp --synthetic real --rows 264 --device cuda \
  --backend triton --digests --timeout 140 --out $W/run > $W/run.log 2>&1
tail -6 $W/run.log; cp $W/run/summary.json $OUT/real-layouts-summary.json
step done
