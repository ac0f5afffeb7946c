"""The special-function instructions' models (h3lab.emulate.sfu, h3lab.emulate.mufu) on the CPU: every set
the H200 answered to the SFU probe (inputs redrawn by h3lab.bench.sfu_probe, the GPU's sha256 of its raw
outputs in tests/data/sm90_probe_vectors.json) comes out with the same bytes, and the rules at the edges hold."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from h3lab.bench import sfu_probe
from h3lab.emulate import floats, mufu
from h3lab.emulate.sfu import NAN_BITS, div_full, ex2_approx_ftz, log2_libdevice, rcp_approx_ftz
from h3lab.emulate.sfu_ref import ordered
from h3lab.metrics import sha256_tensor

SAVED = json.loads((Path(__file__).parent / "data" / "sm90_probe_vectors.json").read_text())["sfu"]
MODELS = {"ex2": ex2_approx_ftz, "rcp": rcp_approx_ftz, "log2": log2_libdevice}


@pytest.fixture(scope="module")
def sets():
    return sfu_probe.sample_sets("cpu", SAVED["grid_bits"], SAVED["samples"])


@pytest.mark.parametrize("name", sorted(SAVED["sha256_out"]))
def test_every_saved_set_comes_out_with_the_h200s_bytes(sets, name):
    # the ex2 grids: all 2^23 fractions of the table and the negative rule; rcp.mantissas: its table
    op, x, y = sets[name]
    out = div_full(x, y) if op == "div" else MODELS[op](x)
    assert sha256_tensor(out) == SAVED["sha256_out"][name]


def _f(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _bits(x: torch.Tensor) -> list[int]:
    return floats.bits(x).tolist()


def test_the_tables_have_the_interpolators_widths():
    for name, segments in (("ex2", 64), ("rcp", 128)):
        m, _, _, (c0, c1, c2) = mufu._table(name)
        assert 1 << m == segments == len(c0)
        assert max(c0) <= 1 << 26 and max(c1) < 1 << 16 and max(c2) < 1 << 10  # 2^26: rcp's 1.0
    assert mufu.interpolate("ex2", torch.tensor([0])).item() == 1 << 23  # 2^0 = 1
    assert mufu.interpolate("rcp", torch.tensor([0])).item() == 1 << 24  # 1/1 = 1
    with pytest.raises(ValueError, match=r"MUFU function 'sin'; allowed: \['ex2', 'rcp'\]"):
        mufu.interpolate("sin", torch.tensor([0]))


def test_ex2_cuts_x_to_23_fraction_bits_and_complements_negative_fractions():
    j = torch.randint(1, 1 << 23, (4096,), generator=torch.Generator().manual_seed(0))
    x = j.to(torch.float32) * 2.0**-23  # exact: fractions of [0, 1)
    cut = x + 2.0**-25  # below the unit's fixed-point grid: the same output
    assert _bits(ex2_approx_ftz(cut)) == _bits(ex2_approx_ftz(x))
    # x < 0 with a nonzero fraction reads -q - 1: ex2(-j 2^-23) = ex2(1 - (j + 1) 2^-23) / 2
    one_less = ex2_approx_ftz(((1 << 23) - (j + 1)).to(torch.float32) * 2.0**-23)
    assert _bits(ex2_approx_ftz(-x)) == _bits(one_less * 0.5)


def test_ex2_at_the_edges():
    ints = torch.arange(-126.0, 128.0)
    assert torch.equal(ex2_approx_ftz(ints), torch.exp2(ints))  # integers (and -n) are exact
    x = _f([0.0, -0.0, 1e-40, -1e-40, -(2.0**-24), -127.0, 128.0, -math.inf, math.inf, 1000.0, -1000.0])
    want = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, math.inf, 0.0, math.inf, math.inf, 0.0]
    assert ex2_approx_ftz(x).tolist() == want and _bits(ex2_approx_ftz(_f([math.nan])))[0] == NAN_BITS
    assert _bits(ex2_approx_ftz(_f([-126.5]))) == [0]  # a subnormal result flushes to +0


def _within(got: torch.Tensor, want: torch.Tensor, ulps: int) -> bool:
    """Every element within `ulps` of the float64 function rounded once: the accuracy the probe measured
    (largest residuals 2 ULP for ex2 and div, 1 for rcp and log2), a sanity bound on the tables, not the
    model's check (the sha256 tests are)."""
    return int((ordered(got) - ordered(want.to(torch.float32))).abs().max()) <= ulps


def test_the_models_are_as_accurate_as_the_probe_measured():
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(100_000, generator=g) * 250 - 125).float()
    assert _within(ex2_approx_ftz(x), torch.exp2(x.double()), 2)
    m = (torch.rand(100_000, generator=g) * 2 + 1).float() * 2.0 ** torch.randint(-100, 100, (100_000,), generator=g)
    assert _within(rcp_approx_ftz(m), 1 / m.double(), 1) and _within(log2_libdevice(m), torch.log2(m.double()), 1)
    a = (torch.rand(100_000, generator=g) * 2 - 1).float() * 1024
    assert _within(div_full(a, m), a.double() / m.double(), 2)


def test_rcp_at_the_edges():
    powers = torch.exp2(torch.arange(-126.0, 126.0))
    assert torch.equal(rcp_approx_ftz(powers), 1 / powers)
    x = _f([0.0, -0.0, 1e-40, -1e-40, math.inf, -math.inf, 1.5 * 2.0**126, -1.5 * 2.0**126])
    got = rcp_approx_ftz(x)
    assert got.tolist() == [math.inf, -math.inf, math.inf, -math.inf, 0.0, -0.0, 0.0, -0.0]
    assert _bits(got[-2:]) == [0, 1 << 31]  # flushed to zeros of x's sign
    assert _bits(rcp_approx_ftz(_f([math.nan]))) == [NAN_BITS]


def test_div_full_scales_big_and_tiny_divisors():
    # |b| < 2^-126 is scaled by 2^24 first: a subnormal divisor gives a finite quotient, not inf
    assert div_full(_f([2.0**-20]), _f([2.0**-140])).item() == 2.0**120
    b = _f([1.25 * 2.0**127])  # |b| > 2^126: a and b scaled by 1/4, so rcp(b) does not flush
    assert div_full(_f([2.0**127]), b).item() == (_f([2.0**125]) * rcp_approx_ftz(b * 0.25)).item() != 0
    nan = div_full(_f([0.0, math.inf, math.nan, 1.0]), _f([0.0, math.inf, 1.0, math.nan]))
    assert _bits(nan) == [NAN_BITS] * 4


def test_log2_follows_libdevice_at_the_edges():
    k = torch.arange(-149.0, 128.0)
    assert torch.equal(log2_libdevice(torch.exp2(k)), k)  # powers of two, subnormals included
    got = log2_libdevice(_f([0.0, -0.0, math.inf, 1.0]))
    assert got.tolist() == [-math.inf, -math.inf, math.inf, 0.0]
    assert _bits(log2_libdevice(_f([-1.0, -math.inf, math.nan]))) == [NAN_BITS] * 3


def test_inputs_are_checked():
    for fn in (ex2_approx_ftz, rcp_approx_ftz, log2_libdevice):
        with pytest.raises(ValueError, match=r"input of dtype torch.float64; allowed: torch.float32"):
            fn(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"div_full: input of dtype torch.bfloat16"):
        div_full(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16))
