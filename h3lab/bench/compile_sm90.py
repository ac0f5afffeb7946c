"""Compile the Gluon unit-tree GEMM for sm90 without a GPU: registers, stack (spills), shared memory.

    python -m h3lab.bench.compile_sm90 [--ptx DIR] [--json]
    python -m h3lab.bench.compile_sm90 --attention [--json]   the attention kernels: pinned and candidates

For each variant the launcher can pick (pieces 1-3, b as W.T or [K, N] rows, 4 stages with level 2
in L2 or 3 with it in shared memory) it builds the kernel with the installed Triton for
GPUTarget("cuda", 90, 32), reads the resource use from the cubin (cuobjdump -res-usage, bundled with
Triton's NVIDIA backend) and counts the wgmma waits and CTA barriers in the PTX. A register or
shared-memory budget is checked this way in seconds without a GPU, and it is what the CPU test
runs so that a Triton upgrade that breaks the Gluon code (names changed between 3.6 and 3.9) fails
in CI, not on a GPU node. Run it without TRITON_INTERPRET=1:
under the interpreter @triton.jit helpers the kernel calls are interpreted functions, which Gluon
cannot compile (the CPU test runs it in a subprocess with a clean environment).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SM90_SHARED_BYTES = 232448  # 227 KiB: the most one CTA may allocate on the H100/H200
VARIANTS = (  # (pieces, b_kn, stages, lvl2_smem): the real calls (to_out, ff.net.2 | qkv.dx | ff.net.0.dx)
    (1, False, 4, False),
    (3, True, 4, False),
    (2, True, 4, False),
    (1, False, 3, True),
)


def compile_unit_sm90(
    pieces: int, b_kn: bool, stages: int, lvl2_smem: bool, block: int = 128, num_warps: int = 8
) -> dict[str, Any]:
    """Resources of one unit_mm_sm90_kernel variant, compiled for sm90 with the installed Triton."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from h3lab.triton import unit_gemm_sm90

    if not 1 <= pieces <= 3:
        raise ValueError(f"compile_unit_sm90: pieces={pieces}; allowed: 1, 2, 3")
    a_l, b_l, c_l = unit_gemm_sm90._layouts(block, block, b_kn)
    bk = unit_gemm_sm90.BLOCK_K
    b_block = [bk, block] if b_kn else [block, bk]
    fn = unit_gemm_sm90.unit_mm_sm90_kernel
    sig: dict[str, str] = {name: "i32" for name in fn.arg_names}
    const: dict[str, Any] = {}
    for i in range(3):
        if i < pieces:
            sig[f"ad{i}"] = f"tensordesc<bf16[{block},{bk}],{a_l!r}>"
            sig[f"bd{i}"] = f"tensordesc<bf16[{b_block[0]},{b_block[1]}],{b_l!r}>"
        else:
            sig[f"ad{i}"] = sig[f"bd{i}"] = "constexpr"
            const[f"ad{i}"] = const[f"bd{i}"] = None
    sig["c_desc"] = f"tensordesc<fp32[{block},{block}],{c_l!r}>"
    sig["s_ptr"] = "*fp32"
    const |= {
        "GROUP_M": 8,
        "PIECES": pieces,
        "B_KN": b_kn,
        "STAGES": stages,
        "LVL2_SMEM": lvl2_smem,
        "num_warps": num_warps,
    }
    sig |= {k: "constexpr" for k in const}
    src = GluonASTSource(fn, sig, constexprs=const)
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": 1, "enable_fp_fusion": False},
    )
    ptx: str = kernel.asm["ptx"]
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "unit_mm_sm90.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    assert found, f"cuobjdump -res-usage printed no REG/STACK line: {usage.stdout[:300]}"
    return {
        "pieces": pieces,
        "b_kn": b_kn,
        "stages": stages,
        "lvl2_smem": lvl2_smem,
        "registers": int(found.group(1)),
        "stack_bytes": int(found.group(2)),
        "shared_bytes": kernel.metadata.shared,
        "wgmma_waits": re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx),
        "cta_barriers": len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", ptx)),
        "triton": triton.__version__,
        "ptx": ptx,
    }


def _cubin_usage(kernel: Any) -> tuple[int, int]:
    """(registers, stack bytes) of a compiled kernel, read by the cuobjdump bundled with Triton."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    assert found, f"cuobjdump -res-usage printed no REG/STACK line: {usage.stdout[:300]}"
    return int(found.group(1)), int(found.group(2))


def _attention_arg_type(name: str, cfg: dict[str, Any], head_dim: int) -> str:
    """The launcher's argument types at the real shapes: bf16 q/k/v/dO, FP32 outputs and statistics."""
    if name.endswith("_desc"):
        rows = cfg["BLOCK_M"] if name in ("q_desc", "do_desc") else cfg["BLOCK_N"]
        return f"tensordesc<bf16[{rows}, {head_dim}]>"
    if name in ("oref_ptr", "lse_ptr", "delta_ptr", "dq_ptr", "dk_ptr", "dv_ptr"):
        return "*fp32"
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name in ("qk_scale", "scale") else "i32"


