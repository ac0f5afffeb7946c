"""The MMA model (h3lab.emulate.mma) and the FMA chain (h3lab.emulate.fma) on the CPU: properties of
the model, checked against exact rational arithmetic (fractions) written independently of the integer
code, with the edge rules the H200 answered; and dots the H200 computed (through h3lab.bench.sm90_probe, saved in
tests/data/sm90_probe_vectors.json) that only those rules reproduce."""

from __future__ import annotations

import json
import math
import random
import struct
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from h3lab.emulate import floats
from h3lab.emulate.fma import fma_dot, fma_f32
from h3lab.emulate.mma import SM90, MmaModel, chain_dot, dot, mma_step
from tests.conftest import assert_bitwise

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_bf16(shape, g, spread: int = 8) -> torch.Tensor:
    """bf16 values with random signs, 7 random fraction bits and exponents in [-spread, spread]."""
    sign = torch.randint(0, 2, shape, generator=g)
    exp = torch.randint(-spread, spread + 1, shape, generator=g) + 127
    frac = torch.randint(0, 128, shape, generator=g)
    bits = (sign << 15) | (exp << 7) | frac
    return (bits - ((bits & 0x8000) << 1)).to(torch.int16).view(BF16)


def _random_f32(shape, g, spread: int = 8) -> torch.Tensor:
    sign = torch.randint(0, 2, shape, generator=g)
    exp = (torch.randint(-spread, spread + 1, shape, generator=g) + 127).clamp(1, 254)
    frac = torch.randint(0, 1 << 23, shape, generator=g)
    return floats.fp32_from_bits((sign << 31) | (exp << 23) | frac)


# ---- an independent rational reference of one step ----------------------------------------------


def _ieee_exp(x: float, emin: int) -> int:
    return max(math.frexp(x)[1] - 1, emin)


def _exponent(mag: Fraction) -> int:
    """floor(log2(mag)) of a positive fraction, exactly."""
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    e += 1 if Fraction(2) ** (e + 1) <= mag else 0
    return e - (1 if Fraction(2) ** e > mag else 0)


def _rz_fp32(q: Fraction) -> float:
    """q rounded toward zero to FP32 (subnormals kept, overflow to inf, a zero +0), as a Python float."""
    if q == 0:
        return 0.0
    mag = abs(q)
    e = _exponent(mag)
    if e > 127:
        value = math.inf
    else:
        quantum = Fraction(2) ** (max(e, -126) - 23)
        value = int(mag / quantum) * quantum
    return float(value) if q > 0 else -float(value)


def _ref_step(a: list[float], b: list[float], c: float | None) -> float:
    """The model's step in fractions: align to 2^(E-25) with E >= -133, truncate each term, add, round
    toward zero."""
    terms = [(Fraction(x) * Fraction(y), _ieee_exp(x, -126) + _ieee_exp(y, -126)) for x, y in zip(a, b, strict=True)]
    exps = [e for p, e in terms if p != 0] + ([_ieee_exp(c, -126)] if c else [])
    values = [p for p, _ in terms] + ([Fraction(c)] if c is not None else [])
    if not exps:
        return 0.0
    quantum = Fraction(2) ** (max([*exps, -133]) - 25)
    total = sum((int(v / quantum) * quantum for v in values), Fraction(0))  # int() truncates toward zero
    return _rz_fp32(total)


def _bits32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


@pytest.mark.parametrize("seed", range(4))
def test_a_step_equals_exact_rational_arithmetic_on_random_cases(seed):
    g = _gen(seed)
    spread = [0, 6, 20, 60][seed]  # up to exponent gaps that truncate whole terms away
    a = _random_bf16((24, 16), g, spread)
    b = _random_bf16((16, 20), g, spread)
    c = _random_f32((24, 20), g, spread)
    c[::5] = 0.0
    got = mma_step(a, b, c)
    a_f, b_f, c_f = a.float().tolist(), b.float().t().tolist(), c.tolist()
    want = torch.tensor([[_bits32(_ref_step(a_f[m], b_f[n], c_f[m][n])) for n in range(20)] for m in range(24)])
    assert torch.equal(floats.bits(got), want)


