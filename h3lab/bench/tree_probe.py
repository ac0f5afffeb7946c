"""tl.sum's reduction order in the attention kernels' own layouts, read off the GPU.

Two sums in the kernels add a row's elements in an order that only the tile's layout fixes:
- attention_fwd's `tl.sum(p, 1)` over the [BLOCK_M, BLOCK_N] tile of a wgmma result (the softmax
  denominator). `sum_kernel` reproduces that layout: the tile as tl.dot(x, I^T) with I the identity
  (one product per element, so exact) at the kernel's BLOCK_M, BLOCK_N, head dim and warps, then
  the same tl.sum (Triton lowers the reduction from the layout alone).
- attention_delta's `tl.sum(dO * O, axis=1)` over a [BLOCK_R, Dh] tile of loads: probed through the
  kernel itself (h3lab.triton.attention.attention_delta) with dO = 1, so every product is O exactly.
  Its FMA contractions (h3lab.bench.ptx_audit: products fused into the sum's adds) cannot show with
  dO = 1: rows with random dO are saved for that fit, not checked here.
Each probe sums the FPRev rows of h3lab.emulate.tree (the tree comes back from the sums), then
checks the tree on rows of random values in place (tree_sum on the GPU, IEEE adds). Outputs are
saved (`tree.npz`); random inputs are redrawn from their seeds (probe_rng).

Dimension legend: R rows, N the reduced axis (BLOCK_N or head_dim).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.bench.mma_cases import values
from h3lab.bench.probe_rng import Stream
from h3lab.emulate import floats
from h3lab.emulate import tree as trees
from h3lab.triton import configs

FILE = "tree.npz"
RANDOM_ROWS = 4096


@triton.jit
def sum_kernel(x_ptr, eye_ptr, out_ptr, BM: tl.constexpr, BN: tl.constexpr, DH: tl.constexpr):
    # rows [pid * BM, +BM) of x [R, DH] (bf16): s = tl.sum(x @ eye^T, 1), eye [BN, DH] the identity
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    d = tl.arange(0, DH)
    x = tl.load(x_ptr + rows[:, None] * DH + d[None, :])
    eye = tl.load(eye_ptr + tl.arange(0, BN)[:, None] * DH + d[None, :])
    qk = tl.dot(x, tl.trans(eye))
    tl.store(out_ptr + rows, tl.sum(qk, 1))


def fwd_sum_gpu(x_RN: Tensor, head_dim: int) -> Tensor:
    """FP32 [R]: attention_fwd's tl.sum over the rows of x (bf16, R a multiple of BLOCK_M, N = BLOCK_N)."""
    cfg = configs.pinned("attention_fwd", "sm90")["by_head_dim"][str(head_dim)]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    eye = torch.eye(bn, head_dim, dtype=torch.bfloat16, device=x_RN.device)
    x = torch.nn.functional.pad(x_RN, (0, head_dim - bn)).contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    sum_kernel[(x.shape[0] // bm,)](x, eye, out, BM=bm, BN=bn, DH=head_dim, num_warps=cfg["num_warps"])
    return out


def delta_sum_gpu(do_RN: Tensor, o_RN: Tensor) -> Tensor:
    """FP32 [R]: attention_delta (the kernel, pinned config) of one head, rows as queries."""
    from h3lab.triton.attention import attention_delta

    return attention_delta(do_RN.unsqueeze(1).contiguous(), o_RN.unsqueeze(1).contiguous())[0]


Summer = Callable[[str, int, Tensor, Tensor], Tensor]  # (probe, n, dO or None, x) -> row sums


def gpu_summer(probe: str, head_dim: int, do: Tensor | None, x: Tensor) -> Tensor:
    if probe == "fwd":
        return fwd_sum_gpu(x.to(torch.bfloat16), head_dim)
    return delta_sum_gpu(do if do is not None else torch.ones_like(x, dtype=torch.bfloat16), x)


def probes(node: str = "sm90") -> list[tuple[str, int, int]]:
    """(probe, head_dim, n reduced, rows per program) for each pinned head dim."""
    out = []
    for dh in (32, 128):
        f = configs.pinned("attention_fwd", node)["by_head_dim"][str(dh)]
        out.append(("fwd", dh, f["BLOCK_N"], f["BLOCK_M"]))
        out.append(("delta", dh, dh, configs.pinned("attention_delta", node)["by_head_dim"][str(dh)]["BLOCK_R"]))
    return out


def _padded(x: Tensor, multiple: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, -x.shape[0] % multiple))


def run_probe(probe: str, dh: int, n: int, rows: int, summer: Summer, device, seed: int) -> tuple[dict, dict]:
    """One probe: its tree from the FPRev rows, and that tree checked on random rows (module docstring)."""
    x, pairs = trees.probe_rows(n)
    sums = summer(probe, dh, None, _padded(x, rows).to(device))[: len(pairs)].cpu()
    record: dict[str, Any] = {"probe": probe, "head_dim": dh, "n": n, "rows_per_program": rows, "seed": seed}
    try:
        tree = trees.tree_from_lca_sizes(trees.lca_sizes(sums, pairs, n))
        record["tree"] = trees.canonical(tree)
    except ValueError as e:  # no tree fits: the raw sums are saved for whoever looks next
        tree, record["tree_error"] = None, str(e)
    s = Stream(seed, device)
    dtype = torch.bfloat16 if probe == "fwd" else torch.float32
    xr = values(s, (RANDOM_ROWS, n), -12, 12, dtype)
    got = summer(probe, dh, None, xr)
    data = {f"{probe}{dh}.fprev": floats.bits(sums).numpy().astype(np.uint32)}
    data[f"{probe}{dh}.random"] = floats.bits(got).cpu().numpy().astype(np.uint32)
    if tree is not None:
        record["random_mismatches"] = int((floats.bits(got) != floats.bits(trees.tree_sum(xr, tree))).sum())
    if probe == "delta":  # products that round: the contraction's data (saved, not checked)
        do = values(s, (RANDOM_ROWS, n), -3, 3, torch.bfloat16)
        data[f"{probe}{dh}.random_do"] = floats.bits(summer(probe, dh, do, xr)).cpu().numpy().astype(np.uint32)
    return record, data


def probe(out_dir: Path, device: torch.device | str = "cuda", summer: Summer = gpu_summer) -> dict[str, Any]:
    """Every probe of `probes`; saves tree.npz under out_dir and returns the part's record."""
    records, data = [], {}
    for i, (name, dh, n, rows) in enumerate(probes()):
        record, arrays = run_probe(name, dh, n, rows, summer, device, seed=7000 + i)
        records.append(record)
        data |= arrays
    path = out_dir / FILE
    np.savez_compressed(path, **data)
    return {"records": records, "files": {path.name: path.stat().st_size}}


def check(out_dir: Path) -> dict[str, Any]:
    """Offline, on any CPU: each saved probe's tree read again from its FPRev sums, and its random rows
    (redrawn from the seed) summed by that tree against the saved GPU sums."""
    import json

    part = json.loads((out_dir / "summary.json").read_text())["parts"]["tree"]
    saved = np.load(out_dir / FILE)
    rows = []
    for r in part["records"]:
        key = f"{r['probe']}{r['head_dim']}"
        _, pairs = trees.probe_rows(r["n"])
        sums = floats.fp32_from_bits(torch.from_numpy(saved[f"{key}.fprev"].astype(np.int64)))
        tree = trees.tree_from_lca_sizes(trees.lca_sizes(sums, pairs, r["n"]))
        xr = values(
            Stream(r["seed"]), (RANDOM_ROWS, r["n"]), -12, 12, torch.bfloat16 if r["probe"] == "fwd" else torch.float32
        )
        got = torch.from_numpy(saved[f"{key}.random"].astype(np.int64))
        bad = int((floats.bits(trees.tree_sum(xr, tree)) != got).sum())
        rows.append(
            {"probe": key, "same_tree": trees.canonical(tree) == _as_tree(r.get("tree")), "random_mismatches": bad}
        )
    return {"probes": len(rows), "rows": rows}


def _as_tree(t: Any) -> Any:
    """A tree back from JSON (lists) as tuples."""
    return t if t is None or isinstance(t, int) else (_as_tree(t[0]), _as_tree(t[1]))


def compile_only(capability: int = 90) -> list[dict[str, Any]]:
    """`sum_kernel` at each pinned head dim built for sm90 without a GPU, with its MMA operand forms."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h3lab.bench.ptx_audit import audit_ptx

    out = []
    for name, dh, n, rows in probes():
        if name != "fwd":
            continue
        w = configs.pinned("attention_fwd", "sm90")["by_head_dim"][str(dh)]["num_warps"]
        sig = {"x_ptr": "*bf16", "eye_ptr": "*bf16", "out_ptr": "*fp32", "BM": "constexpr", "BN": "constexpr"}
        src = ASTSource(sum_kernel, sig | {"DH": "constexpr"}, constexprs={"BM": rows, "BN": n, "DH": dh})
        k = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": w})
        audit = audit_ptx(k.asm["ptx"])
        out.append(
            {"kernel": "sum_kernel", "head_dim": dh, "flagged": sorted(audit["flagged"]), "mma": audit["mma_operands"]}
        )
    return out
