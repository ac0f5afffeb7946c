"""Every sm90 kernel's instructions that are not one correctly rounded IEEE operation, from its PTX.

    python -m h3lab.bench.ptx_audit [--json PATH] [--sass DIR]

Run it with the Triton the GPU nodes have (3.6; any Python with that Triton and the checkout on
PYTHONPATH): the audit is only as true as the compiler that made the PTX, and it records which
Triton that was. No GPU is needed: each build is compiled for GPUTarget("cuda", 90, 32).

Builds: every variant h3lab.bench.compile_pinned lists for sm90 (the real H3 widths), the shapes
only the tiny config reaches (`tiny_variants`), the launches the pinned file also allows
(`extra_variants`: the GEMM bucket without its row tail, FP32 outputs, the attention pointer kernels
of the head dims pinned to TMA). The Gluon kernels pinned for sm90 (the unit-tree GEMM, the
attention forward) are among compile_pinned's.

Per build it lists every flagged instruction (`classify`) with the source lines it came from (the
PTX `.loc` records, inlined frames included, so an FMA says whether it is a tl.dot's IEEE chain, a
libdevice polynomial or a contraction of a multiply and an add the source wrote apart), every
floating-point opcode's count, and from the cubin (cuobjdump) the SASS opcodes that matter for
bits: MUFU (the special-function unit), FFMA/FMUL/FADD, the tensor-core instructions. Where the
PTX holds mul/add without a rounding modifier (kernels launched with FMA fusion on) ptxas may fuse
them; the audit recompiles the PTX with `--fmad=false` and reports whether the SASS changes.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from h3lab.bench.compile_pinned import build, variants
from h3lab.io.jsonfile import write_json
from h3lab.triton import attention_bwd, attention_fwd, configs, gemm, norm, rope
from h3lab.triton.variant import Variant

NODE, CAPABILITY = "sm90", 90
FLOAT_TYPES = {"f16", "bf16", "f16x2", "bf16x2", "f32", "f64", "tf32", "e4m3", "e5m2"}
# opcodes that are exact (or exactly specified) on floats and need no model: listed, never flagged
EXACT = ("neg", "abs", "max", "min", "selp", "setp", "set", "testp", "copysign", "mov", "ld", "st", "shfl")
ROUNDED = {"rn", "rz", "rm", "rp"}  # an explicit IEEE rounding: ptxas never fuses such an op
INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)")
LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+(\d+)(?:.*?//\s*(.*))?$")
FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
FRAME = re.compile(r"([\w.]+\.py):(\d+)(?::(\d+))?")
WGMMA_ARGS = re.compile(r"\}\s*,\s*(\{[^}]*\}|%rd\d+)\s*,\s*%rd\d+\s*,\s*([^,\s]+)\s*,")
MOV_PRED = re.compile(r"mov\.pred\s+(%p\d+),\s*(-?\d+);")
PRED_DEST = re.compile(r"^\s*(?:@!?%p\d+\s+)?[a-z][\w.]*\s+(%p\d+)\s*[,|]", re.M)
SASS_OP = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
FMA_FAMILY = ("FFMA", "FMUL", "FADD", "DFMA", "DMUL", "DADD")
SASS_KEPT = ("MUFU", "FFMA", "FMUL", "FADD", "DFMA", "DMUL", "DADD", "HGMMA", "HMMA", "F2F", "F2I", "I2F", "FCHK")


def classify(opcode: str) -> tuple[str, str] | None:
    """(category, why) for a PTX opcode whose result is not one correctly rounded IEEE operation of
    its operands, or None. Categories: mma, approx, div_full, ftz, fma, unrounded, cvt."""
    parts = opcode.split(".")
    if opcode.startswith(("wgmma.mma_async", "mma.sync")):
        return "mma", "tensor-core MMA: groups of 16 products (h3lab.emulate.mma); bits of the hardware"
    if not FLOAT_TYPES & set(parts) or parts[0] in EXACT:
        return None
    if "approx" in parts:
        return "approx", "approximate (MUFU or its wrapper): bits unspecified by PTX, to be probed"
    if parts[0] == "div" and "full" in parts:
        return "div_full", "div.full: approximate division (2 ULP), MUFU.RCP and multiplies in ptxas' sequence"
    if "ftz" in parts:
        return "ftz", "flushes subnormal inputs and results to sign-preserving zero"
    if parts[0] in ("fma", "mad"):
        return "fma", "one rounding for a*b+c (the origin column says who wrote it)"
    if parts[0] in ("add", "sub", "mul") and not ROUNDED & set(parts):
        return "unrounded", "no rounding modifier: ptxas may fuse it with a neighbour into an FMA"
    if parts[0] == "cvt" and not {"rn", "rni"} & set(parts):
        return "cvt", _cvt_why(parts)
    return None


def _cvt_why(parts: list[str]) -> str:
    ints = [p for p in parts[1:] if re.fullmatch(r"[su]\d+", p)]
    if ints and any(p in ("rzi", "rmi", "rpi") for p in parts):
        return "float -> integer with the named rounding (exactly specified)"
    floats = [p for p in parts[1:] if p in FLOAT_TYPES]
    if len(floats) == 2 and not ROUNDED & set(parts):
        return "widening float conversion (exact)"
    return "a conversion with a rounding other than to nearest"


CALLEE = re.compile(r"(tl\.math\.\w+)\s*$")


def _inside(text: str, col: int, call: str) -> bool:
    """Whether column `col` (1-based) of `text` lies inside the parentheses of a call to `call`."""
    for m in re.finditer(re.escape(call) + r"\s*\(", text):
        depth, end = 0, m.end() - 1
        for end in range(m.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        if m.start() <= col - 1 <= end:
            return True
    return False


def _origin(opcode: str, code: str, col: int, via: str) -> str | None:
    """Who wrote an FMA: the source line and the instruction's column (a call's column is its argument
    list, a dot's its accumulator) and the inlined library frames (`via`)."""
    if not opcode.startswith(("fma.", "mad.")):
        return None
    if not code:
        return "no source line (code of the function named in the PTX labels)"
    if _inside(code, col, "tl.dot"):
        return "tl.dot(input_precision='ieee'): one FMA per k, ascending (Triton's FMA dot)"
    callee = CALLEE.search(code[: max(col - 1, 0)])
    if callee:
        return f"libdevice: {callee.group(1)}'s own sequence of FMAs"
    if "standard.py" in via:
        return "contraction of a product into tl.sum's adds"
    return "contraction of a multiply and an add written as two operations"