def test_a_step_without_accumulator_equals_the_rational_reference_with_subnormal_products():
    g = _gen(5)
    a = _random_bf16((8, 16), g, 3) * 2.0**-70  # products near 2^-140: below FP32's normal range and
    b = _random_bf16((16, 8), g, 3) * 2.0**-70  # below the alignment floor 2^-133
    got = mma_step(a, b, None)
    a_f, b_f = a.float().tolist(), b.float().t().tolist()
    want = torch.tensor([[_bits32(_ref_step(a_f[m], b_f[n], None)) for n in range(8)] for m in range(8)])
    assert torch.equal(floats.bits(got), want)
    assert (got != 0).any() and (got.abs() < 2.0**-126).all()


# ---- properties of the model -----------------------------------------------------------------------


def test_the_alignment_floor_drops_bits_below_2_to_the_minus_158():
    # 2 p + q + r = 2^-144 exactly, p = 2^-145 (1 + 2^-7)^2 = 2^-145 + 2^-151 + 2^-159, q = -2^-150,
    # r = -2^-158: E = -145 is below the floor -133, so p is cut to 2^-158 and the sum to 31 * 2^-149
    one = 1 + 2.0**-7
    a = torch.tensor([[2.0**-72 * one, 2.0**-72 * one, -(2.0**-75), -(2.0**-79)]], dtype=BF16)
    b = torch.tensor([[2.0**-73 * one], [2.0**-73 * one], [2.0**-75], [2.0**-79]], dtype=BF16)
    assert mma_step(a, b, None, MmaModel(align_min=-1000)).item() == 2.0**-144
    assert mma_step(a, b, None).item() == 31 * 2.0**-149


def test_terms_on_the_aligned_grid_add_exactly():
    g = _gen(6)
    a = (torch.randint(-127, 128, (16, 16), generator=g).float() / 64).to(BF16)  # exact in bf16
    b = torch.full((16, 16), 0.5, dtype=BF16)  # products: multiples of 2^-7 below 1, so on the 2^-26 grid
    exact = a.double() @ b.double()
    assert_bitwise(dot(a, b), exact.float(), "exact sums")


def test_a_step_is_commutative_within_its_group():
    g = _gen(7)
    a, b = _random_bf16((32, 16), g, 20), _random_bf16((16, 32), g, 20)
    c = _random_f32((32, 32), g, 20)
    perm = torch.randperm(16, generator=g)
    assert_bitwise(mma_step(a[:, perm], b[perm], c), mma_step(a, b, c), "a permuted group")


def test_small_terms_are_truncated_before_the_sum():
    # sixteen products of 2^-26 next to c = 1: each is below the 2^-25 grid, so each is dropped,
    # though together (2^-22) they would move the sum
    a = torch.full((1, 16), 2.0**-13, dtype=BF16)
    b = torch.full((16, 1), 2.0**-13, dtype=BF16)
    assert mma_step(a, b, torch.ones(1, 1)).item() == 1.0
    assert mma_step(a, b, -torch.ones(1, 1)).item() == -1.0
    assert mma_step(a, b, None).item() == 2.0**-22  # alone they share one exponent: exact


def test_the_sum_is_rounded_toward_zero():
    # c = 1 plus 0.75 ULP (3 * 2^-25): nearest would round up to 1 + 2^-23, toward zero keeps 1
    a = torch.zeros((1, 16), dtype=BF16)
    a[0, 0] = 3 * 2.0**-13
    b = torch.zeros((16, 1), dtype=BF16)
    b[0, 0] = 2.0**-12
    for sign in (1.0, -1.0):
        assert mma_step(a * sign, b, torch.full((1, 1), sign)).item() == sign


def test_steps_chain_in_k_order():
    g = _gen(8)
    a, b = _random_bf16((16, 48), g, 30), _random_bf16((48, 16), g, 30)
    c = _random_f32((16, 16), g, 30)
    chained = mma_step(a[:, 32:], b[32:], mma_step(a[:, 16:32], b[16:32], mma_step(a[:, :16], b[:16], c)))
    assert_bitwise(dot(a, b, c), chained, "K ascending")
    assert_bitwise(chain_dot([(a[:, :16], b[:16]), (a[:, 16:], b[16:])], c), chained, "pieces in order")
    # the order matters: small products first survive, after a big one they are truncated away
    small, big = torch.full((1, 16), 2.0**-13, dtype=BF16), torch.zeros((1, 16), dtype=BF16)
    big[0, 0] = 1.0
    ones = torch.full((16, 1), 2.0**-13, dtype=BF16)
    a2, b2 = torch.cat([small, big], 1), torch.cat([ones, torch.full((16, 1), 1.0, dtype=BF16)], 0)
    forward = dot(a2, b2)
    backward = dot(a2.flip(1), b2.flip(0))
    assert forward.item() == 1.0 + 2.0**-22 and backward.item() == 1.0


