"""The MMA model against the H200's tensor cores, through the kernels' own tl.dot tiles, bit for bit.

    python -m h3lab.bench.mma_probe --out DIR            (CUDA: run every case, compare in place)
    python -m h3lab.bench.mma_probe --check DIR          (any CPU: the saved outputs against the model)
    python -m h3lab.bench.mma_probe --compile-only       (no GPU: build every probe kernel for sm90)

Each case (h3lab.bench.mma_cases) draws its inputs on the GPU from its seed, runs `probe_dot_kernel`
(the same tl.dot the kernels call, at one of their tiles, warps and operand forms) and compares the
output with the model computed on the GPU too (h3lab.emulate.mma, device-agnostic torch integers;
the IEEE FP32 tiles against h3lab.emulate.fma): mismatches per case, per interpretation of the
accumulator (`interpretations`) and per model variant (`VARIANTS`: the named hypotheses and their
neighbours), so a failing hypothesis is answered on the GPU. Every output is saved (`mma.npz`, bit
patterns, compressed) with the sha256 of its inputs, so a CPU can redraw the inputs, check their
hash, and fit a rule offline (`check`): 87 cases, 1.9 x 10^6 dots (1.37 x 10^6 random bf16 ones),
about 6.4 MiB of compressed outputs.

Dimension legend: T tiles, M rows, N columns, K reduced.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.bench.mma_cases import Case, probe_cases
from h3lab.emulate import floats
from h3lab.emulate.fma import fma_dot
from h3lab.emulate.mma import SM90, MmaModel, dot
from h3lab.io.jsonfile import write_json
from h3lab.metrics import sha256_tensor

FILE = "mma.npz"
SUMMARY = "summary.json"  # h3lab.bench.sm90_probe's record: {"parts": {"mma": probe(...), ...}}
VARIANTS = {  # the current reading and its neighbours: each edge rule flipped, and the other alignments
    "sm90": SM90,
    "overflow_max": MmaModel(overflow="max"),
    "flush_inputs": MmaModel(subnormal_inputs="flush"),
    "flush_output": MmaModel(subnormal_output="flush"),
    "zero_ieee": MmaModel(zero_sign="ieee"),
    "no_align_min": MmaModel(align_min=-1000),
    "extra_bits_1": MmaModel(extra_bits=1),
    "extra_bits_3": MmaModel(extra_bits=3),
    "group_8": MmaModel(group=8),
}
CHUNK_PRODUCTS = 1 << 25  # model products held at once (int32 temporaries: a few GB at most)


@triton.jit
def _load_a(a_base, k0, K, one, BM: tl.constexpr, BK: tl.constexpr, A_REGS: tl.constexpr):
    rm, rk = tl.arange(0, BM), k0 + tl.arange(0, BK)
    a = tl.load(a_base + rm[:, None] * K + rk[None, :], mask=rk[None, :] < K, other=0.0)
    if A_REGS:  # through FP32 registers and back, as attention's p.to(bf16): A from registers
        a = (a.to(tl.float32) * one).to(a_base.dtype.element_ty)
    return a


@triton.jit
def _load_b(b_base, k0, K, BN: tl.constexpr, BK: tl.constexpr, B_TRANS: tl.constexpr):
    rn, rk = tl.arange(0, BN), k0 + tl.arange(0, BK)
    if B_TRANS:  # stored [N, K] (a weight W, keys k) and fed transposed
        b = tl.trans(tl.load(b_base + rn[:, None] * K + rk[None, :], mask=rk[None, :] < K, other=0.0))
    else:
        b = tl.load(b_base + rk[:, None] * BN + rn[None, :], mask=rk[:, None] < K, other=0.0)
    return b


@triton.jit
def _mac(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit(do_not_specialize=["K"])
def probe_dot_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    out_ptr,
    K,
    one,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ACC: tl.constexpr,
    A_REGS: tl.constexpr,
    B_TRANS: tl.constexpr,
    IEEE: tl.constexpr,
):
    # one tile per program: out = a @ b (+ c) over K in BK chunks ascending; ACC 0: the first chunk
    # without accumulator (tl.dot(a, b)), 1: acc = tl.zeros then the chain, 2: acc = c from memory
    t = tl.program_id(0).to(tl.int64)
    a_base, b_base = a_ptr + t * BM * K, b_ptr + t * BN * K
    tile = t * BM * BN + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    start = 0
    if ACC == 2:
        acc = tl.load(c_ptr + tile)
    elif ACC == 1:
        acc = tl.zeros((BM, BN), tl.float32)
    else:
        a = _load_a(a_base, 0, K, one, BM, BK, A_REGS)
        b = _load_b(b_base, 0, K, BN, BK, B_TRANS)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(a, b)
        start = BK
    for k0 in range(start, K, BK):
        acc = _mac(_load_a(a_base, k0, K, one, BM, BK, A_REGS), _load_b(b_base, k0, K, BN, BK, B_TRANS), acc, IEEE)
    tl.store(out_ptr + tile, acc)


ACC_CODE = {"none": 0, "zeros": 1, "load": 2}


def gpu_executor(case: Case, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """Run `probe_dot_kernel` for the case on the inputs' CUDA device: FP32 [T, M, N]."""
    t = case.tile
    b_stored = b.transpose(1, 2).contiguous() if t.b_trans else b.contiguous()
    out = torch.empty_like(c)
    probe_dot_kernel[(case.tiles,)](
        a.contiguous(),
        b_stored,
        c.contiguous(),
        out,
        case.K,
        1.0,
        BM=t.BM,
        BN=t.BN,
        BK=t.BK,
        ACC=ACC_CODE[case.acc],
        A_REGS=t.a_regs,
        B_TRANS=t.b_trans,
        IEEE=case.dtype == "fp32",
        num_warps=t.warps,
    )
    return out