def compile_attention_sm90(kernel: str, cfg: dict[str, Any], head_dim: int = 128) -> dict[str, Any]:
    """Resources of one attention kernel under `cfg` (a kernels/sm90.json entry or a candidate), bf16
    operands, compiled for sm90 with the installed Triton; pointers and strides specialised as
    16-divisible, the row counts not (do_not_specialize), as at the real shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h3lab.triton import attention_bwd, attention_fwd

    fns = {
        "attention_fwd": attention_fwd.attention_fwd_tma_kernel
        if cfg.get("TMA")
        else attention_fwd.attention_fwd_kernel,
        "attention_bwd_q": attention_bwd.attention_bwd_q_tma_kernel
        if cfg.get("TMA")
        else attention_bwd.attention_bwd_q_kernel,
        "attention_bwd_kv": attention_bwd.attention_bwd_kv_tma_kernel
        if cfg.get("TMA")
        else attention_bwd.attention_bwd_kv_kernel,
    }
    if kernel not in fns:
        raise ValueError(f"compile_attention_sm90: kernel {kernel!r}; allowed: {sorted(fns)}")
    fn = fns[kernel]
    const = {"HEAD_DIM": head_dim, "DOT_PREC": "tf32"} | {
        k: v for k, v in cfg.items() if k in fn.arg_names and k not in ("num_warps", "num_stages")
    }
    const |= {"WRITE_REF": True} if kernel == "attention_fwd" else {}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        sig[name] = "constexpr" if name in const else _attention_arg_type(name, cfg, head_dim)
        if sig[name].startswith("*") or name.startswith("stride"):  # 16-divisible, as the runtime finds them
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=const, attrs=attrs)
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    registers, stack = _cubin_usage(compiled)
    ptx: str = compiled.asm["ptx"]
    return {
        "kernel": kernel,
        "config": dict(cfg),
        "registers": registers,
        "stack_bytes": stack,
        "shared_bytes": compiled.metadata.shared,
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "triton": triton.__version__,
    }


def attention_variants() -> list[tuple[str, dict[str, Any]]]:
    """(kernel, config) of every pinned Dh=128 attention config and every candidate of the long-sequence
    benchmark (h3lab.bench.attention_long.VARIANTS), each once."""
    from h3lab.bench.attention_long import VARIANTS
    from h3lab.triton.attention import config_for

    out = [(k, config_for(k, 128, "sm90")) for k in ("attention_fwd", "attention_bwd_q", "attention_bwd_kv")]
    for fwd in VARIANTS.values():  # the Gluon forwards: h3lab.triton.attention_fwd_sm90.compile_for_sm90
        if fwd is not None and fwd.get("IMPL") != "gluon" and ("attention_fwd", fwd) not in out:
            out.append(("attention_fwd", fwd))
    return out


def _attention_main(as_json: bool) -> int:
    rows = []
    for kernel, cfg in attention_variants():
        r = compile_attention_sm90(kernel, cfg)
        rows.append(r)
        if not as_json:
            print(
                f"{kernel:<20} regs {r['registers']:>3} stack {r['stack_bytes']:>5} shared {r['shared_bytes']:>6} "
                f"wgmma {r['wgmma']:>3} tma {r['tma_loads']:>2}  {cfg}  (Triton {r['triton']})",
                flush=True,
            )
    if as_json:
        print(json.dumps(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ptx", type=Path, help="write each variant's PTX here")
    ap.add_argument("--json", action="store_true", help="print one JSON list (no PTX) instead of the table")
    ap.add_argument("--attention", action="store_true", help="the attention kernels instead of the unit-tree GEMM")
    args = ap.parse_args(argv)
    if args.attention:
        return _attention_main(args.json)
    if args.json:
        print(json.dumps([{k: v for k, v in compile_unit_sm90(*v).items() if k != "ptx"} for v in VARIANTS]))
        return 0
    print(f"{'pieces':>6} {'b':>4} {'stages':>6} {'lvl2':>5} {'regs':>5} {'stack':>6} {'shared':>7} waits")
    for pieces, b_kn, stages, lvl2 in VARIANTS:
        r = compile_unit_sm90(pieces, b_kn, stages, lvl2)
        layout, level2 = ("KN" if b_kn else "W.T"), ("smem" if lvl2 else "L2")
        print(
            f"{pieces:>6} {layout:>4} {stages:>6} {level2:>5} {r['registers']:>5} {r['stack_bytes']:>6} "
            f"{r['shared_bytes']:>7} {','.join(r['wgmma_waits'])}  (Triton {r['triton']})"
        )
        if args.ptx:
            args.ptx.mkdir(parents=True, exist_ok=True)
            (
                args.ptx / f"unit_sm90_p{pieces}_{'kn' if b_kn else 'wt'}_s{stages}{'_smem' if lvl2 else ''}.ptx"
            ).write_text(r["ptx"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
