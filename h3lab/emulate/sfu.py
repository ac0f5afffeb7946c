"""The attention kernels' approximate FP32 instructions on sm90, bit for bit: what an H200 returns.

- `ex2_approx_ftz(x)`: ex2.approx.ftz.f32 (tl.math.exp2; one MUFU.EX2). x is cut to a fixed-point
  number with 23 fraction bits: q = floor(|x| * 2^23), its magnitude truncated (|x| >= 2^8
  saturates). For x >= 0, or x < 0 with q's fraction 0, the point is F = +-q; for any other x < 0 it
  is F = -q - 1 (the fraction's one's complement: the unit reads -q 2^-23 as (-q - 1) 2^-23). Then
  ex2 = 2^(F >> 23) * mufu("ex2", F mod 2^23); a result below 2^-126 flushes to +0, one past FLT_MAX
  is +inf; a subnormal x reads as 0 (ex2 = 1); -inf gives +0, NaN the canonical NaN.
- `rcp_approx_ftz(x)`: rcp.approx.ftz.f32 (MUFU.RCP): +-2^-e(x) * mufu("rcp", x's 23 fraction bits),
  a result below 2^-126 flushed to a zero of x's sign; zeros and subnormals give +-inf, +-inf +-0.
- `div_full(a, b)`: div.full.f32 (tl's `/` of FP32, attention_fwd's o = acc / l), as ptxas' sm90
  sequence computes it: s = 1/4 where |b| > 2^126, 2^24 where |b| < 2^-126, else 1; then
  (a * s) * rcp_approx_ftz(b * s) with IEEE FP32 multiplies (no flush).
- `log2_libdevice(x)`: tl.math.log2, which is libdevice's __nv_log2f inlined (no MUFU.LG2): the PTX
  sequence Triton 3.6 emits (h3lab.bench.ptx_audit), step for step in IEEE FP32 operations.

Every rule was read off the H200's answers to h3lab.bench.sfu_probe: the functions reproduce the
sha256 of every saved set (the ex2 grids, edges and samples, rcp on every significand, the div and log2
samples); `sfu_probe`'s model check compares them with the hardware over all 2^32 inputs in place.
Every NaN result is NVIDIA's canonical 0x7FFFFFFF, whatever the input NaN's bits. Integer steps, and
float64 steps only where they are exact (the FMA: h3lab.emulate.fma).

Dimension legend: any shape; every function is elementwise (FP32 in, FP32 out).
"""

from __future__ import annotations

import torch
from torch import Tensor

from h3lab.emulate import floats
from h3lab.emulate.fma import fma_f32, fma_f32_ftz
from h3lab.emulate.mufu import interpolate

I64 = torch.int64
NAN_BITS = 0x7FFFFFFF  # NVIDIA's canonical NaN
TINY, HUGE = 2.0**-126, 2.0**126
M23 = (1 << 23) - 1


def _check(name: str, *xs: Tensor) -> None:
    for x in xs:
        if x.dtype != torch.float32:
            raise ValueError(f"{name}: input of dtype {x.dtype}; allowed: torch.float32")


def _pack(sign: Tensor, field: Tensor, sig: Tensor) -> Tensor:
    """FP32 bits of (sign, biased exponent field, 24-bit significand): field <= 0 gives a zero of the sign
    (FTZ), field >= 255 an infinity."""
    out = (field.clamp(1, 254) << 23) | (sig & M23)
    out = torch.where(field <= 0, 0, torch.where(field >= 255, floats.FP32_INF_BITS, out))
    return out | (sign << 31)


