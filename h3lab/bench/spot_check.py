"""The real-shape capture's spot samples recomputed by a backend: GPU elements checked from their inputs alone.

    python -m h3lab.bench.spot_check --probe DIR [--backend emulate-sm90] [--json PATH]

An sm90 probe's `capture_real` (h3lab.bench.sm90_capture, h3lab.bench.spot_samples) holds, per
backend call of the real-shape block (golden.REAL), a few output elements with exactly the inputs
that make them. Each is recomputed here through `backend` (default the sm90 emulator) on the
sampled inputs and compared bit for bit: a GEMM element is one dot product over its row of a and
column of b, an attention row needs its query and every key of its head, a row-local op its row.
The block's weights are regenerated (the reference problem's synthetic block: about 10 s and 3 GB
at the real shapes). A method whose model is missing (h3lab.emulate.sfu) is reported with the
missing model, never counted as checked.

Dimension legend: as h3lab.bench.spot_samples.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from h3lab.backend import Backend, get_backend
from h3lab.bench.capture import resolve, same_bits
from h3lab.io.jsonfile import write_json


class Sample:
    """One call's spot sample with its tensors resolved on demand (slices of weights included)."""

    def __init__(self, call: dict[str, Any], tensors: dict[str, Tensor], weights: dict[str, Tensor]) -> None:
        self.call, self._tensors, self._weights = call, tensors, weights

    def __getitem__(self, key: str) -> Any:
        return self.get(self.call[key])

    def part(self, prefix: str) -> Sample:
        """The sample kept under keys `prefix`.* (a fused call's sample of each of its parts)."""
        inner = {k[len(prefix) + 1 :]: v for k, v in self.call.items() if k.startswith(f"{prefix}.")}
        return Sample(self.call | inner, self._tensors, self._weights)

    def get(self, value: Any) -> Any:
        if isinstance(value, dict) and "slice" in value:
            return self.get(value["slice"])
        if isinstance(value, dict) and "of" in value:
            return self.get(value["of"]).index_select(value["dim"], torch.tensor(value["index"]))
        if isinstance(value, list):
            return [self.get(v) for v in value]
        return resolve(value, self._tensors, self._weights)


def _gemm(be: Backend, s: Sample) -> tuple[Any, Any]:
    method, out = s.call["method"], s["out"]
    if method == "mm":
        return be.mm(s["a"], s["b"], out.dtype), out
    if method == "chain_mm":
        return be.chain_mm(s["a"], s["b"]), out
    if method == "mm_few_k":
        return be.mm_few_k(s["a"], s["b"], out.dtype), out
    if method == "row_mm":
        return be.row_mm(s["a"], s["b"], s["order"], out.dtype), out
    if method == "unit_reduce":
        pieces = [(s.get(p["a"]), s.get(p["b"])) for p in s.call["pieces"]]
        return be.unit_reduce(pieces, s.call["num_units"]), out
    return be.unit_reduce_few_rows(s["a"], s["b"], s.call["num_units"]), out


def _attention(be: Backend, s: Sample) -> tuple[Any, Any]:
    method = s.call["method"]
    if method == "attention_fwd":
        o = s["o"]
        got = be.attention_fwd(s["q"], s["k"], s["v"], s.call["scale"], o.dtype)
        return (got[0], got[1], list(got[2])), (o, s["o_ref"], s["stats"])
    if method == "attention_delta":
        return be.attention_delta(s["do"], s["o_ref"]), s["out"]
    if method == "attention_bwd":  # the fused call: its dq sample and its dk, dv sample
        (dq, want_dq), (dkv, want_dkv) = (_bwd(be, s.part(p), p) for p in ("dq", "kv"))
        return (dq, *dkv), (want_dq, *want_dkv)
    return _bwd(be, s, "dq" if method == "attention_bwd_q" else "kv")


def _bwd(be: Backend, s: Sample, part: str) -> tuple[Any, Any]:
    """attention_bwd_q's ("dq") or attention_bwd_kv's ("kv") sample recomputed."""
    args = (s["q"], s["do"], s["stats"], s["delta"], s["k"], s["v"], s.call["scale"])
    if part == "dq":
        return be.attention_bwd_q(*args), s["out"]
    return be.attention_bwd_kv(*args), tuple(s["out"])


def _rowwise(be: Backend, s: Sample) -> tuple[Any, Any] | None:
    """Row-local and elementwise ops on their sampled rows (and columns); None when an argument was
    too big to keep (recorded by its shape only)."""
    if _shape_only(s.call["args"]) or _shape_only(s.call["kwargs"]):
        return None
    return getattr(be, s.call["method"])(*s["args"], **s["kwargs"]), s["out"]


def _shape_only(encoded: Any) -> bool:
    """Whether an encoded value holds a tensor kept by its shape only."""
    if isinstance(encoded, dict):
        return encoded.keys() == {"shape", "dtype"} or any(_shape_only(v) for v in encoded.values())
    return isinstance(encoded, list) and any(_shape_only(v) for v in encoded)


