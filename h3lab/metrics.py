"""Comparison metrics: bit patterns, ULP distances, hashes and errors against the FP64 oracle.

Dimension legend: N elements (any shape; functions are elementwise unless they reduce).

Three numbers answer "are these the same?": byte equality, the count of differing elements and the
maximum ULP distance. ULPs use the monotone integer map of Dawson / numpy `nulp_diff`, computed in
int64 so bf16 and fp32 distances are exact. Conventions, chosen explicitly:
  * +0 and -0 are 0 ULP apart but are a byte difference (`bitwise_equal` is False, `num_differing` counts them);
  * two NaNs with identical bits are equal (0 ULP); one NaN, or two NaNs with different payloads, is a
    "NaN mismatch": counted separately and given the distance `NAN_MISMATCH` (-1) in ULP tensors;
  * so a NaN (or an Inf) compares equal to itself bit for bit: `compare` also counts the non-finite
    elements of each side (`nonfinite_a`, `nonfinite_b`), so a pass over NaNs is never silent.

The maximum ULP distance is set by the elements nearest zero: -0.0 against 0.0048 in fp32 is 1.0e9
ULP, because the distance counts every float in between. So `compare` also says how far the bits
drift where they can be read:
  * `sign_flips`: differing elements on opposite sides of zero, or with exactly one side zero; they
    are counted apart and left out of the percentiles;
  * `ulp_p50`, `ulp_p99`: nearest-rank percentiles of the ULP distance over the other differing
    elements (None when no element is left);
  * `max_ulp_at_rms`: max |a - b| in ULPs of the reference's typical exponent, the exponent of its
    RMS (a sign flip near zero moves this by a fraction of one ULP, an error in a large element by
    its true size at the tensor's scale).
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

# float dtype -> the signed integer of the same width that holds its bits
_BITS_DTYPE = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
FLOAT_DTYPES = tuple(_BITS_DTYPE)
INT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
NAN_MISMATCH = -1  # ULP-tensor sentinel for an element whose NaN-ness or NaN payload differs
_INT64_MAX = torch.iinfo(torch.int64).max
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}  # stored bits


def _check_float(t: Tensor, what: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: dtype {t.dtype} not supported; allowed: {list(FLOAT_DTYPES)}")


def _check_pair(a: Tensor, b: Tensor) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"dtype mismatch: a is {a.dtype}, b is {b.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: a is {list(a.shape)}, b is {list(b.shape)}")


def _same_device(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    a, b = a.detach(), b.detach()
    if a.device != b.device:  # e.g. a GPU result against a stored CPU reference
        a, b = a.cpu(), b.cpu()
    return a, b


def bit_pattern(t: Tensor) -> Tensor:
    """The raw bits as a same-width signed int view (bf16/fp16 -> int16, fp32 -> int32, fp64 -> int64).

    Integer and bool tensors are returned as they are.
    """
    if t.dtype in _BITS_DTYPE:
        return t.view(_BITS_DTYPE[t.dtype])
    if t.dtype in INT_DTYPES:
        return t
    raise ValueError(f"bit_pattern: dtype {t.dtype} not supported; allowed: {list(FLOAT_DTYPES + INT_DTYPES)}")


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Same dtype, same shape and the same bits everywhere.

    Stricter than `torch.equal` on floats: +0 vs -0 is NOT equal, NaNs with different payloads are
    NOT equal, and identical NaNs ARE equal.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = _same_device(a, b)
    return torch.equal(bit_pattern(a), bit_pattern(b))


def ordered_int(t: Tensor) -> Tensor:
    """int64 map that is monotone in the float order, with adjacent floats exactly 1 apart.

    Positive floats map to their magnitude bits, negative floats to minus them, so +0 and -0 both map
    to 0 and the smallest subnormals of either sign are -1 and +1. NaNs map beyond +-inf (meaningless
    as distances; `ulp_distance` handles them).
    """
    _check_float(t, "ordered_int")
    bits_N = bit_pattern(t.detach()).to(torch.int64)
    magnitude_N = bits_N & torch.iinfo(_BITS_DTYPE[t.dtype]).max  # clear the sign bit
    return torch.where(bits_N < 0, -magnitude_N, magnitude_N)


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise int64 |ordered_int(a) - ordered_int(b)|; `NAN_MISMATCH` (-1) where NaNs disagree.

    A NaN mismatch is an element where exactly one side is NaN, or both are NaN with different bits;
    identical NaNs are 0 apart. +0 vs -0 is 0. Exact for bf16, fp16 and fp32; for fp64 a distance
    between values of opposite sign can exceed int64 and saturates at 2**63 - 1.
    """
    _check_float(a, "ulp_distance")
    _check_pair(a, b)
    a, b = _same_device(a, b)
    ia_N, ib_N = ordered_int(a), ordered_int(b)
    hi_N, lo_N = torch.maximum(ia_N, ib_N), torch.minimum(ia_N, ib_N)
    # hi - lo overflows only when lo < 0 and hi > INT64_MAX + lo; clamping hi there saturates without overflow
    dist_N = torch.minimum(hi_N, _INT64_MAX + lo_N.clamp(max=0)) - lo_N
    return torch.where(_nan_mismatch(a, b), NAN_MISMATCH, dist_N)


