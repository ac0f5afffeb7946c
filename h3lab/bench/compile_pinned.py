"""Compile every Triton kernel with a node type's pinned configuration for its GPU, without a GPU.

    python -m h3lab.bench.compile_pinned --node sm100 [--json]

Every kernel module of h3lab.triton exports `variants(node)`: each build its launcher can ask of
`kernels/<node>.json` (GEMM row buckets and the fp32 entry, attention head dims, norm directions,
elementwise ops; on sm90 the Gluon unit-tree GEMM), with the argument types of the real H3 calls
(bf16 activations, FP32 statistics and gradients; h3lab.triton.variant). This builds each with the
installed Triton for GPUTarget("cuda", <capability>, 32) and reads registers, stack and shared
memory from the cubin (cuobjdump, bundled with Triton). It shows that a pinned file compiles for an
architecture no GPU here has (sm100, the B200) and that every kernel fits its shared memory; it
says nothing about bits or speed, which only a GPU of that architecture can show
(kernels/README.md). Run it without TRITON_INTERPRET=1 (interpreted kernels do not compile).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from h3lab.triton.variant import Variant

CAPABILITY = {"sm90": 90, "sm100": 100}
SHARED_BYTES = {"sm90": 232448, "sm100": 232448}  # 227 KiB: the most one CTA may allocate (H100/H200, B200)


def cubin_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of a cubin, read by the cuobjdump bundled with Triton."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True, check=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    assert found, f"cuobjdump -res-usage printed no REG/STACK line: {usage.stdout[:300]}"
    return int(found.group(1)), int(found.group(2))


def build(v: Variant, node: str) -> Any:
    """`v` compiled for `node`'s GPU with the installed Triton (a Gluon kernel through Gluon's source)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    if node not in CAPABILITY:
        raise ValueError(f"compile_pinned: node {node!r}; allowed: {sorted(CAPABILITY)}")
    sig, constexprs, attrs = v.signature()
    source = GluonASTSource if isinstance(v.fn, GluonJITFunction) else ASTSource
    src = source(v.fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", CAPABILITY[node], 32), options=dict(v.options))


def compile_variant(v: Variant, node: str) -> dict[str, Any]:
    """Build `v` for `node`'s GPU with the installed Triton; its resources and tensor-core instructions."""
    import triton

    compiled = build(v, node)
    registers, stack = cubin_usage(compiled.asm["cubin"])
    ptx: str = compiled.asm["ptx"]
    return {
        "kernel": v.kernel,
        "what": v.what,
        "function": v.function,
        "node": node,
        "registers": registers,
        "stack_bytes": stack,
        "shared_bytes": compiled.metadata.shared,
        "tcgen05_mma": len(re.findall(r"tcgen05\.mma", ptx)),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "triton": triton.__version__,
    }


def variants(node: str) -> list[Variant]:
    """Every kernel build the Triton backend's launchers can ask of `node`'s pinned file: the
    `variants(node)` of every module of h3lab.triton that has one, in module order."""
    import h3lab.triton

    out: list[Variant] = []
    for info in sorted(pkgutil.iter_modules(h3lab.triton.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"h3lab.triton.{info.name}")
        if callable(getattr(module, "variants", None)):
            out += module.variants(node)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node", choices=sorted(CAPABILITY), default="sm100")
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    args = ap.parse_args(argv)
    rows = []
    for v in variants(args.node):
        r = compile_variant(v, args.node)
        rows.append(r)
        if not args.json:
            print(
                f"{r['kernel']:<16} {r['what']:<36} regs {r['registers']:>3} stack {r['stack_bytes']:>5} "
                f"shared {r['shared_bytes']:>6} tcgen05 {r['tcgen05_mma']:>3} wgmma {r['wgmma']:>3} "
                f"tma {r['tma_loads']:>2}  (Triton {r['triton']}, {args.node})",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
