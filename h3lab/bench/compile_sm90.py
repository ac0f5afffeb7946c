"""Compile the Gluon unit-tree GEMM for sm90 without a GPU: registers, stack (spills), shared memory.

    python -m h3lab.bench.compile_sm90 [--ptx DIR] [--json]

For each variant the launcher can pick (pieces 1-3, b as W.T or [K, N] rows, 4 stages with level 2
in L2 or 3 with it in shared memory) it builds the kernel with the installed Triton for
GPUTarget("cuda", 90, 32), reads the resource use from the cubin (cuobjdump -res-usage, bundled with
Triton's NVIDIA backend) and counts the wgmma waits and CTA barriers in the PTX. This is how the
kernel was tuned between GPU sessions (a register or shared-memory budget is checked in seconds on
a laptop), and what the CPU test runs so that a Triton upgrade that breaks the Gluon code (names
changed between 3.6 and 3.9) fails in CI, not on a GPU node. Run it without TRITON_INTERPRET=1:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ptx", type=Path, help="write each variant's PTX here")
    ap.add_argument("--json", action="store_true", help="print one JSON list (no PTX) instead of the table")
    args = ap.parse_args(argv)
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
