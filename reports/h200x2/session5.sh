#!/usr/bin/env bash
# nvidia-h200-x2 session 5: (1) where the canonical block's time goes on one H200 (issue 4);
# (2) issue 7 on the two GPUs this kind lends: tp2 with one process per GPU over NCCL at 264 and
# 4096 rows (real shapes), deterministic collectives against NCCL all_reduce on 2 GPUs, and the
# eager non-deterministic TP2 block on the same GPUs. Run from the repository root.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; W=/tmp/s5; mkdir -p "$OUT" $W
nvidia-smi topo -m > $W/topo.txt 2>&1; nvidia-smi > $W/nvidia-smi.txt 2>&1
python3 -c "import torch,triton;print(torch.__version__,triton.__version__,torch.cuda.device_count())" | tee $W/versions.txt
step() { echo "== $1 $(date +%T)"; }

step profile
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m h3lab.bench.block_profile --out $W/profile --rows 264,4096 \
  > $W/profile.log 2>&1; tail -3 $W/profile.log

step layouts-nccl
for rows in 264 4096; do
  timeout 200 python3 -m h3lab run --layout tp1 tp2 --synthetic real --rows $rows --device cuda --backend triton \
    --digests --repeats 3 --timeout 150 --out $W/run$rows > $W/run$rows.log 2>&1
  tail -4 $W/run$rows.log; find $W/run$rows -name '*.safetensors' -delete
done

step collectives
timeout 150 python3 - > $W/coll.log 2>&1 <<'PY'
from pathlib import Path
from h3lab.launch import launch
r = launch("h3lab.workers.collective_check", ["/tmp/s5/coll", "--bench", "--device", "cuda", "--backend", "nccl",
           "--bench-mib", "1,4,16,64,256,1024", "--iters", "10", "--warmup", "3"],
           nproc_per_node=2, log_dir=Path("/tmp/s5/coll/logs"), timeout_s=140)
print("collectives ok", r.ok, r.elapsed_s)
PY
tail -2 $W/coll.log

step eager-tp
timeout 150 python3 - > $W/eager.log 2>&1 <<'PY'
from pathlib import Path
from h3lab.launch import launch
for n in (1, 2):
    r = launch("h3lab.workers.eager_tp", [f"/tmp/s5/eager_tp{n}", "--config", "real", "--rows", "264,4096",
               "--device", "cuda", "--reps", "10"], nproc_per_node=n, log_dir=Path(f"/tmp/s5/eager_tp{n}/logs"),
               timeout_s=70)
    print("eager tp", n, r.ok, r.elapsed_s)
PY
tail -2 $W/eager.log
step done
tar czf $OUT/s5.tar.gz -C /tmp s5