def _nan_mismatch(a: Tensor, b: Tensor) -> Tensor:
    nan_a, nan_b = a.isnan(), b.isnan()
    return (nan_a != nan_b) | (nan_a & nan_b & (bit_pattern(a) != bit_pattern(b)))


def count_nonfinite(t: Tensor) -> int:
    """How many elements of a float tensor are NaN or +-Inf (0 for integer tensors); a host sync."""
    if not t.dtype.is_floating_point:
        return 0
    return int((~torch.isfinite(t.detach())).sum())


def ulp_map(a: Tensor, b: Tensor) -> Tensor:
    """`ulp_distance(a, b)`: int64 distances in the shape of `a`, for heatmaps (-1 marks NaN mismatches)."""
    return ulp_distance(a, b)


def sha256_tensor(t: Tensor) -> str:
    """Hex sha256 of the tensor's raw bytes in row-major order, as in memory (little-endian)."""
    assert sys.byteorder == "little", "hashes are defined on little-endian bytes"
    if t.dtype not in FLOAT_DTYPES + INT_DTYPES:
        raise ValueError(f"sha256_tensor: dtype {t.dtype} not supported; allowed: {list(FLOAT_DTYPES + INT_DTYPES)}")
    bytes_N = t.detach().cpu().reshape(-1).view(torch.uint8)  # reshape copies strided tensors row-major
    return hashlib.sha256(bytes_N.numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class Comparison:
    """One tensor against another: byte equality, differing-element count, max ULP, hashes."""

    name: str | None
    dtype: str
    shape: list[int]
    bitwise_equal: bool
    num_elements: int
    num_differing: int  # elements whose bit patterns differ (includes +-0 and NaN mismatches)
    frac_differing: float
    max_ulp: int  # over elements that are not NaN mismatches; 0 when bitwise equal
    nan_mismatches: int
    nonfinite_a: int  # NaN or +-Inf elements of a: equal bits there say nothing about the values
    nonfinite_b: int
    first_diff: int | None  # flat row-major index of the first differing element
    first_diff_index: list[int] | None  # the same element as a multi-dimensional index
    sha256_a: str
    sha256_b: str
    sign_flips: int = 0  # differing elements across zero (opposite signs, or one side zero)
    ulp_p50: int | None = None  # over differing elements of one sign; None when there are none
    ulp_p99: int | None = None
    max_abs_diff: float = 0.0  # over elements finite on both sides
    ref_rms: float | None = None  # RMS of b's finite elements (computed when bits differ)
    max_ulp_at_rms: float | None = 0.0  # max_abs_diff / one ULP at the exponent of ref_rms; None: b is all zero

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: odd, so every position's weight is odd
_CHUNK = 1 << 26


def digest(t: Tensor) -> str:
    """sha256 of the bytes on CPU; on CUDA `checksum64` computed on the GPU (65 GB of a 50-block
    chain's weight gradients in seconds, against minutes of sha256 on one CPU core)."""
    return "sha256:" + sha256_tensor(t) if t.device.type != "cuda" else checksum64(t)


def checksum64(t: Tensor) -> str:
    """Two positional checksums sum_i (bits_i + 2^16) * w_i mod 2^64, with odd weights w_i.

    Integer sums are exact in any order, so the value is deterministic on any device; one changed
    element always changes both (its term changes by an odd multiple of a nonzero delta < 2^17).
    """
    bits = bit_pattern(t.detach().contiguous()).view(-1)
    sums = [torch.zeros((), dtype=torch.int64, device=t.device) for _ in range(2)]
    for lo in range(0, bits.numel(), _CHUNK):
        b = bits[lo : lo + _CHUNK].to(torch.int64) + (1 << 16)
        i = torch.arange(lo, lo + b.numel(), dtype=torch.int64, device=t.device)
        for j, s in enumerate(sums):
            w = (i * _GOLDEN + (2 * j + 1) * 0x5BD1E995) | 1
            s.add_((b * w).sum())
    return f"gpu64:{t.dtype}:{list(t.shape)}:" + ":".join(f"{int(s) & (2**64 - 1):016x}" for s in sums)


def compare(a: Tensor, b: Tensor, name: str | None = None) -> Comparison:
    """Compare two float tensors of the same dtype and shape (raises `ValueError` otherwise)."""
    _check_float(a, f"compare({name!r})" if name else "compare")
    _check_pair(a, b)
    a, b = _same_device(a, b)
    differs_N = (bit_pattern(a) != bit_pattern(b)).reshape(-1)
    dist_N = ulp_distance(a, b).reshape(-1)
    num_differing = int(differs_N.sum())
    first = int(differs_N.nonzero()[0, 0]) if num_differing else None
    drift = drift_stats(a.reshape(-1), b.reshape(-1), differs_N, dist_N) if num_differing else {}
    return Comparison(
        name=name,
        dtype=str(a.dtype).removeprefix("torch."),
        shape=list(a.shape),
        bitwise_equal=num_differing == 0,
        num_elements=a.numel(),
        num_differing=num_differing,
        frac_differing=num_differing / a.numel() if a.numel() else 0.0,
        max_ulp=_max_ulp(dist_N),
        nan_mismatches=int((dist_N == NAN_MISMATCH).sum()),
        nonfinite_a=count_nonfinite(a),
        nonfinite_b=count_nonfinite(b),
        first_diff=first,
        first_diff_index=None if first is None else [int(i) for i in torch.unravel_index(torch.tensor(first), a.shape)],
        sha256_a=sha256_tensor(a),
        sha256_b=sha256_tensor(b),
        **drift,
    )


def sign_flips(a: Tensor, b: Tensor, differs: Tensor) -> Tensor:
    """Where bits differ and the values lie on two sides of zero (one of them may be zero): their ULP
    distance counts every float around zero and says nothing about size. +0 against -0 is not a flip
    (0 ULP, a byte difference only), nor is a NaN."""
    same_side = ((a > 0) & (b > 0)) | ((a < 0) & (b < 0)) | ((a == 0) & (b == 0))
    return differs & ~same_side & ~a.isnan() & ~b.isnan()


def drift_stats(a_N: Tensor, b_N: Tensor, differs_N: Tensor, dist_N: Tensor) -> dict[str, Any]:
    """How far differing bits drift, readable where the maximum ULP is not (the module's docstring).

    Args:
        a_N, b_N: the two tensors, flat, same dtype and device; b is the reference.
        differs_N: where their bit patterns differ.
        dist_N: `ulp_distance(a_N, b_N)`.

    Returns:
        The `Comparison` fields sign_flips, ulp_p50, ulp_p99, max_abs_diff, ref_rms, max_ulp_at_rms.
    """
    nan_N = a_N.isnan() | b_N.isnan()
    flips_N = sign_flips(a_N, b_N, differs_N)
    readable_N = dist_N[differs_N & ~nan_N & ~flips_N]
    finite_N = a_N.isfinite() & b_N.isfinite()
    diff_N = (a_N[finite_N].to(torch.float64) - b_N[finite_N].to(torch.float64)).abs()
    max_abs = float(diff_N.max()) if diff_N.numel() else 0.0
    ref_N = b_N[b_N.isfinite()].to(torch.float64)
    rms = float(torch.linalg.vector_norm(ref_N) / ref_N.numel() ** 0.5) if ref_N.numel() else 0.0
    return {
        "sign_flips": int(flips_N.sum()),
        "ulp_p50": _nearest_rank(readable_N, 0.50),
        "ulp_p99": _nearest_rank(readable_N, 0.99),
        "max_abs_diff": max_abs,
        "ref_rms": rms,
        "max_ulp_at_rms": max_abs / ulp_at(rms, a_N.dtype) if rms > 0 else None,
    }


def ulp_at(x: float, dtype: torch.dtype) -> float:
    """One ULP of `dtype` at the binade of |x| > 0 (subnormal spacing below the smallest normal)."""
    _check_float(torch.empty(0, dtype=dtype), "ulp_at")
    if not (math.isfinite(x) and x != 0):
        raise ValueError(f"ulp_at: x={x!r}; allowed: a finite nonzero number")
    exponent = max(math.floor(math.log2(abs(x))), math.frexp(torch.finfo(dtype).tiny)[1] - 1)
    return math.ldexp(1.0, exponent - MANTISSA_BITS[dtype])


def _nearest_rank(values_N: Tensor, q: float) -> int | None:
    """The nearest-rank q-quantile (an element of values_N), None for no values."""
    n = values_N.numel()
    return int(values_N.kthvalue(max(1, math.ceil(q * n))).values) if n else None


def error_stats(t: Tensor, ref_f64: Tensor) -> dict[str, float | int]:
    """Errors of `t` against the FP64 oracle's `ref_f64`, computed in float64.

    max_abs: max |t - ref|; rel_l2: ||t - ref||_2 / ||ref||_2; max_rel: max |t - ref| / max |ref|
    (both relative errors are 0 when t == ref and inf when only ref is zero);
    max_ulp_vs_rounded_ref: max ULP distance of t from ref rounded (nearest-even) to t's dtype, over
    elements that are not NaN mismatches; nan_mismatches: count of those.
    """
    _check_float(t, "error_stats")
    if ref_f64.dtype != torch.float64:
        raise ValueError(f"error_stats: reference dtype {ref_f64.dtype}; allowed: [torch.float64]")
    if t.shape != ref_f64.shape:
        raise ValueError(f"shape mismatch: t is {list(t.shape)}, reference is {list(ref_f64.shape)}")
    t, ref_f64 = _same_device(t, ref_f64)
    diff_N = t.to(torch.float64) - ref_f64
    max_abs = float(diff_N.abs().max()) if diff_N.numel() else 0.0
    dist_N = ulp_distance(t, ref_f64.to(t.dtype))
    return {
        "max_abs": max_abs,
        "rel_l2": _ratio(float(torch.linalg.vector_norm(diff_N)), float(torch.linalg.vector_norm(ref_f64))),
        "max_rel": _ratio(max_abs, float(ref_f64.abs().max()) if ref_f64.numel() else 0.0),
        "max_ulp_vs_rounded_ref": _max_ulp(dist_N),
        "nan_mismatches": int((dist_N == NAN_MISMATCH).sum()),
    }


def _max_ulp(dist_N: Tensor) -> int:
    # NAN_MISMATCH (-1) never exceeds a real distance; the clamp gives 0 when every element is one
    return max(int(dist_N.max()), 0) if dist_N.numel() else 0


def _ratio(num: float, den: float) -> float:
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den
