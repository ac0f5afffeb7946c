"""The reference problems on the triton backend with every backend call recorded (h3lab.bench.capture).

- tiny (h3lab.run.golden.REFERENCE: the tiny block, forward and backward): every call whole
  (`FullRecorder`), through canonical_block as the golden "block" digests are made;
- real (golden.REAL: the real widths, 520 rows of which 8 padding): a spot sample per call
  (h3lab.bench.spot_samples), through block_step as the golden "real" digests are made;
- trajectory (golden.TRAJECTORY: tiny, blocks 0-3, two sampler steps): every call whole, weights
  included, through tasks.compute as the golden "trajectory" digests are made. Replayed through the
  emulator and set beside an emulated run's own calls, it says whether a trajectory's bits leave the
  GPU's inside a backend call or in the torch code between calls.
Each part's record holds its call log, its tensors' shard files and its result digests compared with
the published set (kernels/golden/<set>.json: sm90 for the triton backend), so a capture says whether
it holds the published bits. Tensors go to safetensors shards of at most SHARD_BYTES each.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from h3lab.backend import Backend
from h3lab.bench.capture import FullRecorder, RecordingBackend, TensorStore
from h3lab.bench.spot_samples import SpotRecorder
from h3lab.block import block_step, canonical_block
from h3lab.comm import LocalComm
from h3lab.metrics import sha256_tensor
from h3lab.run import golden
from h3lab.units import unit_weights

SHARD_BYTES = 15 << 20  # under the 16 MiB a returned file may hold, with room for the header


def compare_digests(got: dict[str, str], set_name: str, part: str) -> dict[str, Any]:
    """The digests against the published set's part: which tensors match, which differ, which it lacks."""
    published = (golden.load_set(set_name) or {}).get(part, {})
    same = [k for k in got if published.get(k) == got[k]]
    return {
        "set": set_name,
        "part": part,
        "matches": len(same) == len(got) and bool(got),
        "matching": len(same),
        "differing": [k for k in got if k in published and published[k] != got[k]],
        "unpublished": [k for k in got if k not in published],
        "digests": got,
    }


def capture_tiny(backend: Backend, device: torch.device | str, set_name: str) -> tuple[dict, dict[str, Tensor]]:
    w, b = golden.REFERENCE.weights(device), golden.REFERENCE.batch(device)
    store = TensorStore(w.tensors)
    recorder = FullRecorder(store)
    result = canonical_block(w, b, backend=RecordingBackend(backend, recorder))
    digests = {k: sha256_tensor(v) for k, v in result.tensors().items()}
    record = {"problem": golden.REFERENCE.to_dict(), "calls": recorder.calls}
    return record | {"golden": compare_digests(digests, set_name, "block")}, store.tensors


def capture_real(backend: Backend, device: torch.device | str, set_name: str) -> tuple[dict, dict[str, Tensor]]:
    w, b = golden.REAL.weights(device), golden.REAL.batch(device)
    store = TensorStore(w.tensors)
    recorder = SpotRecorder(store)
    step = block_step(unit_weights(w), b, LocalComm(), backend=RecordingBackend(backend, recorder))
    tensors = {"out": step.out, "dx": step.dx, "dtemb": step.dtemb}
    tensors |= {f"dw.{k}": v for k, v in step.dw_replicated.items()}
    tensors |= {f"dw.{k}@u{u}": t for k, per in step.dw_units.items() for u, t in per.items()}
    digests = {k: sha256_tensor(v) for k, v in tensors.items()}
    record = {"problem": golden.REAL.to_dict(), "calls": recorder.calls}
    return record | {"golden": compare_digests(digests, set_name, "real")}, store.tensors


def capture_trajectory(backend: Backend, device: torch.device | str, set_name: str) -> tuple[dict, dict[str, Tensor]]:
    from h3lab.run import tasks

    store = TensorStore({})  # the model's weights are built inside the task: stored whole, once each
    recorder = FullRecorder(store)
    problem = replace(golden.TRAJECTORY, device=str(device), backend=backend.name)
    be = RecordingBackend(backend, recorder)
    result = tasks.compute(problem, LocalComm(), torch.device(device), backend=be).tensors
    digests = {k: sha256_tensor(v) for k, v in result.items()}
    record = {"problem": golden.TRAJECTORY.to_dict(), "calls": recorder.calls}
    return record | {"golden": compare_digests(digests, set_name, "trajectory")}, store.tensors


CAPTURES = {"tiny": capture_tiny, "real": capture_real, "trajectory": capture_trajectory}


def save_shards(out_dir: Path, stem: str, tensors: dict[str, Tensor], limit: int = SHARD_BYTES) -> dict[str, Any]:
    """Tensors in key order into `stem`.safetensors (or `stem`-0, -1, ... past `limit` bytes each):
    {file: {"bytes", "keys"}}."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        n = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += n
    out = {}
    for i, shard in enumerate(shards):
        name = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{i}.safetensors"
        save_file(shard, str(out_dir / name))
        out[name] = {"bytes": (out_dir / name).stat().st_size, "keys": sorted(shard)}
    return out


def probe(
    out_dir: Path,
    backend: Backend,
    device: torch.device | str,
    set_name: str = "sm90",
    captures: tuple = ("tiny", "real"),
) -> dict[str, Any]:
    """The named captures (of `CAPTURES`) with `backend` on `device`, saved under out_dir; the part's record."""
    record = {}
    for name in captures:
        part, tensors = CAPTURES[name](backend, device, set_name)
        record[name] = part | {"files": save_shards(out_dir, f"capture_{name}", tensors)}
    return record
