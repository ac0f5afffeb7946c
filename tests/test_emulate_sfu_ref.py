"""The special-function probes' references (h3lab.emulate.sfu_ref): the residual code is invertible for
every bit pattern, and the references are close enough to the true functions that residuals stay small
integers (1 ULP of the float64 functions rounded once: the tolerance a reference, not a model, needs)."""

from __future__ import annotations

import math

import torch

from h3lab.emulate import floats
from h3lab.emulate.sfu_ref import div_ref, exp2_ref, from_ordered, log2_ref, ordered, rcp_ref


def _patterns(n: int, seed: int) -> torch.Tensor:
    raw = torch.randint(0, 1 << 32, (n,), generator=torch.Generator().manual_seed(seed))
    return floats.fp32_from_bits(raw)


def test_ordered_is_invertible_for_every_pattern_and_monotone_on_values():
    x = torch.cat([_patterns(100_000, 0), torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])])
    assert torch.equal(floats.bits(from_ordered(ordered(x))), floats.bits(x))
    finite = x[torch.isfinite(x)].unique()  # sorted, -0 and +0 merged
    assert bool((ordered(finite).diff() > 0).all())
    assert ordered(torch.tensor([-0.0])).item() == -1 and ordered(torch.tensor([0.0])).item() == 0


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (ordered(a) - ordered(b)).abs()


def test_exp2_ref_is_within_one_ulp_and_exact_on_integers():
    x = torch.cat([torch.rand(200_000) * 300 - 160, torch.rand(10_000) * 2 - 1, torch.arange(-149.0, 128.0)])
    ref = torch.exp2(x.double()).float()
    assert int(_ulps(exp2_ref(x), ref).max()) <= 1
    ints = torch.arange(-149.0, 128.0)
    assert torch.equal(exp2_ref(ints), torch.exp2(ints.double()).float())
    special = exp2_ref(torch.tensor([-math.inf, math.inf, 200.0, -200.0, 0.0, -0.0]))
    assert special.tolist() == [0.0, math.inf, math.inf, 0.0, 1.0, 1.0]
    assert math.isnan(exp2_ref(torch.tensor([math.nan])).item())


def test_log2_ref_is_within_one_ulp_and_handles_the_specials():
    x = _patterns(200_000, 1).abs()
    x = x[torch.isfinite(x) & (x > 0)]
    assert int(_ulps(log2_ref(x), torch.log2(x.double()).float()).max()) <= 1
    powers = torch.exp2(torch.arange(-149.0, 128.0))
    assert torch.equal(log2_ref(powers), torch.arange(-149.0, 128.0))
    got = log2_ref(torch.tensor([0.0, -1.0, math.inf]))
    assert got[0].item() == -math.inf and math.isnan(got[1].item()) and got[2].item() == math.inf


def test_rcp_and_div_refs_are_exact_where_the_quotient_is_representable():
    powers = torch.exp2(torch.arange(-126.0, 127.0))
    assert torch.equal(rcp_ref(powers), torch.exp2(-torch.arange(-126.0, 127.0)))
    a = _patterns(10_000, 2)
    a = a[torch.isfinite(a) & (a.abs() < 2.0**100) & (a.abs() > 2.0**-100)]
    assert torch.equal(floats.bits(div_ref(a * 4, torch.full_like(a, 4.0))), floats.bits(a))
    assert bool((div_ref(a, a) == 1).all())
    assert int(_ulps(rcp_ref(a), (1 / a)).max()) <= 1
