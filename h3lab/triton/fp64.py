"""The float64 steps the references in h3lab.ops.fixed take, as Triton helpers (exp, sin/cos).

Each is one IEEE operation per torch op of the reference, so a kernel built from them gives the
reference's bits. Float64 literals go through `f64`: a bare Python float in a Triton kernel may
become a float32 constant first. Kernels using these launch with `enable_fp_fusion=False`, as the
reference's separate torch ops never fuse a multiply-add.
"""

from __future__ import annotations

import triton
import triton.language as tl

ROUND_MAGIC = tl.constexpr(1.5 * 2.0**52)  # (t + M) - M is t rounded half-to-even for |t| < 2^51


@triton.jit
def f64(value: tl.constexpr):
    return tl.full((), value, tl.float64)


@triton.jit
def horner(p, r, c: tl.constexpr):
    return p * r + f64(c)  # a separate multiply and add, as torch's `p * r + c`


@triton.jit
def rint(t):
    """torch.round of float64 t, |t| < 2^51: half to even, and a zero result keeps t's sign
    (round(-0.3) = -0), which decides the sign of a reduced argument r = x - n * c when x = -0."""
    n = (t + f64(ROUND_MAGIC)) - f64(ROUND_MAGIC)
    return tl.where(n == 0.0, t * f64(0.0), n)
