"""Compile every Triton kernel with a node type's pinned configuration for its GPU, without a GPU.

    python -m h3lab.bench.compile_pinned --node sm100 [--json]

For each kernel the Triton backend launches, and each configuration `kernels/<node>.json` pins for
it (GEMM row buckets and the fp32 entry, attention head dims, norm directions, elementwise ops), it
builds the kernel with the installed Triton for GPUTarget("cuda", <capability>, 32), with the
argument types of the real H3 calls (bf16 activations, FP32 statistics and gradients), and reads
registers, stack and shared memory from the cubin (cuobjdump, bundled with Triton). It shows that a
pinned file compiles for an architecture no GPU here has (sm100, the B200) and that every kernel
fits its shared memory; it says nothing about bits or speed, which only a GPU of that architecture
can show (kernels/README.md). The Gluon unit-tree GEMM ("IMPL": "gluon", Hopper only) is compiled
by h3lab.bench.compile_sm90. Run it without TRITON_INTERPRET=1 (interpreted kernels do not compile).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CAPABILITY = {"sm90": 90, "sm100": 100}
SHARED_BYTES = {"sm90": 232448, "sm100": 232448}  # 227 KiB: the most one CTA may allocate (H100/H200, B200)
HIDDEN, HEAD_DIM, ROPE_F = 5376, 128, 16  # the real H3 widths (H3Config.real())


@dataclass(frozen=True)
class Variant:
    """One kernel build: the jit function's module and name, argument types, constexprs, launch options."""

    kernel: str  # the pinned entry it reads
    what: str  # which call or bucket
    fn: str  # "module.function" under h3lab.triton
    types: dict[str, str] = field(default_factory=dict)  # arguments not named here are i32
    const: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


def _cubin_usage(cubin: bytes) -> tuple[int, int]:
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


