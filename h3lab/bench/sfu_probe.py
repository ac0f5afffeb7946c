"""What the special-function unit returns for the attention kernels' approximate instructions.

The PTX audit (h3lab.bench.ptx_audit, Triton 3.6) finds three such instructions in the sm90 kernels:
`ex2.approx.ftz.f32` (tl.math.exp2: every softmax probability and rescale; one MUFU.EX2 in SASS),
`div.full.f32` (attention_fwd's o = acc / l: MUFU.RCP and multiplies with range scaling in SASS),
and tl.math.log2, which is not an approximate instruction but libdevice's __nv_log2f (a specified
FMA polynomial with FTZ; emulable from its PTX, sampled here to check that emulation). `sfu_kernel`
runs each through the same Triton operation the kernels use (fusion on, as they launch); the raw
MUFU.RCP through `rcp.approx.ftz.f32`, the instruction div.full's sequence uses.

Saved (`sfu.npz`, the ex2 grids in `sfu_grid.npz`; residuals in ULPs against the deterministic
references of h3lab.emulate.sfu_ref, packed to 4 bits where they fit, with the raw outputs' sha256):
- ex2 on every x = k / 2^24 in [0, 1) and in (-1, 0] (2^24 each), on every FP32 in the flush and
  overflow edges, and on random samples (all bit patterns; the attention range [-40, 0]);
- rcp on every significand in [1, 2) (2^23) and random samples; div on random pairs (all patterns;
  the attention's |acc| < 2^10 over l in [1, 2^17)); log2 on random samples.
Random inputs are redrawn from their seeds (probe_rng). `probe` also runs, in place over all 2^32
inputs, the hypotheses of h3lab.bench.sfu_sweeps; its `model_check` (sm90_probe's part `sfu_model`)
compares the exact models fitted from these answers with the unit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.bench.probe_rng import Stream
from h3lab.bench.sfu_sweeps import CHUNK, Op, hypotheses, reference
from h3lab.emulate import floats
from h3lab.emulate.sfu_ref import exp2_ref, from_ordered, ordered
from h3lab.metrics import sha256_tensor

FILE, GRID_FILE = "sfu.npz", "sfu_grid.npz"
FILE_BYTES = 15 << 20  # under the 16 MiB a returned file may hold
OPS = {"ex2": 0, "rcp": 1, "div": 2, "log2": 3}
SAMPLES = 1 << 20


@triton.jit
def sfu_kernel(x_ptr, y_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=1.0)
    if OP == 0:
        out = tl.math.exp2(x)
    elif OP == 1:
        out = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    elif OP == 2:
        out = x / tl.load(y_ptr + i, mask=mask, other=1.0)
    else:
        out = tl.math.log2(x)
    tl.store(out_ptr + i, out, mask=mask)


def gpu_op(op: str, x: Tensor, y: Tensor | None = None) -> Tensor:
    """FP32 op(x) (or x / y) elementwise on the inputs' CUDA device, through `sfu_kernel`."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        yy = y.contiguous() if y is not None else x
        sfu_kernel[(triton.cdiv(x.numel(), 4096),)](x, yy, out, x.numel(), OP=OPS[op], BLOCK=4096, num_warps=4)
    return out


def grid(sign: float, device, bits: int = 24) -> Tensor:
    """FP32 [2^bits]: sign * k / 2^bits for k = 0 .. 2^bits - 1 (every value exact)."""
    return sign * torch.arange(1 << bits, device=device, dtype=torch.float32) * 2.0**-bits


def every_float(lo: float, hi: float, device) -> Tensor:
    """Every FP32 value in [lo, hi] (lo < hi of one sign or zero), ascending."""
    if lo >= 0:
        b0, b1 = floats.bits(torch.tensor([lo, hi])).tolist()
        return floats.fp32_from_bits(torch.arange(b0, b1 + 1, device=device))
    return -every_float(-hi, -lo, device).flip(0)


