"""Pinned kernel configurations per node type, read from `kernels/<node>.json` (package data in a wheel).

The tile sizes, K order, warps and stages of every kernel fix its bits, so they are data, chosen
offline and committed, never autotuned at run time. A device with no pinned file, or a kernel or
shape a file does not cover, raises: nothing falls back to another configuration.

Node types: `sm90` (H100, H200: compute capability 9.0), `sm100` (B200: 10.0). Interpreter runs
(TRITON_INTERPRET=1, CPU) name the node type explicitly. A file says `"verified": true` once a GPU
of its architecture has run the GPU tests and layouts with it; `sm100.json` is not verified: its
configurations only compile for sm100 (kernels/README.md).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

NODE_BY_CAPABILITY = {(9, 0): "sm90", (10, 0): "sm100"}


def kernels_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The folder of the pinned files and golden sets: $H3LAB_KERNELS_DIR if set, else h3lab/kernels, in
    a checkout a link to its kernels/ (resolved: the checkout's files, which `h3lab verify --record`
    writes), in an installed wheel the files themselves (pyproject.toml's package data); a copy of a
    checkout that dropped the link, or wrote it as a plain file, reads its kernels/."""
    if "H3LAB_KERNELS_DIR" in environ:
        return Path(environ["H3LAB_KERNELS_DIR"])
    packaged, checkout = (Path(__file__).resolve().parents[k] / "kernels" for k in (1, 2))
    return (packaged if packaged.is_dir() else checkout).resolve()


KERNELS_DIR = kernels_dir()


def cdiv(a: int, b: int) -> int:
    """Ceil division of host integers (launch grids). triton.cdiv is a ConstexprFunction, whose host call
    costs many times this integer division, and a block step sizes about a hundred grids."""
    return -(-a // b)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def node_of(device: torch.device | str) -> str:
    """The node type of a CUDA device (`sm90`, `sm100`); raises for anything without pinned kernels."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"Triton kernels run on CUDA devices; got {device} (or TRITON_INTERPRET=1 with a named node)")
    cap = torch.cuda.get_device_capability(device)
    if cap not in NODE_BY_CAPABILITY:
        allowed = {f"{a}.{b}": n for (a, b), n in NODE_BY_CAPABILITY.items()}
        raise ValueError(f"no pinned kernel configurations for capability {cap[0]}.{cap[1]}; allowed: {allowed}")
    return NODE_BY_CAPABILITY[cap]


@functools.cache
def _load(node: str) -> dict[str, Any]:
    path = KERNELS_DIR / f"{node}.json"
    if not path.is_file():
        raise ValueError(f"no pinned configuration file {path}; node types with one: {sorted(available())}")
    return json.loads(path.read_text())


def available() -> list[str]:
    return sorted(p.stem for p in KERNELS_DIR.glob("sm*.json"))


def pinned(kernel: str, node: str) -> dict[str, Any]:
    """The pinned configuration of `kernel` on `node`. Raises when the file has none."""
    kernels = _load(node)["kernels"]
    if kernel not in kernels:
        raise ValueError(f"{node}.json pins no configuration for kernel {kernel!r}; pinned: {sorted(kernels)}")
    return dict(kernels[kernel])


def verified(node: str) -> bool:
    """Whether `node`'s pinned file has been run on a GPU of its architecture (`"verified": true`)."""
    return _load(node).get("verified") is True


def describe(node: str) -> dict[str, Any]:
    """The whole pinned file plus the Triton version, for run records."""
    import triton

    return {"node": node, "file": str(KERNELS_DIR / f"{node}.json"), "triton": triton.__version__, **_load(node)}
