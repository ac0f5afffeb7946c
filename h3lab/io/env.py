"""What a run ran on: versions, devices, the node type, the git state and the determinism settings.

Every run records `env.json` from `capture()`; reports are grouped by `node_type()`, and golden
digest sets name the node types that recorded and observed them: CPU, H100, H200, B200 or
`unknown-<gpu name>`. H100 and H200 share compute capability 9.0, so the type is read from the
GPU's name, not its capability.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

KNOWN_GPUS = ("H100", "H200", "B200")
ENV_VARS = re.compile(
    r"^(CUBLAS_WORKSPACE_CONFIG|CUBLASLT_.*|NCCL_.*|TORCH_.*|OMP_NUM_THREADS|GLOO_SOCKET_IFNAME|"
    r"PET_.*|TRITON_.*|NVSHMEM_.*|CUDA_VISIBLE_DEVICES|H3LAB_.*)$"
)
REPO = Path(__file__).resolve().parents[2]


def node_type(device: torch.device | str | None = None) -> str:
    """CPU, H100, H200, B200 or unknown-<name> for the device a run uses (default: CUDA if present)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return "CPU"
    name = torch.cuda.get_device_name(device)
    for known in KNOWN_GPUS:
        if known in name.upper():
            return known
    return "unknown-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git() -> dict[str, Any]:
    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    return {
        "commit": commit or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None,
        "describe": git("describe", "--always", "--dirty") or None,
        "head_tree": git("rev-parse", "HEAD^{tree}") or None if commit else None,
        "tree": worktree_id() if commit else None,
    }


@functools.cache
def worktree_id() -> str | None:
    """The git tree id of the checkout's files as they are (tracked and untracked, .gitignore applied),
    built in a scratch index and a scratch object store (the checkout's objects as alternates): `git
    rev-parse C^{tree}` of the commit C the files match. A record from a changed checkout so still
    names the code it ran (a device's copy of a working tree has the last landed commit as HEAD and
    later commits as changes). Touches neither the checkout's index, HEAD nor its object store; once
    per process. None when git cannot say."""
    objects = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--absolute-git-dir"], capture_output=True, text=True, timeout=10
    )
    if objects.returncode != 0:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "objects").mkdir()  # git refuses an object directory that does not exist
        env = os.environ | {
            "GIT_INDEX_FILE": str(Path(tmp) / "index"),
            "GIT_OBJECT_DIRECTORY": str(Path(tmp) / "objects"),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(Path(objects.stdout.strip()) / "objects"),
        }
        for args in (["read-tree", "HEAD"], ["add", "-A"], ["write-tree"]):
            out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60, env=env)
            if out.returncode != 0:
                return None
        return out.stdout.strip() or None


def code_label(git: dict[str, Any]) -> str | None:
    """`git describe --dirty` of a record's git state, and when the files are not HEAD's (changed or
    new files) the tree they form ("2dfed9c-dirty, tree 3e913a0"): `git log --all --format='%h %T' |
    grep 3e913a0` finds the commit with those files."""
    label, tree = git.get("describe"), git.get("tree")
    if label and tree and files_changed(git):
        label += f", tree {tree[:7]}"
    return label


def files_changed(git: dict[str, Any]) -> bool:
    """Whether a record's checkout had other files than its HEAD (changed or new); records made
    before head_tree was recorded answer by git's dirty flag (changes to tracked files)."""
    tree, head_tree = git.get("tree"), git.get("head_tree")
    return bool(tree != head_tree if tree and head_tree else git.get("dirty"))


def _gpus() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
                "multiprocessors": p.multi_processor_count,
            }
        )
    return out


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _version(module: str) -> str | None:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


def determinism_settings() -> dict[str, Any]:
    m = torch.backends.cuda.matmul
    return {
        "cuda.matmul.allow_tf32": m.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "allow_bf16_reduced_precision_reduction": m.allow_bf16_reduced_precision_reduction,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "num_threads": torch.get_num_threads(),
    }


def capture(device: torch.device | str | None = None) -> dict[str, Any]:
    """The whole environment record (JSON-serialisable)."""
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            nccl = None
    return {
        "node_type": node_type(device),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": {"model": _cpu_model(), "count": os.cpu_count()},
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "driver": _driver() if torch.cuda.is_available() else None,
        "nccl": nccl,
        "gpus": _gpus(),
        "git": _git(),
        "determinism": determinism_settings(),
        "env": {k: v for k, v in sorted(os.environ.items()) if ENV_VARS.match(k)},
        "packages": {d.metadata["Name"]: d.version for d in importlib.metadata.distributions() if d.metadata["Name"]},
    }


def brief(record: dict[str, Any]) -> dict[str, Any]:
    """The few fields of a `capture()` record that a summary carries inline (the rest is env.json)."""
    gpus = record.get("gpus") or []
    return {
        "node_type": record["node_type"],
        "python": record["python"],
        "torch": record["torch"],
        "platform": record["platform"],
        "cuda": record["cuda"],
        "gpu": gpus[0]["name"] if gpus else None,
        "torch_threads": record["determinism"]["num_threads"],
    }
