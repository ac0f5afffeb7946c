"""h3lab.metrics: bit patterns, ULP distances, NaN accounting, hashes, Comparison, error_stats."""

import hashlib
import json

import numpy as np
import pytest
import torch
from numpy.testing._private.utils import nulp_diff  # numpy's Dawson-style ULP count (not re-exported)

from h3lab.metrics import (
    NAN_MISMATCH,
    bit_pattern,
    bitwise_equal,
    compare,
    error_stats,
    ordered_int,
    sha256_tensor,
    ulp_at,
    ulp_distance,
    ulp_map,
)

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
INF = float("inf")


def _spread(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """n random nonzero values of both signs over many binades, subnormals included."""
    gen = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    # randn stays below 2**4 in magnitude, so the top binades are reached without overflowing to inf
    exponents = torch.randint(int(np.log2(info.tiny)) - 4, int(np.log2(info.max)) - 4, (n,), generator=gen)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.pow(2.0, exponents.double())
    x = x.to(dtype)
    assert x.isfinite().all()
    return torch.where(x == 0, torch.finfo(dtype).tiny, x)  # subnormals that rounded to 0: keep nonzero


def _step(x: torch.Tensor, toward: float, times: int) -> torch.Tensor:
    for _ in range(times):
        x = torch.nextafter(x, torch.full_like(x, toward))
    return x


@pytest.mark.parametrize("dtype", FLOATS)
def test_nextafter_neighbours_are_one_ulp_apart(dtype: torch.dtype) -> None:
    x = _spread(4096, dtype, seed=1)
    up, down = _step(x, INF, 1), _step(x, -INF, 1)
    assert (ulp_distance(x, up) == 1).all()
    assert (ulp_distance(down, x) == 1).all()
    assert (ulp_distance(down, up) == 2).all()
    assert (ulp_distance(x, _step(x, INF, 5)) == 5).all()
    assert ulp_distance(x, x).eq(0).all()


@pytest.mark.parametrize("dtype", FLOATS)
def test_distances_across_zero(dtype: torch.dtype) -> None:
    zero = torch.zeros(1, dtype=dtype)
    smallest = _step(zero, INF, 1)  # smallest positive subnormal
    assert smallest.item() > 0
    assert ulp_distance(smallest, -smallest).item() == 2
    assert ulp_distance(smallest, zero).item() == 1
    assert ulp_distance(-smallest, -zero).item() == 1
    assert ordered_int(-smallest).item() == -1 and ordered_int(-zero).item() == 0


@pytest.mark.parametrize("dtype", FLOATS)
def test_ordered_int_is_monotone(dtype: torch.dtype) -> None:
    x = torch.cat([_spread(2048, dtype, seed=2), torch.tensor([0.0, -0.0, INF, -INF], dtype=dtype)])
    ordered = ordered_int(x.sort().values)
    assert ordered.dtype == torch.int64
    assert (ordered.diff() >= 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_ulp_distance_matches_numpy_nulp_diff(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    a = _spread(1024, dtype, seed=4)
    # same-sign neighbours a few hundred ULP away: numpy's width-limited arithmetic is exact there
    b = (a.double() * (1 + 1e-3 * torch.rand(1024, generator=gen, dtype=torch.float64))).to(dtype)
    want = nulp_diff(a.numpy(), b.numpy())[0]
    assert torch.equal(ulp_distance(a, b), torch.from_numpy(want.astype(np.int64)))


def test_signed_zeros_are_zero_ulp_but_not_bitwise_equal() -> None:
    gen = torch.Generator().manual_seed(5)
    for dtype in FLOATS:
        a = torch.randn(64, generator=gen).to(dtype)
        a[7] = 0.0
        b = a.clone()
        b[7] = -0.0
        assert not bitwise_equal(a, b)
        assert torch.equal(a, b)  # why the bit compare is needed
        c = compare(a, b)
        assert (c.bitwise_equal, c.num_differing, c.max_ulp, c.first_diff) == (False, 1, 0, 7)


def test_nan_accounting() -> None:
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(100, generator=gen)
    b = _step(a, INF, 3)
    quiet = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    payload = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    a[10], b[10] = quiet, quiet  # identical NaNs: equal, 0 ULP
    a[20] = quiet  # NaN on one side only
    b[30] = payload  # NaN on the other side only
    a[40], b[40] = quiet, payload  # both NaN, different payloads
    dist = ulp_distance(a, b)
    assert dist[10] == 0 and dist[20] == dist[30] == dist[40] == NAN_MISMATCH
    others = torch.ones(100, dtype=torch.bool)
    others[[10, 20, 30, 40]] = False
    assert (dist[others] == 3).all()
    c = compare(a, b)
    assert (c.nan_mismatches, c.num_differing, c.max_ulp) == (3, 99, 3)
    only_nans = compare(torch.full((4,), float("nan")), torch.zeros(4))
    assert (only_nans.nan_mismatches, only_nans.max_ulp) == (4, 0)


def test_huge_distances_are_exact_in_int64() -> None:
    f32, bf16 = torch.finfo(torch.float32), torch.finfo(torch.bfloat16)
    big = torch.tensor([f32.max], dtype=torch.float32)
    assert ulp_distance(-big, big).item() == 2 * 0x7F7FFFFF
    assert ulp_distance(torch.tensor([-INF]), torch.tensor([INF])).item() == 2 * 0x7F800000
    big_bf16 = torch.tensor([bf16.max], dtype=torch.bfloat16)
    assert ulp_distance(-big_bf16, big_bf16).item() == 2 * 0x7F7F  # beyond int16
    assert ulp_distance(big, torch.tensor([INF])).item() == 1
    one = torch.tensor([1.0], dtype=torch.float64)
    assert ulp_distance(-one, one).item() == 2 * 0x3FF0000000000000
    # fp64 opposite-sign distances past 2**63 - 1 saturate instead of wrapping
    huge = torch.tensor([torch.finfo(torch.float64).max], dtype=torch.float64)
    assert ulp_distance(-huge, huge).item() == torch.iinfo(torch.int64).max


def test_compare_counts_planted_differences_exactly() -> None:
    gen = torch.Generator().manual_seed(7)
    for dtype in FLOATS:
        a = torch.randn(6, 50, 33, generator=gen).to(dtype)
        b = a.clone()
        flat = torch.randperm(a.numel(), generator=gen)[:11].sort().values
        steps = torch.randint(1, 40, (11,), generator=gen)
        for i, k in zip(flat.tolist(), steps.tolist(), strict=True):
            b.view(-1)[i] = _step(a.view(-1)[i : i + 1], INF, k)
        c = compare(a, b, name="planted")
        assert c.num_differing == 11 and c.nan_mismatches == 0
        assert c.max_ulp == int(steps.max())
        assert c.first_diff == int(flat[0])
        assert c.first_diff_index == list(np.unravel_index(int(flat[0]), a.shape))
        assert c.frac_differing == 11 / a.numel()
        assert not c.bitwise_equal and c.sha256_a != c.sha256_b
        assert torch.equal(ulp_map(a, b).view(-1)[flat], steps)
        assert json.loads(json.dumps(c.to_dict()))["name"] == "planted"


def test_compare_equal_tensors() -> None:
    a = torch.randn(5, 7, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    c = compare(a, a.clone())
    assert c.bitwise_equal and c.num_differing == 0 and c.max_ulp == 0 and c.first_diff is None
    assert c.first_diff_index is None and c.sha256_a == c.sha256_b
    assert c.to_dict()["shape"] == [5, 7] and c.dtype == "bfloat16"


def test_mismatched_inputs_raise_naming_both() -> None:
    a = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"torch.float32.*torch.float64"):
        compare(a, a.double())
    with pytest.raises(ValueError, match=r"\[3, 4\].*\[4, 3\]"):
        compare(a, a.t().contiguous())
    with pytest.raises(ValueError, match="allowed"):
        bit_pattern(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="allowed"):
        compare(torch.arange(3), torch.arange(3))
    assert not bitwise_equal(a, a.double()) and not bitwise_equal(a, a[:2])


def test_bit_pattern_widths() -> None:
    want = [torch.int16, torch.int16, torch.int32, torch.int64]
    for dtype, int_dtype in zip(FLOATS, want, strict=True):
        assert bit_pattern(torch.ones(2, dtype=dtype)).dtype == int_dtype
    ints = torch.arange(5)
    assert bit_pattern(ints) is ints
    assert bit_pattern(torch.tensor([-0.0])).item() == -(2**31)


def test_sha256_tracks_every_bit() -> None:
    a = torch.randn(257, generator=torch.Generator().manual_seed(9))
    assert sha256_tensor(a) == hashlib.sha256(a.numpy().tobytes()).hexdigest()
    flipped = a.clone()
    flipped.view(torch.int32)[100] ^= 1  # lowest mantissa bit
    assert sha256_tensor(flipped) != sha256_tensor(a)
    m = a[:256].view(16, 16)
    assert sha256_tensor(m.t()) == sha256_tensor(m.t().contiguous())  # row-major order, not storage
    assert len({sha256_tensor(a.to(d)) for d in FLOATS}) == 4


def test_error_stats_against_fp64_reference() -> None:
    ref = torch.randn(40, 30, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    for dtype in [torch.bfloat16, torch.float32]:
        rounded = ref.to(dtype)
        stats = error_stats(rounded, ref)
        assert stats["max_ulp_vs_rounded_ref"] == 0 and stats["nan_mismatches"] == 0
        assert 0 < stats["max_rel"] <= torch.finfo(dtype).eps
        off = rounded.clone()
        off[3, 4] = _step(off[3, 4:5], INF, 2)
        stats = error_stats(off, ref)
        diff = off.double() - ref
        assert stats["max_ulp_vs_rounded_ref"] == 2
        assert stats["max_abs"] == diff.abs().max().item()
        assert stats["rel_l2"] == pytest.approx((diff.norm() / ref.norm()).item(), rel=1e-12)
    assert error_stats(ref, ref) == {
        "max_abs": 0.0,
        "rel_l2": 0.0,
        "max_rel": 0.0,
        "max_ulp_vs_rounded_ref": 0,
        "nan_mismatches": 0,
    }
    with pytest.raises(ValueError, match="float64"):
        error_stats(ref.float(), ref.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_drift_counts_sign_flips_apart_and_reads_the_rest(dtype: torch.dtype) -> None:
    """A sign flip near zero sets the max ULP; the percentiles and the error at the RMS are read without it."""
    gen = torch.Generator().manual_seed(11)
    b = torch.randn(4000, generator=gen).to(dtype)
    b[b == 0] = 1.0  # keep every element on one side of zero
    a = b.clone()
    idx = torch.randperm(b.numel(), generator=gen)[:103]
    ulps = [1] * 60 + [2] * 30 + [5] * 10  # 100 readable differences: p50 1, p99 5
    for i, k in zip(idx[:100].tolist(), ulps, strict=True):
        a[i] = _step(b[i : i + 1], INF if b[i] > 0 else -INF, k)  # away from zero: never crosses it
    tiny, small = torch.finfo(dtype).tiny, ulp_at(1.0, dtype) / 4  # small: a quarter ULP at the tensor's scale
    b[idx[100]], a[idx[100]] = small, -0.0  # opposite signs, one of them zero
    b[idx[101]], a[idx[101]] = tiny, -tiny  # opposite signs, both nonzero
    b[idx[102]], a[idx[102]] = -0.0, 0.0  # +0 against -0: 0 ULP, not a flip
    c = compare(a, b)
    assert c.num_differing == 103 and c.sign_flips == 2
    assert c.max_ulp > 10_000  # the flip across zero (bf16 15k, fp32 8.6e8), unreadable as a size
    assert (c.ulp_p50, c.ulp_p99) == (1, 5)
    diff = (a.double() - b.double()).abs()
    assert c.max_abs_diff == diff.max().item()
    rms = b.double().square().mean().sqrt().item()
    assert c.ref_rms == pytest.approx(rms, rel=1e-12)
    one_ulp = 2.0 ** (np.floor(np.log2(rms)) - {torch.bfloat16: 7, torch.float32: 23}[dtype])
    assert c.max_ulp_at_rms == pytest.approx(diff.max().item() / one_ulp, rel=1e-12)
    assert 1 <= c.max_ulp_at_rms < 64  # a few ULPs of elements up to ~4 RMS, whatever the flip


def test_drift_of_equal_tensors_and_an_all_zero_reference() -> None:
    a = torch.randn(50, generator=torch.Generator().manual_seed(12))
    c = compare(a, a.clone())
    assert (c.sign_flips, c.ulp_p50, c.ulp_p99, c.max_abs_diff, c.max_ulp_at_rms) == (0, None, None, 0.0, 0.0)
    zeros = torch.zeros(50)
    c = compare(a, zeros)  # every element against zero: all flips, no scale to read the error at
    assert c.sign_flips == 50 and c.ulp_p99 is None and c.max_ulp_at_rms is None
    with pytest.raises(ValueError, match="allowed: a finite nonzero number"):
        ulp_at(0.0, torch.float32)
    assert ulp_at(1.0, torch.bfloat16) == 2.0**-7 and ulp_at(3.0, torch.float32) == 2.0**-22
    assert ulp_at(1e-45, torch.float32) == 2.0**-149  # subnormal spacing below the smallest normal