@functools.cache
def _source_line(path: str, line: int) -> str:
    try:
        return Path(path).read_text().splitlines()[line - 1] if line > 0 else ""
    except (OSError, IndexError):
        return ""


def _frame_site(comment: str, files: dict[int, str], loc: tuple[int, int, int]) -> tuple[str, str, str, int]:
    """(site, via, code, col): the innermost frame in h3lab (inlined library frames before it are
    `via`), its source line and the instruction's column in it."""
    by_name = {Path(p).name: p for p in files.values()}
    frames = [(by_name.get(name, name), int(n), int(c or 0)) for name, n, c in FRAME.findall(comment or "")]
    frames = frames or [(files.get(loc[0], "?"), loc[1], loc[2])]
    via = []
    for path, n, col in frames:
        if "/h3lab/" in path:
            rel, text = path[path.index("/h3lab/") + 1 :], _source_line(path, n)
            return f"{rel}:{n}", " <- ".join(via), text, col
        via.append(f"{Path(path).parent.name}/{Path(path).name}:{n}")
    return (via[-1] if via else "?"), " <- ".join(via[:-1]), "", 0


def _mma_operands(raw: str, preds: dict[str, str]) -> str:
    """A wgmma's A source and accumulator use: "A smem|regs, scale-d 0|1|predicate". scale-d 0 is a
    product with no accumulator (tl.dot without acc: a zero sum then takes the products' sign)."""
    m = WGMMA_ARGS.search(raw)
    if not m:
        return "operands not parsed"
    a = "regs" if m.group(1).startswith("{") else "smem"
    d = m.group(2)
    d = preds.get(d, "predicate") if d.startswith("%p") else d
    return f"A {a}, scale-d {d}"