def interpretations(case: Case, c: Tensor) -> dict[str, Tensor | None]:
    """The accumulator each reading of the case's mode starts from. "zeros" is read both ways: as an
    explicit +0 (what Triton 3.6 compiles for the probe: scale-d 1, `compile_only`) and as no
    accumulator (scale-d 0, which Triton may choose for a zero init)."""
    if case.acc == "none":
        return {"no_acc": None}
    if case.acc == "load":
        return {"c": c}
    return {"plus_zero": torch.zeros_like(c), "no_acc": None}


def expected(case: Case, a: Tensor, b: Tensor, c0: Tensor | None, model: MmaModel = SM90) -> Tensor:
    """The model's FP32 [T, M, N] for the case from accumulator c0 (None: no accumulator), in chunks of
    tiles so that at most CHUNK_PRODUCTS products are live."""
    per_tile = case.tile.BM * case.tile.BN * (model.group if case.dtype != "fp32" else 1)
    step = max(1, CHUNK_PRODUCTS // per_tile)
    outs = []
    for t0 in range(0, case.tiles, step):
        part = slice(t0, t0 + step)
        cp = c0[part] if c0 is not None else None
        if case.dtype == "fp32":
            outs.append(fma_dot(a[part], b[part], cp))
        else:
            outs.append(dot(a[part], b[part], cp, model=model, block_k=case.tile.BK))
    return torch.cat(outs)


def _examples(got: Tensor, want: Tensor, limit: int = 8) -> list[dict[str, Any]]:
    bad = (floats.bits(got) != floats.bits(want)).nonzero()[:limit].tolist()
    return [
        {"at": idx, "gpu": hex(int(floats.bits(got[tuple(idx)]))), "model": hex(int(floats.bits(want[tuple(idx)])))}
        for idx in bad
    ]


def compare(case: Case, a: Tensor, b: Tensor, c: Tensor, got: Tensor, variants: dict[str, MmaModel]) -> dict:
    """Mismatching elements per interpretation of the accumulator (the current model) and per variant
    (first interpretation), with a few examples of the first interpretation's mismatches."""
    record: dict[str, Any] = {"mismatches": {}, "variants": {}}
    gbits = floats.bits(got)
    for i, (name, c0) in enumerate(interpretations(case, c).items()):
        want = expected(case, a, b, c0)
        record["mismatches"][name] = int((gbits != floats.bits(want)).sum())
        if i == 0:
            record["examples"] = _examples(got, want)
            record["nan_both"] = int((torch.isnan(got) & torch.isnan(want)).sum())
    if case.dtype != "fp32":
        c0 = next(iter(interpretations(case, c).values()))
        for name, model in variants.items():
            record["variants"][name] = int((gbits != floats.bits(expected(case, a, b, c0, model))).sum())
    return record


Executor = Callable[[Case, Tensor, Tensor, Tensor], Tensor]


def run(cases: list[Case], executor: Executor, device: torch.device | str, variants=VARIANTS) -> tuple[list, dict]:
    """(one record per case, {case name: uint32 output bits [T, M, N]}) for `executor` on `device`."""
    records, outputs = [], {}
    for case in cases:
        t0 = time.perf_counter()
        try:
            a, b, c = case.inputs(device)
            got = executor(case, a, b, c)
            record = case.to_dict() | {"dots": case.dots, "sha256_inputs": _inputs_hash(a, b, c)}
            record |= {"sha256_out": sha256_tensor(got)} | compare(case, a, b, c, got, variants)
            outputs[case.name] = floats.bits(got).cpu().numpy().astype(np.uint32)
        except Exception as e:  # one case's failure (a tile that does not build, say) costs only that case
            record = case.to_dict() | {"error": f"{type(e).__name__}: {e}"[:2000]}
        records.append(record | {"seconds": round(time.perf_counter() - t0, 3)})
    return records, outputs


def _inputs_hash(a: Tensor, b: Tensor, c: Tensor) -> str:
    return sha256_tensor(torch.cat([floats.bits(a).flatten(), floats.bits(b).flatten(), floats.bits(c).flatten()]))


def summarize(records: list[dict]) -> dict[str, Any]:
    """Totals: dots and mismatches of the current model (first interpretation), per recipe and variant."""
    by_recipe: dict[str, dict[str, int]] = {}
    failed = [r["name"] for r in records if "error" in r]
    records = [r for r in records if "error" not in r]
    for r in records:
        entry = by_recipe.setdefault(r["recipe"] + ("" if r["dtype"] == "bf16" else f".{r['dtype']}"), {})
        entry["dots"] = entry.get("dots", 0) + r["dots"]
        entry["mismatches"] = entry.get("mismatches", 0) + next(iter(r["mismatches"].values()))
        for name, n in r["variants"].items():
            entry[f"variant.{name}"] = entry.get(f"variant.{name}", 0) + n
    dots = sum(r["dots"] for r in records)
    bad = sum(next(iter(r["mismatches"].values())) for r in records)
    return {"cases": len(records), "failed": failed, "dots": dots, "mismatches": bad, "by_recipe": by_recipe}


def save(out_dir: Path, outputs: dict[str, np.ndarray]) -> Path:
    path = out_dir / FILE
    np.savez_compressed(path, **outputs)
    return path


def check(out_dir: Path, names: list[str] | None = None, model: MmaModel = SM90) -> dict[str, Any]:
    """Offline, on any CPU: redraw each saved case's inputs (their sha256 must match the GPU's), run the
    model, and count the elements whose bits differ from the saved outputs."""
    part = json.loads((out_dir / SUMMARY).read_text())["parts"]["mma"]
    saved = np.load(out_dir / FILE)
    rows = []
    for r in part["records"]:
        if (names is not None and r["name"] not in names) or "error" in r:
            continue
        case = Case.from_dict(r)
        a, b, c = case.inputs("cpu")
        same_inputs = _inputs_hash(a, b, c) == r["sha256_inputs"]
        got = floats.fp32_from_bits(torch.from_numpy(saved[case.name].astype(np.int64)))
        c0 = next(iter(interpretations(case, c).values()))
        want = expected(case, a, b, c0, model)
        bad = int((floats.bits(got) != floats.bits(want)).sum())
        rows.append({"name": case.name, "same_inputs": same_inputs, "dots": case.dots, "mismatches": bad})
    return {"cases": len(rows), "inputs_reproduced": all(r["same_inputs"] for r in rows), "rows": rows}


def probe(
    out_dir: Path, device: torch.device | str = "cuda", executor: Executor = gpu_executor, seed_base: int = 1000
) -> dict[str, Any]:
    """Run every case (drawn from `seed_base`) on `device`, save the outputs under out_dir; the part's
    record for summary.json."""
    t0 = time.perf_counter()
    records, outputs = run(probe_cases(seed_base=seed_base), executor, device)
    path = save(out_dir, outputs)
    seconds = round(time.perf_counter() - t0, 1)
    return {
        "summary": summarize(records),
        "files": {path.name: path.stat().st_size},
        "seconds": seconds,
        "records": records,
    }


def compile_only(node_capability: int = 90, tiles: set[str] | None = None) -> list[dict[str, Any]]:
    """Build every probe kernel variant the cases launch (of the named tiles only, if given) for sm90
    without a GPU (the installed Triton), with its flagged PTX and MMA operand forms (ptx_audit)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h3lab.bench.ptx_audit import audit_ptx

    seen, out = set(), []
    for case in probe_cases():
        t = case.tile
        if tiles is not None and t.name not in tiles:
            continue
        key = (t.BM, t.BN, t.BK, t.warps, t.a_regs, t.b_trans, case.acc, case.dtype)
        if key in seen:
            continue
        seen.add(key)
        ptr = f"*{case.dtype}"
        sig = {"a_ptr": ptr, "b_ptr": ptr, "c_ptr": "*fp32", "out_ptr": "*fp32", "K": "i32", "one": "fp32"}
        const = {"BM": t.BM, "BN": t.BN, "BK": t.BK, "ACC": ACC_CODE[case.acc], "A_REGS": t.a_regs}
        const |= {"B_TRANS": t.b_trans, "IEEE": case.dtype == "fp32"}
        sig |= {k: "constexpr" for k in const}
        src = ASTSource(probe_dot_kernel, sig, constexprs=const)
        k = triton.compile(src, target=GPUTarget("cuda", node_capability, 32), options={"num_warps": t.warps})
        audit = audit_ptx(k.asm["ptx"])
        record = {"kernel": "probe_dot_kernel", "tile": t.name, "dtype": case.dtype, "acc": case.acc}
        record["shared_bytes"] = k.metadata.shared  # at most 232448 (227 KiB) on sm90
        out.append(
            record | {"flagged": sorted(audit["flagged"]), "mma": audit["mma_operands"], "triton": triton.__version__}
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="run on the GPU; write summary.json and mma.npz here")
    ap.add_argument("--check", type=Path, help="check a folder's saved outputs against the model on this CPU")
    ap.add_argument("--cases", help="comma-separated case names for --check (default: all)")
    ap.add_argument("--compile-only", action="store_true", help="build every probe kernel for sm90, print JSON")
    args = ap.parse_args(argv)
    if args.compile_only:
        print(json.dumps(compile_only(), indent=1))
    elif args.check:
        print(json.dumps(check(args.check, args.cases.split(",") if args.cases else None), indent=1))
    elif args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / SUMMARY, {"parts": {"mma": probe(args.out)}})
    else:
        ap.error("give --out, --check or --compile-only")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
