"""IEEE floats as integers: exact decompositions, bit patterns, and rounding toward zero to FP32.

Everything here is torch int64 arithmetic (plus float64 only where a value is an exact integer
below 2^53), so a result is the same on any CPU or GPU: no BLAS, no library reduction, no
rounding that depends on the device.

A finite value is (-1)^sign * sig * 2^(exp - frac_bits): `sig` is the integer significand with the
hidden bit (in [2^frac_bits, 2^(frac_bits+1)) for normals, below 2^frac_bits for subnormals) and
`exp` the IEEE unbiased exponent (emin = 1 - bias for subnormals and zeros).

Dimension legend: any shape; every function is elementwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

I64 = torch.int64


@dataclass(frozen=True)
class Format:
    width: int  # bits of the storage
    exp_bits: int
    frac_bits: int  # stored fraction bits (the significand has frac_bits + 1)

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def emax(self) -> int:
        return self.bias


FORMATS = {
    torch.bfloat16: Format(16, 8, 7),
    torch.float16: Format(16, 5, 10),
    torch.float32: Format(32, 8, 23),
}
FP32 = FORMATS[torch.float32]
FP32_MAX_BITS = 0x7F7FFFFF
FP32_INF_BITS = 0x7F800000


def format_of(dtype: torch.dtype) -> Format:
    if dtype not in FORMATS:
        raise ValueError(f"no float format for {dtype}; allowed: {list(FORMATS)}")
    return FORMATS[dtype]


def bits(x: Tensor) -> Tensor:
    """The unsigned bit pattern of a bf16, fp16 or fp32 tensor, as int64."""
    fmt = format_of(x.dtype)
    view = x.contiguous().view(torch.int16 if fmt.width == 16 else torch.int32).to(I64)
    return view & ((1 << fmt.width) - 1)


def from_fields(sign: Tensor, field: Tensor, frac: Tensor, dtype: torch.dtype) -> Tensor:
    """The bf16, fp16 or fp32 values with these sign bits, biased exponent fields and fraction bits."""
    fmt = format_of(dtype)
    b = (sign.to(I64) << (fmt.width - 1)) | (field.to(I64) << fmt.frac_bits) | frac.to(I64)
    if fmt.width == 32:
        return fp32_from_bits(b)
    return (b - ((b & 0x8000) << 1)).to(torch.int16).view(dtype)


def fp32_from_bits(b: Tensor) -> Tensor:
    """FP32 tensor with the given unsigned 32-bit patterns (int64)."""
    b = b.to(I64) & 0xFFFFFFFF
    return (b - ((b & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


@dataclass(frozen=True)
class Parts:
    """A float tensor taken apart, elementwise (module docstring); the masks say which values are special."""

    sign: Tensor  # int64, 1 for a set sign bit
    sig: Tensor  # int64 significand, hidden bit included; 0 for zeros, infinities and NaNs
    exp: Tensor  # int64 unbiased exponent (emin for subnormals and zeros)
    zero: Tensor  # bool masks
    subnormal: Tensor
    inf: Tensor
    nan: Tensor


def decompose(x: Tensor) -> Parts:
    """`x` (bf16, fp16, fp32) as sign, integer significand and unbiased exponent, exactly."""
    fmt = format_of(x.dtype)
    b = bits(x)
    sign = (b >> (fmt.width - 1)) & 1
    field = (b >> fmt.frac_bits) & ((1 << fmt.exp_bits) - 1)
    frac = b & ((1 << fmt.frac_bits) - 1)
    top = (1 << fmt.exp_bits) - 1
    special = field == top
    normal = (field != 0) & ~special
    sig = torch.where(normal, frac | (1 << fmt.frac_bits), torch.where(special, torch.zeros_like(frac), frac))
    exp = torch.where(field == 0, torch.full_like(field, fmt.emin), field - fmt.bias)
    return Parts(
        sign=sign,
        sig=sig,
        exp=exp,
        zero=(field == 0) & (frac == 0),
        subnormal=(field == 0) & (frac != 0),
        inf=special & (frac == 0),
        nan=special & (frac != 0),
    )


def bit_length(n: Tensor) -> Tensor:
    """Bits of non-negative int64 values below 2^53 (0 for 0), exactly: such a value converts to
    float64 exactly and frexp returns its bit length (no check here: it would cost a GPU sync)."""
    _, e = torch.frexp(n.to(torch.float64))
    return torch.where(n == 0, torch.zeros_like(n), e.to(I64))


def shift(n: Tensor, s: Tensor) -> Tensor:
    """n * 2^s for non-negative int64 n, truncated toward zero where s < 0 (s clamped to [-63, 63])."""
    s = s.clamp(-63, 63)
    return torch.where(s >= 0, n << s.clamp(min=0), n >> (-s).clamp(min=0))


def fp32_rz_bits(sign: Tensor, mag: Tensor, unit: Tensor, *, subnormals: str, overflow: str) -> Tensor:
    """The FP32 bit pattern of (-1)^sign * mag * 2^unit rounded toward zero (int64 in, int64 out).

    mag: non-negative int64 below 2^53; unit: int64 exponent of one step of mag. `subnormals`:
    "keep" (the 2^-149 grid, truncated) or "flush" (to a zero of that sign). `overflow`: what a
    magnitude past FLT_MAX becomes, "max" (FLT_MAX, IEEE's toward-zero answer) or "inf". A zero
    magnitude gives a zero of `sign`.
    """
    if subnormals not in ("keep", "flush") or overflow not in ("max", "inf"):
        raise ValueError(f"subnormals={subnormals!r}, overflow={overflow!r}; allowed: keep|flush, max|inf")
    length = bit_length(mag)
    top = unit + length - 1  # the exponent of the leading bit
    sig = shift(mag, 24 - length)  # 24 significant bits, truncated
    normal = ((top + FP32.bias) << 23) | (sig - (1 << 23))
    tiny = shift(mag, unit + 149)  # the subnormal grid 2^-149, truncated
    tiny = tiny if subnormals == "keep" else torch.zeros_like(tiny)
    big = FP32_MAX_BITS if overflow == "max" else FP32_INF_BITS
    out = torch.where(top < FP32.emin, tiny, torch.where(top > FP32.emax, torch.full_like(top, big), normal))
    out = torch.where(mag == 0, torch.zeros_like(out), out)
    return out | (sign << 31)
