"""SwiGLU forward/backward, silu, the gated residual and the storage rounding as Triton kernels.

Reference: h3lab.ops.elementwise, bit for bit. Every result depends on its own operands only (one element,
one chain of IEEE operations), never on its position, the tensor's size or the launch config.

sigmoid uses the reference's own exp (h3lab.ops.fixed.exp), ported operation by operation: float64
range reduction, degree-13 Taylor polynomial, exponent bits for 2^n, one rounding to float32. Not
libdevice `__nv_expf` nor `tl.exp` (ex2.approx, ~2 ULP): both would be accurate, but their bits are
not the torch backend's, and a library's exp may change between CUDA releases. The cost: a few
dozen FP64 operations per element, which bound the kernel somewhat below the rate the bf16 traffic
of SwiGLU allows, still small beside the block's GEMMs (per-kernel times: reports/h200/profile.json,
top_kernels).
Launched with `enable_fp_fusion=False`, as the reference's separate torch ops never fuse a multiply-add.

Dimension legend: R rows, N columns (F for SwiGLU, D for the residual).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from h3lab.ops import fixed
from h3lab.ops.fixed import round_to
from h3lab.triton import configs
from h3lab.triton.fp64 import f64, horner, rint
from h3lab.triton.variant import Variant, options

F32 = torch.float32
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float32)

# the reference's constants, exactly (float64 literals through fp64.f64)
_LN2_HI = tl.constexpr(fixed._LN2_HI)
_LN2_LO = tl.constexpr(fixed._LN2_LO)
_INV_LN2 = tl.constexpr(fixed._INV_LN2)
_T = [tl.constexpr(c) for c in fixed._EXP_TAYLOR]  # 1/k!, k = 0..13
_T0, _T1, _T2, _T3, _T4, _T5, _T6, _T7, _T8, _T9, _T10, _T11, _T12, _T13 = _T
assert len(_T) == 14, "the reference's exp polynomial changed degree; port it again"


@triton.jit
def _exp(x):
    """h3lab.ops.fixed.exp: float32 in, float32 out, every step an IEEE float64 op in the same order."""
    x64 = x.to(tl.float64)
    xc = tl.minimum(tl.maximum(x64, f64(-1000.0)), f64(1000.0))  # NaN is restored at the end
    n = rint(xc * f64(_INV_LN2))
    r = (xc - n * f64(_LN2_HI)) - n * f64(_LN2_LO)
    p = tl.full(r.shape, _T13, tl.float64)  # Horner from 1/13! down to 1/0!, as the reference's loop
    p = horner(horner(horner(horner(horner(p, r, _T12), r, _T11), r, _T10), r, _T9), r, _T8)
    p = horner(horner(horner(horner(p, r, _T7), r, _T6), r, _T5), r, _T4)
    p = horner(horner(horner(horner(p, r, _T3), r, _T2), r, _T1), r, _T0)
    ni = n.to(tl.int64)
    h1 = ni >> 1  # floor(n / 2), as torch's `n // 2` (arithmetic shift)
    h2 = ni - h1
    pow2 = ((h1 + 1023) << 52).to(tl.float64, bitcast=True) * ((h2 + 1023) << 52).to(tl.float64, bitcast=True)
    return tl.where(x64 != x64, x64, p * pow2).to(tl.float32)


@triton.jit
def _sigmoid(x):
    return tl.div_rn(1.0, 1.0 + _exp(-x))


@triton.jit
def _elementwise_kernel(
    a_ptr, b_ptr, c_ptr, out_ptr, out2_ptr, N, sa, sb, sc, sout, OP: tl.constexpr, BLOCK_N: tl.constexpr
):
    # OP 0 swiglu_fwd(a=h, b=g); 1 swiglu_bwd(a=da, b=h, c=g); 2 gated_residual(a=x, b=gate, c=y);
    # 3 silu(a=x); 4 silu_bwd(a=dy, b=x)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    a = tl.load(a_ptr + r * sa + cols, mask=mask, other=0.0).to(tl.float32)
    if OP == 3:
        out = a * _sigmoid(a)
    else:
        b = tl.load(b_ptr + r * sb + cols, mask=mask, other=0.0).to(tl.float32)
        if OP == 0:
            out = a * (b * _sigmoid(b))
        elif OP == 4:
            s = _sigmoid(b)
            out = a * (s * (1.0 + b * (1.0 - s)))
        else:
            c = tl.load(c_ptr + r * sc + cols, mask=mask, other=0.0).to(tl.float32)
            if OP == 1:
                s = _sigmoid(c)
                out = a * (c * s)
                dg = (a * b) * (s * (1.0 + c * (1.0 - s)))
                tl.store(out2_ptr + r * sout + cols, dg.to(out2_ptr.dtype.element_ty), mask=mask)
            else:
                out = a + b * c
    tl.store(out_ptr + r * sout + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    op: int, operands: list[tuple[str, Tensor]], out_dtype: torch.dtype, outputs: int, node: str | None
) -> list[Tensor]:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} not supported; allowed: {list(OUT_DTYPES)}")
    shape = operands[0][1].shape
    for name, t in operands:
        if t.dim() != 2 or t.shape != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}; allowed: [R, N] like {operands[0][0]} {tuple(shape)}")
        if t.dtype not in IN_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} not supported; allowed: {list(IN_DTYPES)}")
    device = operands[0][1].device
    if any(t.device != device for _, t in operands):
        raise ValueError(f"operands on {sorted({str(t.device) for _, t in operands})}; allowed: one device")
    if device.type != "cuda" and not configs.interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors, got {device}; allowed: cuda (or TRITON_INTERPRET=1)")
    cfg = configs.pinned("elementwise", node if node is not None else configs.node_of(device))
    ts = [t if t.stride(1) == 1 else t.contiguous() for _, t in operands]  # rows may be strided (table slices)
    ts += [ts[0]] * (3 - len(ts))  # unused operand slots
    R, N = shape
    # two outputs side by side in one [R, 2N] buffer: the block's weight gradient of ff.net.0 then
    # reads [dh | dg] as one GEMM operand, no copy (h3lab.units.join)
    buf = torch.empty((R, outputs * N), dtype=out_dtype, device=device)
    outs = [buf[:, i * N : (i + 1) * N] for i in range(outputs)]
    if R and N:
        grid = (R, configs.cdiv(N, cfg["block_n"]))
        _elementwise_kernel[grid](
            *ts,
            outs[0],
            outs[-1],
            N,
            *(t.stride(0) for t in ts),
            buf.stride(0),
            OP=op,
            BLOCK_N=cfg["block_n"],
            num_warps=cfg["num_warps"],
            enable_fp_fusion=False,
        )
    return outs


def swiglu_fwd(h_RN: Tensor, g_RN: Tensor, out_dtype: torch.dtype, *, node: str | None = None) -> Tensor:
    """h * silu(g) = h * (g * sigmoid(g)), rounded once to `out_dtype`."""
    return _launch(0, [("h", h_RN), ("g", g_RN)], out_dtype, 1, node)[0]


def swiglu_bwd(
    da_RN: Tensor, h_RN: Tensor, g_RN: Tensor, out_dtype: torch.dtype, *, node: str | None = None
) -> tuple[Tensor, Tensor]:
    """(dh, dg) = (da * silu(g), (da * h) * silu'(g)), silu'(g) = s * (1 + g * (1 - s)); each rounded once.
    dh and dg are the two column halves of one [R, 2N] tensor."""
    dh, dg = _launch(1, [("da", da_RN), ("h", h_RN), ("g", g_RN)], out_dtype, 2, node)
    return dh, dg


def gated_residual(
    x_RD: Tensor, gate_RD: Tensor, y_RD: Tensor, out_dtype: torch.dtype, *, node: str | None = None
) -> Tensor:
    """x + gate * y in FP32, rounded once; `gate` may be a strided AdaLN table slice."""
    return _launch(2, [("x", x_RD), ("gate", gate_RD), ("y", y_RD)], out_dtype, 1, node)[0]


def silu(x_RN: Tensor, out_dtype: torch.dtype, *, node: str | None = None) -> Tensor:
    """x * sigmoid(x) in FP32, rounded once (the AdaLN input silu(temb), rows = timesteps)."""
    return _launch(3, [("x", x_RN)], out_dtype, 1, node)[0]


def silu_bwd(dy_RN: Tensor, x_RN: Tensor, *, node: str | None = None) -> Tensor:
    """dy * silu'(x), silu'(x) = s * (1 + x * (1 - s)), float32 (d temb)."""
    return _launch(4, [("dy", dy_RN), ("x", x_RN)], F32, 1, node)[0]


def round(x: Tensor, dtype: torch.dtype) -> Tensor:  # the Backend method's name; shadows builtins.round here
    """One round-to-nearest-even cast. On CUDA `x.to(bf16)` is RNE and elementwise (denormals kept);
    elsewhere (interpreter runs on CPU) the reference's integer rounding, as CPU casts may flush denormals."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"round: dtype {dtype} not supported; allowed: {list(OUT_DTYPES)}")
    return x.to(dtype) if x.device.type == "cuda" else round_to(x, dtype)


def variants(node: str) -> list[Variant]:
    """Every op of the kernel, bf16 operands and outputs."""
    cfg = configs.pinned("elementwise", node)
    types = {n: "*bf16" for n in ("a_ptr", "b_ptr", "c_ptr", "out_ptr", "out2_ptr")}
    ops = ("swiglu_fwd", "swiglu_bwd", "gated_residual", "silu", "silu_bwd")  # OP 0..4
    return [
        Variant(
            "elementwise", what, _elementwise_kernel, types, {"OP": op, "BLOCK_N": cfg["block_n"]}, options(cfg, False)
        )
        for op, what in enumerate(ops)
    ]