def sample_sets(device, grid_bits: int = 24, samples: int = SAMPLES) -> dict[str, tuple[str, Tensor, Tensor | None]]:
    """{set name: (op, x, y)}: every input the probe saves outputs for (module docstring); smaller
    grid_bits and samples only for tests of the data flow."""
    s = Stream(9000, device)
    patterns = floats.fp32_from_bits(s.bits((samples,)))
    unit = s.bits((samples,)).to(torch.float32) * 2.0**-32  # [0, 1]
    mantissas = 1.0 + grid(1.0, device, grid_bits - 1)
    acc = (s.bits((samples,)).to(torch.float32) * 2.0**-31 - 1.0) * 1024.0
    ell = exp2_ref(s.bits((samples,)).to(torch.float32) * (17.0 * 2.0**-32))  # [1, 2^17]: a row's l
    edges = torch.cat([every_float(-127.0, -125.0, device), every_float(127.0, 128.5, device)])
    return {
        "ex2.grid_pos": ("ex2", grid(1.0, device, grid_bits), None),
        "ex2.grid_neg": ("ex2", grid(-1.0, device, grid_bits), None),
        "ex2.edges": ("ex2", edges, None),
        "ex2.random": ("ex2", patterns, None),
        "ex2.attention": ("ex2", -40.0 * unit, None),
        "rcp.mantissas": ("rcp", mantissas, None),
        "rcp.random": ("rcp", patterns, None),
        "div.random": ("div", patterns, floats.fp32_from_bits(s.bits((samples,)))),
        "div.attention": ("div", acc, ell),
        "log2.random": ("log2", patterns.abs(), None),
        "log2.attention": ("log2", ell, None),
    }


def encode(got: Tensor, ref: Tensor) -> tuple[dict[str, np.ndarray], str]:
    """Residuals ordered(got) - ordered(ref) in the narrowest form that leaves at most 1 in 64 of them
    as exceptions (kept as index and raw bits): 4-bit nibbles for [-8, 7] (two per byte), int8, else
    int64. Returns ({"r": residuals, "ex_idx", "ex_bits"}, form)."""
    r = (ordered(got) - ordered(ref)).cpu()
    for form, lo, hi in (("nibble", -8, 7), ("int8", -128, 127)):
        outside = (r < lo) | (r > hi)
        if int(outside.sum()) * 64 <= r.numel():
            idx = outside.nonzero().flatten()
            kept = torch.where(outside, 0, r)
            ex = {"ex_idx": idx.numpy().astype(np.int64), "ex_bits": floats.bits(got.cpu()[idx]).numpy()}
            return {"r": _pack(kept, form)} | ex, form
    return {"r": r.numpy(), "ex_idx": np.zeros(0, np.int64), "ex_bits": np.zeros(0, np.int64)}, "int64"


def _pack(r: Tensor, form: str) -> np.ndarray:
    if form == "int8":
        return r.numpy().astype(np.int8)
    nib = (r + 8).to(torch.uint8)
    nib = torch.cat([nib, torch.zeros(nib.numel() % 2, dtype=torch.uint8)])
    return (nib[0::2] | (nib[1::2] << 4)).numpy()


def decode(arrays: dict[str, np.ndarray], form: str, ref: Tensor) -> Tensor:
    """The outputs back from `encode`'s arrays and the reference values (inverse of encode)."""
    r = torch.from_numpy(arrays["r"].astype(np.int64) if form != "nibble" else arrays["r"])
    if form == "nibble":
        r = torch.stack([r & 0xF, r >> 4], 1).flatten()[: ref.numel()].to(torch.int64) - 8
    out = floats.bits(from_ordered(ordered(ref.cpu()) + r))
    out[torch.from_numpy(arrays["ex_idx"])] = torch.from_numpy(arrays["ex_bits"].astype(np.int64))
    return floats.fp32_from_bits(out)


def run_sets(op: Op, sets: dict[str, tuple[str, Tensor, Tensor | None]]) -> tuple[dict, dict, dict]:
    """({set: record}, {array name: array}, {set: outputs}) of every set through `op`."""
    records, arrays, outs = {}, {}, {}
    for name, (fn, x, y) in sets.items():
        got, ref = op(fn, x, y), reference(fn, x, y)
        packed, form = encode(got, ref)
        arrays |= {f"{name}.{k}": v for k, v in packed.items()}
        finite = torch.isfinite(got) & torch.isfinite(ref)
        worst = int((ordered(got) - ordered(ref))[finite].abs().max()) if bool(finite.any()) else None
        records[name] = {"op": fn, "n": x.numel(), "form": form, "exceptions": int(packed["ex_idx"].size)}
        records[name] |= {"sha256_out": sha256_tensor(got), "max_ulps_finite": worst}
        outs[name] = got
    return records, arrays, outs


