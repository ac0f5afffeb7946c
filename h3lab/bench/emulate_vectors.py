"""Small test vectors for the sm90 emulator, derived from an H200 probe's data (a few KB, committed).

    python -m h3lab.bench.emulate_vectors --probe DIR --out tests/data/emulate_sm90_vectors.json

The probe's raw data (h3lab.bench.sm90_probe: the tiny capture, tree.npz) is never committed; this
keeps what CI needs to check the emulator against GPU bits without it:
- `trees`: the tl.sum trees the tree probe recovered for attention's layouts (fwd and delta at
  head_dim 32 and 128);
- `delta_rows`: the delta kernel's outputs on the first rows of the tree probe's random rows with
  random dO (inputs redrawn from the recorded seed with h3lab.bench.probe_rng; they show the
  products' FMA contractions);
- `calls`: a few output elements of GEMM calls of the tiny block's capture (one per family: mm,
  unit_reduce with three pieces, row_mm, mm_few_k) with exactly the inputs they need: activations
  as raw bytes, weights by reference to the reference problem's synthetic block (regenerated).
Tensors are {"dtype", "shape", "hex"} (little-endian bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from h3lab.io.jsonfile import write_json

FORMAT = "h3lab-emulate-vectors-v1"
DELTA_ROWS = 64
# (capture call index, method) sampled; unit_reduce_few_rows is left out: one output row needs all
# 3456 FP32 inputs of its d temb row (its IEEE FMA chain is checked by mma_probe's fp32 cases)
CALLS = ((5, "mm"), (42, "unit_reduce"), (29, "row_mm"), (53, "mm_few_k"))


def pack(t: Tensor) -> dict[str, Any]:
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "hex": raw.numpy().tobytes().hex()}


def unpack(d: dict[str, Any]) -> Tensor:
    dtype = getattr(torch, d["dtype"])
    raw = torch.frombuffer(bytearray(bytes.fromhex(d["hex"])), dtype=torch.uint8)
    return raw.view(dtype).reshape(d["shape"])


def _tree_part(probe: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from h3lab.bench.tree_probe import RANDOM_ROWS

    records = json.loads((probe / "summary.json").read_text())["parts"]["tree"]["records"]
    saved = np.load(probe / "tree.npz")
    trees, rows = {}, {}
    for r in records:
        key = f"{r['probe']}{r['head_dim']}"
        trees[key] = r["tree"]
        if r["probe"] == "delta":
            bits = saved[f"{key}.random_do"][:DELTA_ROWS].astype(np.int64).tolist()
            rows[key] = {"seed": r["seed"], "n": r["n"], "random_rows": RANDOM_ROWS, "bits": bits}
    return trees, rows


def _weight_ref(value: dict[str, Any]) -> dict[str, Any]:
    assert "weight" in value, value  # the sampled b operands are views of the block's weights
    return value


def _calls_part(probe: Path) -> list[dict[str, Any]]:
    from safetensors.torch import load_file

    from h3lab.bench.capture import resolve
    from h3lab.run import golden

    calls = json.loads((probe / "summary.json").read_text())["parts"]["capture"]["tiny"]["calls"]
    tensors = load_file(str(probe / "capture_tiny.safetensors"))
    weights = golden.REFERENCE.weights("cpu").tensors
    out = []
    for index, method in CALLS:
        call = calls[index]
        assert call["method"] == method, (index, call["method"])
        args = resolve(call["args"], tensors, weights)
        result = resolve(call["out"], tensors, weights)
        (M, N), picks = result.shape, lambda n: [0, n // 3, n - 1]  # first, last, one inside
        rows, cols = torch.tensor(picks(M)), torch.tensor(picks(N))
        entry: dict[str, Any] = {"call": index, "method": method, "rows": picks(M), "cols": picks(N)}
        if method == "mm":
            entry |= {"a": pack(args[0][rows]), "b": _weight_ref(call["args"]["list"][1]), "out_dtype": "bfloat16"}
        elif method == "unit_reduce":
            refs = call["args"]["list"][0]["list"]
            entry["pieces"] = [
                {"a": pack(a[rows]), "b": _weight_ref(next(iter(ref.values()))[1])}
                for (a, _), ref in zip(args[0], refs, strict=True)
            ]
            entry["num_units"] = args[1]
        elif method == "row_mm":
            entry |= {"a": pack(args[0][:, rows]), "b": pack(args[1][:, cols]), "order": pack(args[2])}
            entry["out_dtype"] = "bfloat16"
        else:  # mm_few_k: out [M, N] = a^T b, a [K, M]
            entry |= {"a": pack(args[0][:, rows]), "b": pack(args[1][:, cols]), "out_dtype": "bfloat16"}
        entry["out"] = pack(result[rows][:, cols])
        out.append(entry)
    return out


def derive(probe: Path) -> dict[str, Any]:
    summary = (probe / "summary.json").read_bytes()
    trees, delta_rows = _tree_part(probe)
    return {
        "format": FORMAT,
        "source": {"probe_summary_sha256": hashlib.sha256(summary).hexdigest(), "capture": "tiny (golden.REFERENCE)"},
        "trees": trees,
        "delta_rows": delta_rows,
        "calls": _calls_part(probe),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", type=Path, required=True, help="an sm90_probe output folder (summary.json, ...)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    path = write_json(a.out, derive(a.probe), indent=None)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
