"""What `h3lab publish` sweeps per node kind: the reproduce notebook's parameters, one sweep per stage.

On a CPU node the tiny configuration: every layout in both modes at 264 rows, a 50-block chain
under every layout, a 2-step trajectory and 2 training steps of blocks 0-3 under three layouts. On a
GPU node the real shapes with the Triton kernels and digests of the weight gradients: every layout in
both modes at 264 rows, tp1 and tp2 at 4096 rows, a 50-block chain, 2 training steps of blocks 0-3.
Each layout runs one process per GPU where its ranks fit the publish's GPUs (NCCL), else its ranks
share them (gloo). `gpus` and `run_dir` are added per publish.
"""

from __future__ import annotations

from typing import Any

DETERMINISTIC = ["deterministic"]
BOTH = ["deterministic", "baseline"]
_GPU = {"device": "cuda", "config": "real", "backend": "triton", "digests": True, "timeout": 900.0}

SWEEPS: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {
        "sweep": {"device": "cpu", "config": "tiny", "layouts": "all", "rows": 264, "modes": BOTH},
        "chain": {
            "device": "cpu",
            "config": "tiny",
            "layouts": "all",
            "blocks": "0-49",
            "digests": True,
            "rows": 264,
            "modes": DETERMINISTIC,
            "accuracy": False,
        },
        "trajectory": {
            "device": "cpu",
            "config": "tiny",
            "layouts": "tp2,tp4xcp2+sp,tp8:2x4",
            "blocks": "0-3",
            "trajectory": 2,
            "modes": DETERMINISTIC,
            "accuracy": False,
        },
        "train": {
            "device": "cpu",
            "config": "tiny",
            "layouts": "tp2,tp4xcp2+sp,tp8:2x4",
            "blocks": "0-3",
            "train_steps": 2,
            "modes": DETERMINISTIC,
            "accuracy": False,
        },
    },
    "gpu": {
        "sweep": _GPU | {"layouts": "all", "rows": 264, "modes": BOTH},
        "sweep_4096": _GPU | {"layouts": "tp1,tp2", "rows": 4096, "modes": DETERMINISTIC, "accuracy": False},
        "chain": _GPU
        | {"layouts": "tp1,tp2", "blocks": "0-49", "rows": 264, "modes": DETERMINISTIC, "accuracy": False},
        "train": _GPU
        | {"layouts": "tp1,tp2", "blocks": "0-3", "train_steps": 2, "modes": DETERMINISTIC, "accuracy": False},
    },
}


def sweeps(node: str) -> dict[str, dict[str, Any]]:
    """The sweeps of a node type (cpu, or a GPU node type: its kind's), by stage name."""
    return SWEEPS["cpu" if node == "cpu" else "gpu"]