def test_the_k_tail_reads_zeros_and_an_exact_zero_sum_is_plus_zero():
    g = _gen(9)
    a, b = _random_bf16((8, 40), g, 10), _random_bf16((40, 8), g, 10)
    padded_a = torch.nn.functional.pad(a, (0, 24))
    padded_b = torch.nn.functional.pad(b, (0, 0, 0, 24))
    assert_bitwise(dot(a, b, block_k=64), dot(padded_a, padded_b), "zero-padded K")
    neg = -torch.zeros((1, 16), dtype=BF16)
    one = torch.ones((16, 1), dtype=BF16)
    assert floats.bits(dot(neg, one, -torch.zeros(1, 1))).item() == 0  # -0 products and c = -0: +0
    assert floats.bits(dot(neg, one, model=MmaModel(zero_sign="ieee"))).item() == 0x80000000


def test_fp16_inputs_use_their_own_significands():
    g = _gen(10)
    a = torch.randint(-512, 512, (8, 16), generator=g).to(F16) / 256
    b = torch.randint(-512, 512, (16, 8), generator=g).to(F16) / 256
    assert_bitwise(dot(a, b), (a.double() @ b.double()).float(), "fp16, exact")


def test_specials_follow_ieee_rules_and_the_named_nan():
    a = torch.tensor([[math.nan, 1.0], [math.inf, 0.0], [math.inf, -math.inf], [math.inf, 1.0]], dtype=BF16)
    a = torch.nn.functional.pad(a, (0, 14))
    b = torch.nn.functional.pad(torch.tensor([[1.0], [1.0]], dtype=BF16), (0, 0, 0, 14))
    got = floats.bits(mma_step(a, b, torch.zeros(4, 1)))[:, 0].tolist()
    assert got == [SM90.nan_bits, 0x7F800000, SM90.nan_bits, 0x7F800000]
    inf_times_zero = mma_step(torch.tensor([[math.inf]], dtype=BF16), torch.zeros((1, 1), dtype=BF16), None)
    assert floats.bits(inf_times_zero).item() == SM90.nan_bits


def test_the_edge_rules_switch():
    big = torch.full((1, 16), 2.0**127, dtype=BF16)
    assert mma_step(big, torch.full((16, 1), 2.0, dtype=BF16), None).item() == math.inf
    max_model = MmaModel(overflow="max")
    assert mma_step(big, torch.full((16, 1), 2.0, dtype=BF16), None, max_model).item() == torch.finfo(F32).max
    tiny = torch.full((1, 1), 2.0**-75, dtype=BF16)
    assert mma_step(tiny, tiny, None).item() == 0.0  # 2^-150: below the subnormal grid, truncated
    assert mma_step(tiny * 2**5, tiny, None).item() == 2.0**-145
    assert mma_step(tiny * 2**5, tiny, None, MmaModel(subnormal_output="flush")).item() == 0.0
    sub = torch.full((1, 1), 2.0**-130, dtype=BF16)
    assert mma_step(sub, torch.ones((1, 1), dtype=BF16), None).item() == 2.0**-130
    assert mma_step(sub, torch.ones((1, 1), dtype=BF16), None, MmaModel(subnormal_inputs="flush")).item() == 0.0
    with pytest.raises(ValueError, match=r"MmaModel\.overflow='nearest'; allowed: \['max', 'inf'\]"):
        MmaModel(overflow="nearest")
    with pytest.raises(ValueError, match=r"MmaModel\.align_min=-100; allowed: -1000 to -126"):
        MmaModel(align_min=-100)


def test_operands_are_checked():
    with pytest.raises(ValueError, match="allowed: both of one of"):
        dot(torch.ones(2, 16), torch.ones(16, 2))
    with pytest.raises(ValueError, match=r"allowed: \[\.\.\., M, K\] @ \[\.\.\., K, N\]"):
        dot(torch.ones(2, 16, dtype=BF16), torch.ones(8, 2, dtype=BF16))
    with pytest.raises(ValueError, match=r"allowed: a multiple of model\.group = 16"):
        dot(torch.ones(2, 16, dtype=BF16), torch.ones(16, 2, dtype=BF16), block_k=24)


# ---- floats and the FMA chain ------------------------------------------------------------------