def compile_variant(v: Variant, node: str) -> dict[str, Any]:
    """Build `v` for `node`'s GPU with the installed Triton; its resources and tensor-core instructions."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if node not in CAPABILITY:
        raise ValueError(f"compile_pinned: node {node!r}; allowed: {sorted(CAPABILITY)}")
    module, name = v.fn.rsplit(".", 1)
    fn = getattr(importlib.import_module(f"h3lab.triton.{module}"), name)
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        sig[arg] = "constexpr" if arg in v.const else v.types.get(arg, "i32")
        if sig[arg].startswith("*"):  # 16-byte aligned, as the runtime finds torch's allocations
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=v.const, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", CAPABILITY[node], 32), options=dict(v.options))
    registers, stack = _cubin_usage(compiled.asm["cubin"])
    ptx: str = compiled.asm["ptx"]
    return {
        "kernel": v.kernel,
        "what": v.what,
        "function": v.fn,
        "node": node,
        "registers": registers,
        "stack_bytes": stack,
        "shared_bytes": compiled.metadata.shared,
        "tcgen05_mma": len(re.findall(r"tcgen05\.mma", ptx)),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "triton": triton.__version__,
    }


def _opts(cfg: dict[str, Any], stages: bool = True) -> dict[str, Any]:
    return {"num_warps": cfg["num_warps"], "enable_fp_fusion": False} | (
        {"num_stages": cfg["num_stages"]} if stages else {}
    )


def gemm_variants(node: str) -> list[Variant]:
    """mm_kernel: every row bucket at its bf16 TMA form (a [M, K], b = W.T, bf16 out), and the fp32 entry."""
    from h3lab.triton import configs, gemm

    buckets = configs.pinned("gemm", node).get("by_rows", [{"max_rows": None}])
    out = []
    for bucket in buckets:
        rows = bucket["max_rows"] or 4096
        cfg = gemm.kernel_config("gemm", node, False, rows=rows)
        BM, BN, BK, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.get("EPILOGUE_SPLIT", 1)
        tail = "TAIL_M" in cfg
        types = {f"{x}_ptr": "*bf16" for x in "abc"} | {
            "a_desc": f"tensordesc<bf16[{BM}, {BK}]>",
            "b_desc": f"tensordesc<bf16[{BN}, {BK}]>",
            "c_desc": f"tensordesc<bf16[{BM}, {BN // split}]>",
        }
        const = _mm_const(cfg, a_mode=1, b_mode=1, ieee=False, out_tma=bool(cfg.get("TMA_STORE")), split=split)
        if tail:
            types |= {
                "a_tail_desc": f"tensordesc<bf16[{cfg['TAIL_M']}, {BK}]>",
                "w_tail_desc": f"tensordesc<bf16[{cfg['TAIL_N']}, {BK}]>",
            }
            const |= {"TAIL": True, "TAIL_M": cfg["TAIL_M"], "TAIL_N": cfg["TAIL_N"]}
        else:
            const |= {"a_tail_desc": None, "w_tail_desc": None}
        out.append(Variant("gemm", f"bf16, rows <= {bucket['max_rows']}", "gemm.mm_kernel", types, const, _opts(cfg)))
    cfg = gemm.kernel_config("gemm", node, True)
    const = _mm_const(cfg, a_mode=0, b_mode=0, ieee=True, out_tma=False, split=1)
    const |= {d: None for d in ("a_desc", "b_desc", "c_desc", "a_tail_desc", "w_tail_desc")}
    types = {f"{x}_ptr": "*fp32" for x in "abc"}
    out.append(Variant("gemm", "fp32", "gemm.mm_kernel", types, const, _opts(cfg)))
    return out


def _mm_const(cfg: dict[str, Any], *, a_mode: int, b_mode: int, ieee: bool, out_tma: bool, split: int) -> dict:
    tiles = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
    flags = {"FLATTEN": cfg.get("FLATTEN", False), "WARP_SPECIALIZE": cfg.get("WARP_SPECIALIZE", False)}
    return (
        tiles
        | flags
        | {"A_MODE": a_mode, "B_MODE": b_mode, "IEEE": ieee, "OUT_TMA": out_tma, "SPLIT": split}
        | {
            "TAIL": False,
            "TAIL_M": 1,
            "TAIL_N": 1,
        }
    )


def unit_gemm_variants(node: str) -> list[Variant]:
    """unit_mm_kernel (the Triton kernel; on sm90 it takes the calls the Gluon kernel cannot): one piece
    (to_out, ff.net.2: b = W.T) and three (q, k, v dX: b = W), bf16 through TMA; the fp32 entry."""
    from h3lab.triton import gemm

    out = []
    for ieee, pieces, b_mode in ((False, 1, 1), (False, 3, 2), (True, 1, 0)):
        cfg = gemm.kernel_config("unit_gemm", node, ieee)
        BM, BN, BK, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.get("EPILOGUE_SPLIT", 1)
        dt, tma = ("fp32", False) if ieee else ("bf16", bool(cfg["TMA"]))
        out_tma = bool(cfg.get("TMA_STORE")) and not ieee
        scratch_tma = bool(cfg.get("SCRATCH_TMA", True))
        types = {"c_ptr": "*fp32", "s_ptr": "*fp32"}
        const: dict[str, Any] = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
        const |= {"PIECES": pieces, "PENDING_IN_REGS": bool(cfg.get("PENDING_IN_REGS", True))}
        const |= {"SCRATCH_TMA": scratch_tma, "FENCE": True, "IEEE": ieee, "OUT_TMA": out_tma}
        const |= {"SPLIT": split if out_tma else 1}
        for i in range(3):
            used = i < pieces
            am, bm = (1 if tma else 0, b_mode if tma else 0) if used else (0, 0)
            const |= {f"AM{i}": am, f"BM{i}": bm}
            if not used:
                const |= {f"a{i}": None, f"ad{i}": None, f"b{i}": None, f"bd{i}": None}
                continue
            types |= {f"a{i}": f"*{dt}", f"b{i}": f"*{dt}"}
            if tma:
                b_block = [BN, BK] if bm == 1 else [BK, BN]
                types |= {
                    f"ad{i}": f"tensordesc<bf16[{BM}, {BK}]>",
                    f"bd{i}": f"tensordesc<bf16[{b_block[0]}, {b_block[1]}]>",
                }
            else:
                const |= {f"ad{i}": None, f"bd{i}": None}
        if out_tma:
            types["c_desc"] = f"tensordesc<fp32[{BM}, {BN // split}]>"
        else:
            const["c_desc"] = None
        if scratch_tma:
            types["s_desc"] = f"tensordesc<fp32[{BM}, {BN}]>"
        else:
            const["s_desc"] = None
        what = f"{dt}, {pieces} piece{'s' if pieces > 1 else ''}"
        out.append(Variant("unit_gemm", what, "unit_gemm.unit_mm_kernel", types, const, _opts(cfg)))
    return out


def attention_variants(node: str) -> list[Variant]:
    """The attention kernels at every pinned head dim: bf16 q, k, v, dO; FP32 reference output and statistics."""
    from h3lab.triton import configs
    from h3lab.triton.attention import config_for

    fp32 = ("oref_ptr", "lse_ptr", "delta_ptr", "dq_ptr", "dk_ptr", "dv_ptr")
    out = []
    for kernel in ("attention_fwd", "attention_delta", "attention_bwd_q", "attention_bwd_kv"):
        for dh in sorted(configs.pinned(kernel, node)["by_head_dim"], key=int):
            cfg = config_for(kernel, int(dh), node)
            if kernel == "attention_delta":
                types = {"do_ptr": "*bf16", "o_ptr": "*fp32", "delta_ptr": "*fp32"}
                const = {"HEAD_DIM": int(dh), "BLOCK_R": cfg["BLOCK_R"]}
                opts = {"num_warps": cfg["num_warps"], "num_stages": cfg.get("num_stages", 1)}
                out.append(
                    Variant(kernel, f"head_dim {dh}", "attention_bwd.attention_delta_kernel", types, const, opts)
                )
                continue
            module = "attention_fwd" if kernel == "attention_fwd" else "attention_bwd"
            fn = f"{module}.{kernel}_tma_kernel" if cfg.get("TMA") else f"{module}.{kernel}_kernel"
            const = {"HEAD_DIM": int(dh), "DOT_PREC": "tf32", "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}
            const |= {"WRITE_REF": True} if kernel == "attention_fwd" else {}
            types = {n: "*fp32" for n in fp32}
            types |= {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr")}
            types |= {"qk_scale": "fp32", "scale": "fp32"}
            if cfg.get("TMA"):
                rows = {"q_desc": cfg["BLOCK_M"], "do_desc": cfg["BLOCK_M"]}
                rows |= {"k_desc": cfg["BLOCK_N"], "v_desc": cfg["BLOCK_N"]}
                types |= {n: f"tensordesc<bf16[{r}, {dh}]>" for n, r in rows.items()}
            opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
            out.append(Variant(kernel, f"head_dim {dh}", fn, types, const, opts))
    return out


def rowlocal_variants(node: str) -> list[Variant]:
    """Norms, RoPE tables, SwiGLU and the gated residual, the row chains, the few-row AdaLN pair and the
    training step's kernels, at the real widths."""
    import triton

    from h3lab.triton import configs

    norm = configs.pinned("norm", node)
    out = []
    for backward, entry in ((False, "rms_modulate_fwd"), (True, "rms_modulate_bwd")):
        cfg = norm[entry]
        block_d = triton.next_power_of_2(HIDDEN)
        types = {"x_ptr": "*bf16", "w_ptr": "*fp32", "scale_ptr": "*fp32", "other_ptr": "*fp32"}
        types |= {n: "*fp32" if backward else "*bf16" for n in ("out_ptr", "dw_ptr", "dscale_ptr", "dshift_ptr")}
        types |= {"inv_d": "fp32", "eps": "fp32"}
        const = {"BACKWARD": backward, "D": HIDDEN, "BLOCK_R": cfg["rows_per_program"], "BLOCK_D": block_d}
        const |= {"LOG2_D": block_d.bit_length() - 1}
        out.append(Variant("norm", entry, "norm._rms_modulate_kernel", types, const, _opts(cfg, stages=False)))
    cfg = norm["qk_norm_rope"]
    dh = HEAD_DIM
    for backward in (False, True):
        types = {n: "*bf16" for n in ("q_ptr", "dout_ptr", "out_ptr")} | {"w_ptr": "*fp32", "dw_ptr": "*fp32"}
        types |= {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "inv_dh": "fp32", "eps": "fp32"}
        const = {"BACKWARD": backward, "DH": dh, "C": 6 * ROPE_F, "BLOCK_H": min(cfg["heads_per_program"], 64)}
        const |= {"BLOCK_DH": dh, "LOG2_DH": dh.bit_length() - 1}
        what = f"qk_norm_rope {'bwd' if backward else 'fwd'}"
        out.append(Variant("norm", what, "norm._qk_norm_rope_kernel", types, const, _opts(cfg, stages=False)))
    cfg = configs.pinned("rope", node)
    block_c = triton.next_power_of_2(6 * ROPE_F)
    types = {"pos_ptr": "*i64", "inv_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    const = {"F": ROPE_F, "BLOCK_R": max(1, cfg["elements"] // block_c), "BLOCK_C": block_c}
    out.append(Variant("rope", "rope_tables", "rope._rope_kernel", types, const, _opts(cfg, stages=False)))
    cfg = configs.pinned("elementwise", node)
    for op, what in enumerate(("swiglu_fwd", "swiglu_bwd", "gated_residual", "silu", "silu_bwd")):
        types = {n: "*bf16" for n in ("a_ptr", "b_ptr", "c_ptr", "out_ptr", "out2_ptr")}
        const = {"OP": op, "BLOCK_N": cfg["block_n"]}
        out.append(Variant("elementwise", what, "elementwise._elementwise_kernel", types, const, _opts(cfg, False)))
    return out + _chain_and_few_rows_variants(node)


def _chain_and_few_rows_variants(node: str) -> list[Variant]:
    from h3lab.triton import configs

    cfg = configs.pinned("rows", node)
    out = []
    for num in (1, 6):  # one chain set, and the largest group the block hands to rows.chain_sums
        types = {
            f"{p}{i}": t for i in range(6) for p, t in (("x", "*bf16"), ("r", "*i64"), ("s", "*i64"), ("o", "*fp32"))
        }
        const = {"NUM": num, "BLOCK_N": cfg["block_n"], "UNROLL": cfg["unroll"]}
        opts = {"num_warps": cfg["num_warps"]}
        out.append(
            Variant("rows", f"{num} chain set{'s' if num > 1 else ''}", "rows._row_chain_kernel", types, const, opts)
        )
    cfg = configs.pinned("few_rows", node)
    types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "p_ptr": "*fp32"}
    const = {"BLOCK_T": 16, "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"]}
    out.append(Variant("few_rows", "unit_mm_few_rows", "few_rows._unit_partial_kernel", types, const, _opts(cfg)))
    types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16"}
    const = {"BLOCK_M": cfg["outer_BLOCK_M"], "BLOCK_N": cfg["outer_BLOCK_N"]}
    opts = {"num_warps": cfg["outer_num_warps"], "enable_fp_fusion": False}
    out.append(Variant("few_rows", "mm_few_k", "chain.chain_kernel", types, const, opts))
    return out + _training_variants(node)


