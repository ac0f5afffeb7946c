"""The fixed-order primitives: exact where they claim exactness, and invariant to shape and position."""

from __future__ import annotations

import math

import pytest
import torch

from h3lab.ops.chain import chain_bmm, chain_mm
from h3lab.ops.fixed import cos_sin, exp, pair_sum, round_to, sigmoid, unit_tree
from tests.conftest import assert_bitwise


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_round_to_bf16_matches_torch_round_to_nearest_even():
    g = _gen(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1_000_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    edge = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-40, -1e-40, 3.3961e38, -3.3961e38, 1.00390625, 1.01171875])
    x = torch.cat([x[~torch.isnan(x)], edge])
    assert_bitwise(round_to(x, torch.bfloat16), x.to(torch.bfloat16), "round_to")
    assert torch.isnan(round_to(torch.tensor([math.nan]), torch.bfloat16)).all()


def test_round_to_rejects_other_dtypes():
    with pytest.raises(ValueError, match=r"allowed: torch\.bfloat16, torch\.float32"):
        round_to(torch.ones(3), torch.float16)


def _ulp32(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def test_exp_is_accurate_and_position_independent():
    g = _gen(1)
    x = torch.randn(300_001, generator=g) * 25
    y = exp(x)
    # our exp is within 0.5 ULP + 1e-16 before the final rounding: equal to the correctly rounded
    # value except on exact ties, so against float64 exp rounded to fp32 we allow 1 ULP
    assert _ulp32(y, torch.exp(x.double()).float()) <= 1
    for lo, hi in ((0, 7), (3, 1003), (5, 300_001), (299_990, 300_001)):
        assert_bitwise(exp(x[lo:hi]), y[lo:hi], f"exp slice {lo}:{hi}")
    special = exp(torch.tensor([0.0, -0.0, 200.0, -200.0, math.inf, -math.inf]))
    assert special.tolist() == [1.0, 1.0, math.inf, 0.0, math.inf, 0.0]
    assert torch.isnan(exp(torch.tensor([math.nan]))).all()


def test_sigmoid_saturates_without_nan():
    s = sigmoid(torch.tensor([-1e4, -90.0, 0.0, 90.0, 1e4]))
    assert s.tolist() == [0.0, 0.0, 0.5, 1.0, 1.0]


def test_cos_sin_accuracy_and_range_check():
    g = _gen(2)
    ang = torch.randint(0, 4096, (200_003,), generator=g).float() * torch.rand(200_003, generator=g)
    c, s = cos_sin(ang)
    assert _ulp32(c, torch.cos(ang.double()).float()) <= 1  # same argument as for exp
    assert _ulp32(s, torch.sin(ang.double()).float()) <= 1
    c2, s2 = cos_sin(ang[17:1017])
    assert_bitwise(c2, c[17:1017]), assert_bitwise(s2, s[17:1017])
    with pytest.raises(ValueError, match="allowed below 1e6"):
        cos_sin(torch.tensor([2e6]))
    # a caller's proven bound replaces the read of the angles' maximum: the same bits
    c3, s3 = cos_sin(ang, max_abs=4096.0)
    assert_bitwise(c3, c), assert_bitwise(s3, s)
    with pytest.raises(ValueError, match=r"max_abs=1000000.0; allowed below 1e6"):
        cos_sin(ang, max_abs=1e6)


def test_unit_tree_is_the_contract_expression_and_nests_by_tp():
    g = _gen(3)
    p = [torch.randn(5, 7, generator=g) * 10 ** torch.randint(-3, 4, (1,), generator=g).item() for _ in range(8)]
    expected = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    assert_bitwise(unit_tree(p), expected, "tree8")
    for tp in (1, 2, 4, 8):
        per = 8 // tp
        roots = [unit_tree(p[r * per : (r + 1) * per]) for r in range(tp)]
        assert_bitwise(unit_tree(roots), expected, f"TP{tp} grouping")
    with pytest.raises(ValueError, match="power-of-two"):
        unit_tree(p[:3])


def test_pair_sum_pads_exactly():
    g = _gen(4)
    x = torch.randn(3, 13, generator=g)
    padded = torch.cat([x, torch.zeros(3, 3)], dim=1)
    assert_bitwise(pair_sum(x), pair_sum(padded), "pair_sum zero padding")
    # a 4-level fp32 tree errs by at most 4 * 2^-24 * sum|x| against the exact (fp64) sum
    bound = 4 * 2.0**-24 * x.double().abs().sum(-1)
    assert ((pair_sum(x).double() - x.double().sum(-1)).abs() <= bound).all()


def _chain_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The definition, one element at a time: acc = acc + a[m, k] * b[k, n], k ascending, in fp32."""
    a, b = a.float(), b.float()
    out = torch.zeros(a.shape[0], b.shape[1])
    for m in range(a.shape[0]):
        for n in range(b.shape[1]):
            acc = torch.zeros((), dtype=torch.float32)
            for k in range(a.shape[1]):
                acc = acc + a[m, k] * b[k, n]
            out[m, n] = acc
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chain_mm_is_the_sequential_definition(dtype):
    g = _gen(5)
    a, b = torch.randn(3, 37, generator=g).to(dtype), torch.randn(37, 5, generator=g).to(dtype)
    assert_bitwise(chain_mm(a, b), _chain_reference(a, b), "chain_mm vs definition")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("M", "K", "N"), [(264, 192, 768), (17, 513, 2500), (1, 7, 3)])
def test_chain_mm_rows_and_columns_are_invariant(dtype, M, K, N):
    g = _gen(6)
    a, b = torch.randn(M, K, generator=g).to(dtype), torch.randn(K, N, generator=g).to(dtype)
    full = chain_mm(a, b)
    for lo, hi in ((0, 1), (M // 3, M // 3 + 3), (max(0, M - 17), M)):
        assert_bitwise(chain_mm(a[lo:hi], b), full[lo:hi], f"rows {lo}:{hi}")
    for lo, hi in ((0, 1), (N // 2, N), (N // 5, N // 5 + 2049)):  # crosses the 2048-column CPU tile
        assert_bitwise(chain_mm(a, b[:, lo:hi]), full[:, lo:hi], f"cols {lo}:{hi}")


def test_chain_mm_continues_a_chain():
    g = _gen(7)
    a, b = torch.randn(9, 20, generator=g).bfloat16(), torch.randn(20, 6, generator=g).bfloat16()
    assert_bitwise(chain_mm(a[:, 12:], b[12:], chain_mm(a[:, :12], b[:12])), chain_mm(a, b), "pieces")


def test_chain_bmm_matches_chain_mm_per_batch():
    g = _gen(8)
    a, b = torch.randn(4, 11, 33, generator=g).bfloat16(), torch.randn(4, 33, 7, generator=g).bfloat16()
    full = chain_bmm(a, b)
    for i in range(4):
        assert_bitwise(full[i], chain_mm(a[i], b[i]), f"batch {i}")
    assert_bitwise(chain_bmm(a[:, 2:5], b), full[:, 2:5], "rows")


def test_sqrt_f32_is_correctly_rounded():
    """r is the correctly rounded root of x iff x lies between the squares of the midpoints from r to
    its neighbours, checked in exact rational arithmetic (torch's own FP32 sqrt fails this on CPUs)."""
    from fractions import Fraction

    from h3lab.ops.fixed import sqrt_f32

    gen = torch.Generator().manual_seed(17)
    x = torch.cat([torch.rand(2000, generator=gen) * 1e-7, torch.rand(2000, generator=gen) * 1e3])
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e-45, 3.4e38, float("inf")])])
    r = sqrt_f32(x)
    for xi, ri in zip(x.tolist(), r.tolist(), strict=True):
        if math.isinf(xi) or xi == 0.0:
            assert ri == xi and math.copysign(1, ri) == math.copysign(1, xi), (xi, ri)
            continue
        lo = torch.nextafter(torch.tensor(ri), torch.tensor(0.0)).item()
        hi = torch.nextafter(torch.tensor(ri), torch.tensor(math.inf)).item()
        fx, fr = Fraction(xi), Fraction(ri)
        assert (fr + Fraction(lo)) ** 2 / 4 <= fx <= (fr + Fraction(hi)) ** 2 / 4, (xi, ri)