def probe(
    out_dir: Path,
    device: torch.device | str = "cuda",
    op: Op = gpu_op,
    *,
    grid_bits: int = 24,
    samples: int = SAMPLES,
    span=(0, 1 << 32),
    pairs: int = CHUNK,
) -> dict[str, Any]:
    """Every sample set and every hypothesis on `device`; saves sfu.npz; the part's record. Smaller
    grid_bits (tests of the data flow) leave out the hypotheses, whose tables need the full grids."""
    records, arrays, outs = run_sets(op, sample_sets(device, grid_bits, samples))
    hyp, error = {}, None
    if grid_bits == 24:
        tables = {"ex2": outs["ex2.grid_pos"], "rcp": outs["rcp.mantissas"]}
        try:
            hyp = hypotheses(op, tables, device, span, pairs)
        except Exception as e:  # the saved sets still come back
            error = f"{type(e).__name__}: {e}"[:2000]
    arrays |= {f"hyp.{k}": v for k, v in hyp.items()}
    files = save(out_dir, arrays)
    totals = {k: int(v.sum()) for k, v in hyp.items() if not k.endswith("histogram")}
    record = {"sets": records, "hypotheses": totals, "hypotheses_error": error, "span": list(span), "pairs": pairs}
    record |= {"samples": samples, "grid_bits": grid_bits}
    return record | {"files": files}


def save(out_dir: Path, arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """The ex2 grids into sfu_grid.npz (or one file per grid where together they pass FILE_BYTES: a
    file the device returns holds 16 MiB), everything else into sfu.npz; {file: bytes}."""
    grids = {k: v for k, v in arrays.items() if k.startswith("ex2.grid_")}
    np.savez_compressed(out_dir / FILE, **{k: v for k, v in arrays.items() if k not in grids})
    names = [GRID_FILE]
    np.savez_compressed(out_dir / GRID_FILE, **grids)
    if (out_dir / GRID_FILE).stat().st_size > FILE_BYTES:
        (out_dir / GRID_FILE).unlink()
        names = []
        for sign in ("pos", "neg"):
            names.append(f"sfu_grid_{sign}.npz")
            np.savez_compressed(out_dir / names[-1], **{k: v for k, v in grids.items() if f"grid_{sign}." in k})
    return {name: (out_dir / name).stat().st_size for name in [FILE, *names]}


def load(out_dir: Path) -> dict[str, np.ndarray]:
    """Every array `save` wrote under out_dir."""
    out: dict[str, np.ndarray] = {}
    for name in (FILE, GRID_FILE, "sfu_grid_pos.npz", "sfu_grid_neg.npz"):
        if (out_dir / name).is_file():
            with np.load(out_dir / name) as f:
                out |= {k: f[k] for k in f.files}
    return out


def check(out_dir: Path) -> dict[str, Any]:
    """Offline, on any CPU: rebuild every saved set's outputs from its residuals and the references
    (inputs redrawn here), and compare their sha256 with the GPU's."""
    import json

    part = json.loads((out_dir / "summary.json").read_text())["parts"]["sfu"]
    saved = load(out_dir)
    rows = {}
    for name, (fn, x, y) in sample_sets("cpu", part["grid_bits"], part["samples"]).items():
        rec = part["sets"][name]
        arrays = {k: saved[f"{name}.{k}"] for k in ("r", "ex_idx", "ex_bits")}
        got = decode(arrays, rec["form"], reference(fn, x, y))
        rows[name] = sha256_tensor(got) == rec["sha256_out"]
    return {"sets": len(rows), "all_rebuilt": all(rows.values()), "rebuilt": rows}


def compile_only(capability: int = 90) -> list[dict[str, Any]]:
    """`sfu_kernel` for each op built for sm90 without a GPU (the installed Triton), with its flagged PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h3lab.bench.ptx_audit import audit_ptx

    out = []
    for name, op in OPS.items():
        sig = {
            "x_ptr": "*fp32",
            "y_ptr": "*fp32",
            "out_ptr": "*fp32",
            "n": "i32",
            "OP": "constexpr",
            "BLOCK": "constexpr",
        }
        src = ASTSource(sfu_kernel, sig, constexprs={"OP": op, "BLOCK": 4096})
        k = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
        out.append({"kernel": "sfu_kernel", "op": name, "flagged": sorted(audit_ptx(k.asm["ptx"])["flagged"])})
    return out