def _training_variants(node: str) -> list[Variant]:
    """The float32 modules' chain GEMM, the clip's row-block squares, AdamW (bf16 and fp32 weights)."""
    from h3lab.ops.fixed import ROW_BLOCK
    from h3lab.triton import configs

    cfg = configs.pinned("chain", node)
    types = {"a_ptr": "*bf16", "b_ptr": "*fp32", "c_ptr": "*fp32"}
    const = {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}
    out = [Variant("chain", "chain_mm", "chain.chain_kernel", types, const, _opts(cfg, stages=False))]
    cfg = configs.pinned("squares", node)
    types = {"x_ptr": "*bf16", "out_ptr": "*fp32"}
    const = {"BPP": cfg["blocks_per_program"], "RB": ROW_BLOCK, "LOG2_RB": ROW_BLOCK.bit_length() - 1}
    out.append(Variant("squares", "row blocks", "squares.block_squares_kernel", types, const, _opts(cfg, False)))
    cfg = configs.pinned("adamw", node)
    for w_bf16 in (True, False):
        types = {f"{n}_ptr": "*fp32" for n in ("master", "m", "v", "coef", "s")}
        types |= {"g_ptr": "*bf16", "w_ptr": "*i16" if w_bf16 else "*fp32"}
        const = {"W_BF16": w_bf16, "BLOCK": cfg["BLOCK"]}
        what = f"{'bf16' if w_bf16 else 'fp32'} weight"
        out.append(Variant("adamw", what, "adamw.adamw_kernel", types, const, _opts(cfg, stages=False)))
    return out


def variants(node: str) -> list[Variant]:
    """Every kernel build the Triton backend's launchers can ask of `node`'s pinned file."""
    return gemm_variants(node) + unit_gemm_variants(node) + attention_variants(node) + rowlocal_variants(node)


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
                f"{r['kernel']:<16} {r['what']:<24} regs {r['registers']:>3} stack {r['stack_bytes']:>5} "
                f"shared {r['shared_bytes']:>6} tcgen05 {r['tcgen05_mma']:>3} wgmma {r['wgmma']:>3} "
                f"tma {r['tma_loads']:>2}  (Triton {r['triton']}, {args.node})",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
