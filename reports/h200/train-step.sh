#!/usr/bin/env bash
# The training step against eager PyTorch at real shapes on one H200, in one device call:
# h3lab.bench.train_step, blocks 0-3 with the embedders, token refiner and heads, 4096 packed rows,
# 2 warm-up and 5 timed steps per side. Writes $OUT/train-step.json (commit it as
# reports/h200/train-step.json) and $OUT/train-step.log.
#
# The eager side is diffusers' model, which the device image lacks: carry its wheel in .whl (pure
# Python; on the image's Python 3.12 it needs nothing else the image lacks), fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl diffusers==0.42.1
# and name .whl in the call's carry.
set -u
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/diffusers-0.42.1-py3-none-any.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
timeout 560 python3 -m h3lab.bench.train_step --out "$OUT/train-step.json" --config real --blocks 0-3 \
  --rows 4096 --steps 5 --warmup 2 --device cuda --backend triton 2>&1 | tee "$OUT/train-step.log"
