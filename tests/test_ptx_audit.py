"""The PTX audit (h3lab.bench.ptx_audit) on crafted PTX: what it flags, where each flagged instruction
came from, and how it reads an MMA's operands. The audit itself runs with the GPU nodes' Triton
(`python -m h3lab.bench.ptx_audit` with Triton 3.6); here only its reading is tested."""

from __future__ import annotations

from h3lab.bench import ptx_audit

SOURCE = """\
def k(q, k, m, scale, l):
    p = tl.math.exp2(q * scale - m)
    s = tl.dot(q, tl.trans(k))
    o = p / l
    y = tl.math.log2(l)
"""


def _ptx(path: str) -> str:
    return f"""
.version 8.7
.target sm_90a
	.loc	1 2 22                          // k.py:2:22
	ex2.approx.ftz.f32 	%r1, %r2;
	.loc	1 2 33                          // k.py:2:33
	fma.rn.f32 	%r3, %r4, %r5, %r6;
	.loc	1 3 18                          // k.py:3:18
	fma.rn.f32 	%r30, %r31, %r32, %r33;
	mov.pred 	%p1, -1;
	wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {{%r7,%r8}}, %rd1, %rd2, 0, 1, 1, 0, 0;
	wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {{%r7,%r8}}, {{%r9,%r10}}, %rd3, %p1, 1, 1, 1;
	.loc	1 4 12                          // k.py:4:12
	div.full.f32 	%r11, %r12, %r13;
	@%p2 mul.f32 	%r14, %r15, %r16;
	mul.rn.f32 	%r17, %r15, %r16;
	cvt.f32.bf16 	%r18, %rs1;
	cvt.rzi.s64.f64 	%rd4, %fd1;
	cvt.rn.bf16.f32 	%rs2, %r18;
	max.f32 	%r19, %r20, %r21;
	.loc	1 5 21                          // k.py:5:21
	fma.rn.ftz.f32 	%r22, %r23, %r24, %r25;
	.file	1 "{path}"
"""


def test_flagged_instructions_name_their_category_site_and_origin(tmp_path):
    src = tmp_path / "h3lab" / "k.py"
    src.parent.mkdir()
    src.write_text(SOURCE)
    got = ptx_audit.audit_ptx(_ptx(str(src)))
    flagged = got["flagged"]
    assert {op: f["category"] for op, f in flagged.items()} == {
        "ex2.approx.ftz.f32": "approx",
        "fma.rn.f32": "fma",
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16": "mma",
        "div.full.f32": "div_full",
        "mul.f32": "unrounded",
        "cvt.f32.bf16": "cvt",
        "cvt.rzi.s64.f64": "cvt",
        "fma.rn.ftz.f32": "ftz",
    }
    fma, dot = flagged["fma.rn.f32"]["sites"]
    assert fma["site"] == "h3lab/k.py:2" and fma["code"] == "p = tl.math.exp2(q * scale - m)"
    assert fma["origin"] == "contraction of a multiply and an add written as two operations"
    assert dot["site"] == "h3lab/k.py:3" and dot["origin"].startswith("tl.dot(input_precision='ieee')")
    assert flagged["fma.rn.ftz.f32"]["sites"][0]["origin"] == "libdevice: tl.math.log2's own sequence of FMAs"
    assert flagged["cvt.f32.bf16"]["why"] == "widening float conversion (exact)"
    assert flagged["cvt.rzi.s64.f64"]["why"] == "float -> integer with the named rounding (exactly specified)"
    assert got["fp_ops"]["mul.rn.f32"] == 1 and got["fp_ops"]["max.f32"] == 1  # listed, not flagged
    assert [m["operands"] for m in got["mma_operands"]] == ["A regs, scale-d 1", "A smem, scale-d 0"]


def test_exact_and_correctly_rounded_opcodes_are_not_flagged():
    for op in ("add.rn.f32", "div.rn.f32", "sqrt.rn.f32", "max.f32", "neg.f64", "cvt.rn.f32.f64", "add.s32"):
        assert ptx_audit.classify(op) is None, op
    assert ptx_audit.classify("sqrt.approx.f32")[0] == "approx"
    assert ptx_audit.classify("add.f64")[0] == "unrounded"


def test_the_builds_cover_every_pinned_kernel_at_both_widths():
    builds = ptx_audit.builds()
    kernels = {b.kernel for b in builds}
    assert {"gemm", "unit_gemm", "attention_fwd", "attention_bwd_q", "attention_bwd_kv", "norm"} <= kernels
    whats = {(b.function, b.what) for b in builds}
    assert len(whats) == len(builds)  # each build once
    assert any("tiny" in w for _, w in whats) and any("pointer loads" in w for _, w in whats)
