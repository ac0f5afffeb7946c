"""Golden digests: the published bits of a reference problem, per node type and backend.

`kernels/golden/<node type>.json` pins the sha256 of the canonical block's out, dx, dtemb and every
dW for one reference problem (tiny config, synthetic weights of seed 0, block 0, 264 packed rows
of seed 0). `verify` recomputes them on the machine at hand and names the first tensor that
differs. The digests are recorded outputs, re-recorded only when the arithmetic is meant to change.

On a GPU the tiny config (head_dim 32) does not reach the kernels' real tiles, so a backend may
also pin the real-shape problem `REAL` (real config, 520 rows of which 8 are padding: a GEMM row
tail, padding among the rows): out, dx, dtemb and every per-unit slice of every dW.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from h3lab.block import canonical_block
from h3lab.contract import CONTRACT_ID
from h3lab.io.env import capture, node_type
from h3lab.io.jsonfile import write_json
from h3lab.metrics import sha256_tensor
from h3lab.run.problem import Problem
from h3lab.triton.configs import KERNELS_DIR

GOLDEN_DIR = KERNELS_DIR / "golden"
REFERENCE = Problem(synthetic="tiny", weights_seed=0, block=0, rows=264, padding=0, seed=0)
# the generation gate: 2 sampler steps through the whole tiny transformer (4 blocks), seed 0
TRAJECTORY = Problem(synthetic="tiny", task="trajectory", block=0, last_block=3, steps=2, seed=0)
# the kernels at the real H3 shapes (GPU backends)
REAL = Problem(synthetic="real", weights_seed=0, block=0, rows=520, padding=8, seed=0)


def reference_digests(backend: str, device: str) -> dict[str, str]:
    """sha256 of every tensor of the reference problem's canonical block, in `BlockResult.tensors()` order."""
    p = replace(REFERENCE, device=device, backend=backend)
    result = canonical_block(p.weights(device), p.batch(device), backend=backend)
    return {k: sha256_tensor(v) for k, v in result.tensors().items()}


def trajectory_digests(backend: str, device: str) -> dict[str, str]:
    """sha256 of the reference trajectory's latents after every step (`step{k}.video`, `step{k}.audio`)."""
    from h3lab.comm import LocalComm
    from h3lab.run import tasks

    p = replace(TRAJECTORY, device=device, backend=backend)
    tensors = tasks.compute(p, LocalComm(), torch.device(device)).tensors
    return {k: sha256_tensor(v) for k, v in tensors.items()}


def real_digests(backend: str, device: str) -> dict[str, str]:
    """sha256 of the real-shape problem's tensors as one process computes them: out, dx, dtemb, the
    replicated dW and every per-unit dW slice (`dw.<grad>@u<u>`), in the order the block returns them."""
    from h3lab.comm import LocalComm
    from h3lab.run import tasks

    p = replace(REAL, device=device, backend=backend)
    tensors = tasks.compute(p, LocalComm(), torch.device(device)).tensors
    return {k: sha256_tensor(v) for k, v in tensors.items()}


def golden_path(node: str) -> Path:
    return GOLDEN_DIR / f"{node}.json"


def record(backend: str, device: str, *, real: bool = False) -> Path:
    """Compute and write the digests of this node type and backend (keeps the file's other backends);
    `real` adds the real-shape problem's digests."""
    node = node_type(device)
    path = golden_path(node)
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"node_type": node, "backends": {}}
    env = capture(device)
    data["contract"] = CONTRACT_ID
    data["problem"] = REFERENCE.to_dict() | {"device": None, "backend": None}
    data["trajectory_problem"] = TRAJECTORY.to_dict() | {"device": None, "backend": None}
    data["backends"][backend] = {
        "digests": reference_digests(backend, device),
        "trajectory": trajectory_digests(backend, device),
        "recorded": time.strftime("%Y-%m-%d"),
        "environment": {k: env[k] for k in ("torch", "triton", "cuda", "driver", "platform")} | {"gpus": env["gpus"]},
    }
    if real:
        data["real_problem"] = REAL.to_dict() | {"device": None, "backend": None}
        data["backends"][backend]["real"] = real_digests(backend, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)
    return path


def verify(backend: str, device: str, *, real: bool = True) -> dict[str, Any]:
    """Recompute the reference digests here and compare with the published ones of this node type
    (and the real-shape problem's, where they are published and `real`).

    Returns {"node_type", "backend", "match", "first_mismatch", "tensors": {name: {"expected", "got"}}}.

    Raises:
        ValueError: no golden digests are published for this node type and backend.
    """
    node = node_type(device)
    path = golden_path(node)
    published = json.loads(path.read_text())["backends"].get(backend) if path.exists() else None
    if published is None:
        have = sorted(p.stem for p in GOLDEN_DIR.glob("*.json"))
        raise ValueError(
            f"no golden digests for node type {node!r} and backend {backend!r} in {GOLDEN_DIR}; "
            f"published node types: {have}"
        )
    got = reference_digests(backend, device)
    expected = dict(published["digests"])
    if "trajectory" in published:  # the generation gate, when this node type has it recorded
        got |= {f"trajectory.{k}": v for k, v in trajectory_digests(backend, device).items()}
        expected |= {f"trajectory.{k}": v for k, v in published["trajectory"].items()}
    if real and "real" in published:
        got |= {f"real.{k}": v for k, v in real_digests(backend, device).items()}
        expected |= {f"real.{k}": v for k, v in published["real"].items()}
    names = list(expected)  # the recorded order: out, dx, dtemb, dw.<parameter>...
    mismatched = [n for n in names if got.get(n) != expected[n]]
    return {
        "node_type": node,
        "backend": backend,
        "match": not mismatched and got.keys() == expected.keys(),
        "first_mismatch": mismatched[0] if mismatched else None,
        "tensors": {n: {"expected": expected[n], "got": got.get(n)} for n in names},
        "device": str(torch.device(device)),
    }