def _chains(be: Backend, s: Sample) -> tuple[Any, Any]:
    """Each sampled column set through row_sum or segment_sum (chain_sums gives their bits), by the
    shape of its sum: [cols] for a row sum, [G, cols] for a segment sum."""
    ints, outs = s["ints"], s["out"]
    order, segment = ints[-1], ints[0] if len(ints) > 1 else None
    got = []
    for x, out in zip((s.get(x["x"]) for x in s.call["x"]), outs, strict=True):
        if out.dim() == 1:
            got.append(be.row_sum(x, order))
        else:
            got.append(be.segment_sum(x, segment, out.shape[0], order))
    return got, outs


FAMILIES = {
    **dict.fromkeys(("mm", "chain_mm", "mm_few_k", "row_mm", "unit_reduce", "unit_reduce_few_rows"), _gemm),
    **dict.fromkeys(
        ("attention_fwd", "attention_delta", "attention_bwd_q", "attention_bwd_kv", "attention_bwd"), _attention
    ),
    **dict.fromkeys(("row_sum", "segment_sum", "chain_sums"), _chains),
}


def _elements(x: Any) -> int:
    if isinstance(x, Tensor):
        return x.numel()
    return sum(_elements(v) for v in x) if isinstance(x, (list, tuple)) else 0


def _mismatching(got: Any, want: Any) -> int:
    if isinstance(want, Tensor):
        if not isinstance(got, Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            return want.numel()
        return int(
            (got.contiguous().view(torch.uint8) != want.contiguous().view(torch.uint8))
            .view(*want.shape, want.element_size())
            .any(-1)
            .sum()
        )
    return sum(_mismatching(g, w) for g, w in zip(got, want, strict=True))


def check_call(be: Backend, s: Sample) -> dict[str, Any]:
    """One call: {"elements", "mismatching"}, {"skipped": why} or {"missing_model": message}."""
    method = s.call["method"]
    if method in ("plan_rows", "plan_rows()") or "unsampled" in s.call:
        return {"skipped": "not sampled" if "unsampled" in s.call else "row order (checked by its users)"}
    try:
        pair = FAMILIES.get(method, _rowwise)(be, s)
    except NotImplementedError as e:
        return {"missing_model": str(e)}
    if pair is None:
        return {"skipped": "an argument too big to sample (kept by shape only)"}
    got, want = pair
    bad = _mismatching(got, want)
    return {"elements": _elements(want), "mismatching": bad, "same": bad == 0 and same_bits(got, want)}


def check(probe: Path, backend: Backend) -> dict[str, Any]:
    """Every call of the probe's real capture through `backend` (module docstring); per method the
    elements checked and mismatching, and the totals."""
    from h3lab.run import golden

    part = json.loads((probe / "summary.json").read_text())["parts"]["capture"]["real"]
    tensors: dict[str, Tensor] = {}
    for name in part["files"]:
        tensors |= load_file(str(probe / name))
    weights = golden.REAL.weights("cpu").tensors
    by_method: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    for call in part["calls"]:
        row = check_call(backend, Sample(call, tensors, weights))
        entry = by_method.setdefault(call["method"], {"calls": 0, "elements": 0, "mismatching": 0})
        entry["calls"] += 1
        entry["elements"] += row.get("elements", 0)
        entry["mismatching"] += row.get("mismatching", 0)
        for key in ("skipped", "missing_model"):
            if key in row:
                entry[key] = row[key]
    checked = {m: e for m, e in by_method.items() if e["elements"]}
    return {
        "backend": backend.name,
        "problem": part["problem"],
        "capture_matches_golden": part["golden"]["matches"],
        "elements": sum(e["elements"] for e in checked.values()),
        "mismatching": sum(e["mismatching"] for e in checked.values()),
        "missing_models": sorted({e["missing_model"] for e in by_method.values() if "missing_model" in e}),
        "by_method": by_method,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", type=Path, required=True, help="an sm90_probe output folder with capture_real")
    ap.add_argument("--backend", default="emulate-sm90")
    ap.add_argument("--json", type=Path, help="write the record here")
    a = ap.parse_args(argv)
    record = check(a.probe, get_backend(a.backend, "cpu"))
    if a.json:
        write_json(a.json, record)
    for method, e in record["by_method"].items():
        note = e.get("missing_model") or e.get("skipped") or ""
        counts = f"calls {e['calls']:3d} elements {e['elements']:8d} mismatching {e['mismatching']:6d}"
        print(f"{method:24s} {counts} {note[:60]}")
    missing = record["missing_models"]
    print(f"{record['elements']} elements checked, {record['mismatching']} mismatching; missing models: {missing}")
    return 0 if record["mismatching"] == 0 and record["elements"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
