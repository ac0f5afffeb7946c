"""Compile the Gluon unit-tree GEMM for sm90 without a GPU: registers, stack (spills), shared memory.

    python -m h3lab.bench.compile_sm90 [--ptx DIR] [--json]
    python -m h3lab.bench.compile_sm90 --attention [--json]   the attention kernels: pinned and candidates

For each variant the launcher can pick (pieces 1-3, b as W.T or [K, N] rows, 4 stages with level 2
in L2 or 3 with it in shared memory: h3lab.triton.unit_gemm_sm90.variant, the pinned ones among
them also built by h3lab.bench.compile_pinned --node sm90) it builds the kernel with the installed Triton for
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
from pathlib import Path
from typing import Any

from h3lab.bench.compile_pinned import build, cubin_usage

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

    from h3lab.triton import unit_gemm_sm90

    kernel = build(unit_gemm_sm90.variant(pieces, b_kn, stages, lvl2_smem, block, num_warps), "sm90")
    ptx: str = kernel.asm["ptx"]
    registers, stack = cubin_usage(kernel.asm["cubin"])
    return {
        "pieces": pieces,
        "b_kn": b_kn,
        "stages": stages,
        "lvl2_smem": lvl2_smem,
        "registers": registers,
        "stack_bytes": stack,
        "shared_bytes": kernel.metadata.shared,
        "wgmma_waits": re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx),
        "cta_barriers": len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", ptx)),
        "triton": triton.__version__,
        "ptx": ptx,
    }


def compile_attention_sm90(kernel: str, cfg: dict[str, Any], head_dim: int = 128) -> dict[str, Any]:
    """Resources of one attention kernel under `cfg` (a kernels/sm90.json entry or a candidate), bf16
    operands, compiled for sm90 with the installed Triton; pointers and strides specialised as
    16-divisible, the row counts not (do_not_specialize), as at the real shapes."""
    import triton

    from h3lab.triton import attention_bwd, attention_fwd

    if kernel == "attention_fwd":
        v = attention_fwd.variant(cfg, head_dim, aligned_strides=True)
    elif kernel in attention_bwd.KERNELS:
        v = attention_bwd.variant(kernel, cfg, head_dim, aligned_strides=True)
    else:
        allowed = sorted(["attention_fwd", *attention_bwd.KERNELS])
        raise ValueError(f"compile_attention_sm90: kernel {kernel!r}; allowed: {allowed}")
    compiled = build(v, "sm90")
    registers, stack = cubin_usage(compiled.asm["cubin"])
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