def _fields(x_f32: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(sign bit, biased exponent field, 23 fraction bits) of FP32 x, int64."""
    b = floats.bits(x_f32)
    return b >> 31, (b >> 23) & 0xFF, b & M23


def ex2_approx_ftz(x_f32: Tensor) -> Tensor:
    """FP32 ex2.approx.ftz.f32 of x (module docstring)."""
    _check("ex2_approx_ftz", x_f32)
    sign, field, frac = _fields(x_f32)
    sig = torch.where(field == 0, 0, frac | (1 << 23))  # a subnormal x reads as 0
    e = field - floats.FP32.bias
    q = torch.where(e >= 0, sig << e.clamp(0, 7), sig >> (-e).clamp(0, 63))
    q = torch.where(e >= 8, 1 << 31, q)  # |x| >= 256: past both ends of the range
    F = torch.where(sign == 1, torch.where((q & M23) == 0, -q, -q - 1), q)
    out = _pack(torch.zeros_like(F), (F >> 23) + floats.FP32.bias, interpolate("ex2", F & M23))
    out = torch.where(field == 0xFF, torch.where(frac != 0, NAN_BITS, torch.where(sign == 1, 0, out)), out)
    return floats.fp32_from_bits(out)


def rcp_approx_ftz(x_f32: Tensor) -> Tensor:
    """FP32 rcp.approx.ftz.f32 of x (module docstring)."""
    _check("rcp_approx_ftz", x_f32)
    sign, field, frac = _fields(x_f32)
    y = interpolate("rcp", frac)  # (2^23, 2^24]: units of 2^-24
    one = y == 1 << 24
    out = _pack(sign, 2 * floats.FP32.bias - field - 1 + one.to(I64), torch.where(one, 1 << 23, y))
    out = torch.where(field == 0, floats.FP32_INF_BITS | (sign << 31), out)  # zeros and subnormals
    out = torch.where(field == 0xFF, torch.where(frac != 0, NAN_BITS, sign << 31), out)
    return floats.fp32_from_bits(out)


def mul_f32(x: Tensor, y: Tensor) -> Tensor:
    """IEEE FP32 x * y, rounded to nearest even once (no flush); NaN results canonical (FMUL)."""
    out = (x.to(torch.float64) * y.to(torch.float64)).to(torch.float32)  # the product is exact in float64
    return torch.where(torch.isnan(out), _f32(NAN_BITS, out), out)


def div_full(a_f32: Tensor, b_f32: Tensor) -> Tensor:
    """FP32 div.full.f32 a / b as sm90 computes it (module docstring); a, b broadcast."""
    _check("div_full", a_f32, b_f32)
    mag = b_f32.abs()
    scale = torch.where(mag > HUGE, 0.25, torch.where(mag < TINY, 2.0**24, 1.0)).to(torch.float32)
    return mul_f32(mul_f32(a_f32, scale), rcp_approx_ftz(mul_f32(b_f32, scale)))


# libdevice __nv_log2f as Triton 3.6 inlines it (PTX, sm90): m = x's significand reduced to
# [sqrt(1/2), sqrt(2)) by integer steps, t = m - 1, log2(x) = e + t * p(t) with p of degree 10 in
# fma.rn.ftz steps; the constants are the PTX's bit patterns
LOG2_REDUCE = 0x3F3504F3  # bits of 0.70710677
LOG2_POLY = (0x3DC6B27F, 0xBE2C7F30, 0x3E2FCF2A, 0xBE374E43, 0x3E520BF4, 0xBE763C8B, 0x3E93BF99, 0xBEB8AA49)
LOG2_POLY += (0x3EF6384A, 0xBF38AA3B)
LOG2_LINEAR = 0x3FB8AA3B  # bits of 1/ln 2


def _f32(b: int, like: Tensor) -> Tensor:
    """The FP32 constant with bit pattern b, as a 0-dim tensor on like's device (it broadcasts)."""
    return floats.fp32_from_bits(torch.tensor(b, dtype=I64, device=like.device))


def log2_libdevice(x_f32: Tensor) -> Tensor:
    """FP32 tl.math.log2(x): libdevice's __nv_log2f, step for step (module docstring and LOG2_*)."""
    _check("log2_libdevice", x_f32)
    small = x_f32 < TINY  # negative, zero and subnormal x (a float compare: NaN is not small)
    r1 = torch.where(small, mul_f32(x_f32, _f32(0x4B000000, x_f32)), x_f32)  # * 2^23
    b1 = floats.bits(r1)
    e_bits = ((b1 - LOG2_REDUCE) & 0xFF800000) & 0xFFFFFFFF  # the exponent part, as int32 bits
    m = floats.fp32_from_bits(b1 - e_bits)
    e_int = torch.where(e_bits >= 1 << 31, e_bits - (1 << 32), e_bits).to(torch.float32)  # exact
    e = fma_f32_ftz(e_int, _f32(0x34000000, x_f32), torch.where(small, -23.0, 0.0).to(torch.float32))
    one = _f32(0x3F800000, x_f32)
    t = fma_f32(m, one, -one)  # add.f32: m - 1
    p = _f32(LOG2_POLY[0], x_f32)
    for c in LOG2_POLY[1:]:
        p = fma_f32_ftz(p, t, _f32(c, x_f32))
    tail = mul_f32(t, mul_f32(t, p))
    y = fma_f32(e, one, fma_f32_ftz(t, _f32(LOG2_LINEAR, x_f32), tail))  # add.f32
    inf = _f32(floats.FP32_INF_BITS, x_f32)
    y = torch.where(b1 >= floats.FP32_INF_BITS, fma_f32_ftz(r1, inf, inf), y)  # inf, NaN, x < 0
    return torch.where(r1 == 0, -inf, torch.where(torch.isnan(y), _f32(NAN_BITS, x_f32), y))  # log2(+-0) = -inf