def test_decompose_and_round_toward_zero_give_back_every_float():
    g = _gen(11)
    raw = torch.randint(0, 1 << 32, (200_000,), generator=g)
    x = floats.fp32_from_bits(raw)
    x = x[torch.isfinite(x)]
    p = floats.decompose(x)
    back = floats.fp32_rz_bits(p.sign, p.sig, p.exp - 23, subnormals="keep", overflow="max")
    assert torch.equal(back, floats.bits(x))


def _round_fp32(q: Fraction) -> int:
    """The FP32 bits of q rounded to nearest, ties to even (overflow to infinity)."""
    if q == 0:
        return 0
    mag, sign = abs(q), (1 << 31) if q < 0 else 0
    e = _exponent(mag)
    quantum = Fraction(2) ** (max(e, -126) - 23)
    n, rest = divmod(mag, quantum)
    n = int(n) + (1 if rest > quantum / 2 or (rest == quantum / 2 and int(n) % 2) else 0)
    value = n * quantum
    if value >= Fraction(2) ** 128:
        return sign | 0x7F800000
    return sign | _bits32(float(value))


def test_fma_f32_is_correctly_rounded():
    g = _gen(12)
    x, y = _random_f32((20_000,), g, 70), _random_f32((20_000,), g, 70)
    z = -(x.double() * y.double()).float() * (1 + torch.randint(-4, 5, (20_000,), generator=g) * 2.0**-22)
    z = torch.where(torch.isfinite(z), z, 1.0)  # products past FLT_MAX (their fma overflows: inf)
    z[::3] = _random_f32((len(z[::3]),), g, 140)  # and unrelated addends, subnormal results included
    got = floats.bits(fma_f32(x, y, z)).tolist()
    triples = zip(x.tolist(), y.tolist(), z.tolist(), strict=True)
    want = [_round_fp32(Fraction(a) * Fraction(b) + Fraction(c)) for a, b, c in triples]
    assert got == want


def test_fma_dot_is_the_k_ascending_chain_from_the_accumulator():
    g = _gen(13)
    a, b, c = _random_f32((6, 9), g, 20), _random_f32((9, 5), g, 20), _random_f32((6, 5), g, 20)
    acc = c
    for k in range(9):
        acc = fma_f32(a[:, k : k + 1].expand(6, 5), b[k : k + 1].expand(6, 5), acc)
    assert_bitwise(fma_dot(a, b, c), acc, "fma chain")
    assert_bitwise(fma_dot(a.to(BF16), b.to(BF16)), fma_dot(a.to(BF16).float(), b.to(BF16).float()), "bf16 in")


def test_the_rational_reference_agrees_with_random_bit_patterns_of_fp32():
    rng = random.Random(14)
    values = [struct.unpack("<f", struct.pack("<I", rng.getrandbits(32)))[0] for _ in range(2000)]
    values = [v for v in values if math.isfinite(v)]
    assert [_round_fp32(Fraction(v)) for v in values] == [_bits32(v) for v in values]


# ---- dots the H200 computed ------------------------------------------------------------------------

VECTORS = json.loads((Path(__file__).parent / "data" / "sm90_probe_vectors.json").read_text())
WITHOUT_THE_RULES = MmaModel(overflow="max", zero_sign="ieee", align_min=-1000)  # the reading before the probe


def _bf16(words: str) -> torch.Tensor:
    b = torch.tensor([int(w, 16) for w in words.split()], dtype=torch.int64)
    return (b - ((b & 0x8000) << 1)).to(torch.int16).view(BF16)


@pytest.mark.parametrize("vector", VECTORS["mma_dots"], ids=lambda v: f"{v['case']}@{v['at']}")
def test_the_h200s_edge_dots_need_the_edge_rules(vector):
    # overflow to inf, a zero sum +0, the alignment floor: each saved dot differs without its rule
    a, b = _bf16(vector["a"]).view(1, -1), _bf16(vector["b"]).view(-1, 1)
    c = None if vector["c"] is None else floats.fp32_from_bits(torch.tensor([[int(vector["c"], 16)]]))
    got = floats.bits(dot(a, b, c, block_k=vector["block_k"])).item()
    before = floats.bits(dot(a, b, c, model=WITHOUT_THE_RULES, block_k=vector["block_k"])).item()
    assert (got, before) == (int(vector["gpu"], 16), int(vector["without_the_rule"], 16))