def audit_ptx(ptx: str) -> dict[str, Any]:
    """Every floating-point opcode's count, each flagged one's sites (`classify`), and for the MMAs
    where A comes from and whether the accumulator is read (`mma_operands`)."""
    files = {int(m.group(1)): m.group(2) for m in map(FILE.match, ptx.splitlines()) if m}
    written = collections.Counter(PRED_DEST.findall(ptx))  # a predicate set once by a mov is a constant
    preds = {p: {"-1": "1", "0": "0"}.get(v, "predicate") for p, v in MOV_PRED.findall(ptx) if written[p] == 1}
    mma: collections.Counter[tuple[str, str, str]] = collections.Counter()
    fp_ops: collections.Counter[str] = collections.Counter()
    sites: dict[str, collections.Counter[tuple[str, str, str, int]]] = collections.defaultdict(collections.Counter)
    loc, comment = (0, 0, 0), ""
    for raw in ptx.splitlines():
        m = LOC.match(raw)
        if m:
            loc, comment = (int(m.group(1)), int(m.group(2)), int(m.group(3))), m.group(4) or ""
            continue
        m = INSTR.match(raw)
        if not m or raw.strip().startswith(("//", ".")) or raw.rstrip().endswith(":"):
            continue
        opcode = m.group(1).rstrip(";")
        if FLOAT_TYPES & set(opcode.split(".")) or opcode.startswith(("wgmma.mma_async", "mma.sync")):
            fp_ops[opcode] += 1
        if classify(opcode) is not None:
            sites[opcode][_frame_site(comment, files, loc)] += 1
        if opcode.startswith("wgmma.mma_async"):
            mma[(opcode.split(".")[4], _frame_site(comment, files, loc)[0], _mma_operands(raw, preds))] += 1
    flagged = {}
    for opcode, where in sorted(sites.items()):
        category, why = classify(opcode)  # type: ignore[misc]
        rows = []
        for (site, via, code, col), n in sorted(where.items()):
            at = f"{code[: max(col - 1, 0)].lstrip()[-28:]} ^ {code[max(col - 1, 0) :][:28]}" if code else ""
            row = {"site": site, "code": code.strip()[:120], "at": at, "via": via, "count": n}
            origin = _origin(opcode, code, col, via)
            rows.append(row | ({"origin": origin} if origin else {}))
        flagged[opcode] = {"category": category, "why": why, "count": sum(where.values()), "sites": rows}
    mma_rows = [{"shape": sh, "site": site, "operands": ops, "count": n} for (sh, site, ops), n in sorted(mma.items())]
    return {"flagged": flagged, "fp_ops": dict(sorted(fp_ops.items())), "mma_operands": mma_rows}


def _bin(name: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def sass_ops(cubin: bytes) -> dict[str, int]:
    """Counts of the bit-relevant SASS opcodes (SASS_KEPT prefixes) of a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(_bin("cuobjdump")), "-sass", str(path)], capture_output=True, text=True, check=True)
    ops = collections.Counter(m.group(1) for m in map(SASS_OP.match, text.stdout.splitlines()) if m)
    return {op: n for op, n in sorted(ops.items()) if op.startswith(SASS_KEPT)}


def _sass_text(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(_bin("cuobjdump")), "-sass", str(path)], capture_output=True, text=True).stdout


def fmad_check(ptx: str) -> dict[str, Any]:
    """Whether ptxas fused any unrounded mul/add: the SASS FMA-family counts of this PTX assembled by
    ptxas with its default (--fmad=true, Triton's choice when fusion is on) and with --fmad=false."""
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for flag in ("true", "false"):
            out = Path(tmp) / f"k_{flag}.cubin"
            cmd = [str(_bin("ptxas")), f"--fmad={flag}", f"--gpu-name=sm_{CAPABILITY}a", "-o", str(out), str(src)]
            subprocess.run(cmd, capture_output=True, check=True)
            ops = sass_ops(out.read_bytes())
            counts[flag] = {k: v for k, v in ops.items() if k.startswith(FMA_FAMILY)}
    fused = counts["true"] != counts["false"]
    return {"fmad_true": counts["true"], "fmad_false": counts["false"], "ptxas_fused": fused}


# ---- the builds --------------------------------------------------------------------------------


def tiny_variants() -> list[Variant]:
    """The row-local builds at the tiny config's widths (hidden 192, head_dim 32, 8 heads, rope 4):
    their tile constants differ from the real ones, so they are builds of their own."""
    d, dh, heads, f = 192, 32, 8, 4
    out = []
    for v in norm.variants(NODE) + rope.variants(NODE):
        const = dict(v.const)
        if v.function == "norm._rms_modulate_kernel":
            const |= {"D": d, "BLOCK_D": 256, "LOG2_D": 8}
        elif v.function == "norm._qk_norm_rope_kernel":
            const |= {"DH": dh, "C": 6 * f, "BLOCK_H": min(const["BLOCK_H"], heads), "BLOCK_DH": dh, "LOG2_DH": 5}
        elif v.function == "rope._rope_kernel":
            const |= {"F": f, "BLOCK_R": const["BLOCK_R"] * const["BLOCK_C"] // 32, "BLOCK_C": 32}
        out.append(replace(v, what=f"{v.what} (tiny)", const=const))
    return out


def extra_variants() -> list[Variant]:
    """Launches the pinned file allows beside compile_pinned's: the <=1024-row bucket without its row
    tail, FP32 outputs through TMA, and the attention pointer kernels at every head dim pinned to TMA
    (a TMA config's fallback when a descriptor cannot walk the operands)."""
    gemms = [v for v in gemm.variants(NODE) if v.what.startswith("bf16")]
    tail = gemms[0]
    no_tail = tail.types | {"a_tail_desc": None, "w_tail_desc": None}
    const = tail.const | {"TAIL": False, "TAIL_M": 1, "TAIL_N": 1}
    out = [replace(tail, what=f"{tail.what}, no row tail", types=no_tail, const=const)]
    for v in gemms:
        base = out[0] if v is tail else v
        c = base.types["c_desc"].replace("bf16", "fp32")
        out.append(replace(base, what=f"{v.what}, fp32 out", types=base.types | {"c_ptr": "*fp32", "c_desc": c}))
    for dh, cfg in configs.pinned("attention_fwd", NODE)["by_head_dim"].items():
        if cfg.get("TMA"):
            out.append(attention_fwd.variant(cfg | {"TMA": False}, int(dh), f"head_dim {dh}, pointer loads"))
    for kernel in attention_bwd.KERNELS:
        for dh, cfg in configs.pinned(kernel, NODE)["by_head_dim"].items():
            if cfg.get("TMA"):
                pointer = cfg | {"TMA": False}
                out.append(attention_bwd.variant(kernel, pointer, int(dh), f"head_dim {dh}, pointer loads"))
    return out


def builds() -> list[Variant]:
    """Every build the audit compiles: compile_pinned's (the Gluon kernels among them), the tiny ones, the extras."""
    return variants(NODE) + tiny_variants() + extra_variants()


def audit_build(v: Variant, sass_dir: Path | None = None) -> dict[str, Any]:
    compiled = build(v, NODE)
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    record = {"kernel": v.kernel, "what": v.what, "function": v.function, "options": dict(v.options)}
    record |= audit_ptx(ptx) | {"sass": sass_ops(cubin)}
    if any(f["category"] == "unrounded" for f in record["flagged"].values()):
        record["fmad_check"] = fmad_check(ptx)
    if sass_dir is not None:
        stem = re.sub(r"[^\w.-]+", "_", f"{v.function}.{v.what}").strip("_")
        (sass_dir / f"{stem}.ptx").write_text(ptx)
        (sass_dir / f"{stem}.sass").write_text(_sass_text(cubin))
    return record


def by_opcode(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each flagged opcode across builds: its category, why, and which builds hold it (with counts)."""
    out: dict[str, Any] = {}
    for r in records:
        for opcode, f in r["flagged"].items():
            entry = out.setdefault(opcode, {"category": f["category"], "why": f["why"], "builds": {}})
            entry["builds"][f"{r['kernel']} | {r['what']}"] = f["count"]
    return dict(sorted(out.items(), key=lambda kv: (kv[1]["category"], kv[0])))


def run(sass_dir: Path | None = None, only: str | None = None) -> dict[str, Any]:
    """The audit of every build (those whose function or description contains `only`)."""
    import triton

    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for v in builds():
        if only is None or only in f"{v.function} {v.what}":
            records.append(audit_build(v, sass_dir))
            print(_line(records[-1]), flush=True)
    return {
        "format": "h3lab-ptx-audit-v1",
        "triton": triton.__version__,
        "python": sys.executable,
        "target": f"GPUTarget('cuda', {CAPABILITY}, 32)",
        "by_opcode": by_opcode(records),
        "builds": records,
    }


def _line(r: dict[str, Any]) -> str:
    flagged = ", ".join(f"{op} x{f['count']}" for op, f in r["flagged"].items() if f["category"] != "mma")
    fused = r.get("fmad_check", {}).get("ptxas_fused")
    note = "" if fused is None else f"  [ptxas fused: {fused}]"
    return f"{r['kernel']:<16} {r['what'][:44]:<44} {flagged or '-'}{note}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the whole record here")
    ap.add_argument("--sass", type=Path, help="write each build's PTX and SASS into this folder")
    ap.add_argument("--only", help="the builds whose function or description contains this text")
    args = ap.parse_args(argv)
    record = run(args.sass, args.only)
    if args.json:
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
