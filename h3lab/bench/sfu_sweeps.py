"""The special-function probe's sweeps over every input, in place on the GPU (h3lab.bench.sfu_probe).

`hypotheses`: over all 2^32 inputs, the residual histogram per exponent against `reference`, and
whether ex2(x) = 2^floor(x) * ex2(frac(x)) with the fraction cut to 2^-22, 2^-23 or 2^-24 (truncated
or rounded), whether rcp(x) = rcp(significand) scaled, and whether div.full(a, b) = a * rcp(b) (with
and without div.full's range scaling). `model_check` (sm90_probe's part `sfu_model`) compares the
exact models fitted from the probe's answers (h3lab.emulate.sfu, run on the GPU) with the unit over
every 2^32 input of ex2, rcp and log2 and 2 x 2^27 div pairs, and counts the outputs whose bits
differ. Random inputs are redrawn from their seeds (probe_rng).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from h3lab.bench.probe_rng import Stream
from h3lab.emulate import floats, sfu
from h3lab.emulate.sfu_ref import div_ref, exp2_ref, log2_ref, ordered, rcp_ref

CHUNK = 1 << 27  # inputs per in-place pass (FP64 temporaries of 1 GiB each)
TINY, HUGE = 2.0**-126, 2.0**126

Op = Callable[..., Tensor]  # (op, x, y=None) -> FP32 outputs


def _ftz(y: Tensor) -> Tensor:
    return torch.where(y.abs() < TINY, y * 0.0, y)  # flush to a zero of the same sign (NaN stays NaN)


def reference(op: str, x: Tensor, y: Tensor | None = None) -> Tensor:
    """The residuals' reference of `op`: sfu_ref's function, with the .ftz instructions' flushing (ex2:
    results below 2^-126; rcp: subnormal inputs and results), so that flushed outputs stay small residuals.
    A NaN reference is the canonical 0x7FFFFFFF: torch keeps a NaN's bits on one device and not on
    another (the GPU's log2.random residuals were taken against canonical NaNs)."""
    if op == "div":
        ref = div_ref(x, y)
    elif op == "ex2":
        ref = _ftz(exp2_ref(x))
    elif op == "rcp":
        ref = _ftz(rcp_ref(_ftz(x)))
    else:
        ref = log2_ref(x)
    canonical = floats.fp32_from_bits(torch.full_like(ref, sfu.NAN_BITS, dtype=torch.int64))
    return torch.where(torch.isnan(ref), canonical, ref)


# ---- hypotheses over every input, in place ------------------------------------------------------

BUCKETS = 512  # sign and exponent field of an FP32 input


def _bucket(x: Tensor) -> Tensor:
    return floats.bits(x) >> 23


def _pow2(n: Tensor) -> Tensor:
    """float64 2^n, exactly, for integer-valued n (clamped to +-1000: the results then are 0 or inf in FP32)."""
    return ((n.clamp(-1000, 1000).to(torch.int64) + 1023) << 52).view(torch.float64)


def ex2_candidates(x: Tensor, table: Tensor) -> dict[str, Tensor]:
    """ex2(x) as 2^floor(x) * table[frac(x)], the fraction cut to 2^-k (k = 22, 23, 24) by truncation
    or rounding; table: ex2 on the grid k / 2^24 of [0, 1); results flushed below 2^-126."""
    x64 = torch.where(torch.isfinite(x), x, 0.0).to(torch.float64)
    n = torch.floor(x64)
    frac = x64 - n  # exact
    out = {}
    for k in (22, 23, 24):
        for mode, q in (("trunc", torch.floor(frac * 2.0**k)), ("round", torch.round(frac * 2.0**k))):
            carry = q == 2.0**k
            idx = (torch.where(carry, 0.0, q) * 2.0 ** (24 - k)).to(torch.int64)
            y = table[idx].to(torch.float64) * _pow2(n + carry.to(torch.float64))
            out[f"floor_{mode}{k}"] = _ftz(y.to(torch.float32))
    return out


def rcp_candidate(x: Tensor, table: Tensor) -> Tensor:
    """rcp(x) as the table of significands [1, 2) scaled by 2^-e with x's sign; subnormal inputs read as
    zeros (FTZ: +-inf), results flushed below 2^-126."""
    p = floats.decompose(x)
    y = table[floats.bits(x) & 0x7FFFFF].to(torch.float64) * _pow2(-p.exp)
    y = _ftz(torch.where(p.sign == 1, -y, y).to(torch.float32))
    inf = torch.where(p.sign == 1, -torch.inf, torch.inf)
    return torch.where(p.subnormal | p.zero, inf, y)


def div_candidates(op: Op, a: Tensor, b: Tensor) -> dict[str, Tensor]:
    """div.full as ptxas' sm90 sequence reads (SASS of attention_fwd): |b| > 2^126 scales a and b by
    1/4, |b| < 2^-126 by 2^24, then a * MUFU.RCP(b); and without the scaling."""
    big, small = b.abs() > HUGE, b.abs() < TINY
    scale = torch.where(big, 0.25, torch.where(small, 2.0**24, 1.0))
    return {"a_times_rcp": a * op("rcp", b), "scaled_a_times_rcp": (a * scale) * op("rcp", b * scale)}


def _accumulate(counts: dict[str, Tensor], name: str, mask: Tensor, bucket: Tensor) -> None:
    found = torch.bincount(bucket[mask], minlength=BUCKETS)
    counts[name] = counts.get(name, torch.zeros_like(found)) + found


def _candidates(fn: str, x: Tensor, tables: dict[str, Tensor]) -> dict[str, Tensor]:
    return ex2_candidates(x, tables["ex2"]) if fn == "ex2" else {"scaled": rcp_candidate(x, tables["rcp"])}


def hypotheses(op: Op, tables: dict[str, Tensor], device, span=(0, 1 << 32), pairs: int = CHUNK) -> dict:
    """Per input bucket (sign and exponent field), over the bit patterns in `span`: each candidate's
    mismatches against the GPU (finite inputs), and the residual histogram against the reference
    (ULPs -8..8 in columns 1..17, column 0 below, 18 above); div's candidates on `pairs` random pairs.
    tables: the GPU's ex2 on the 2^-24 grid of [0, 1) and rcp on the significands of [1, 2)."""
    counts: dict[str, Tensor] = {}
    for lo in range(span[0], span[1], CHUNK):
        x = floats.fp32_from_bits(torch.arange(lo, min(lo + CHUNK, span[1]), device=device))
        bucket, finite = _bucket(x), torch.isfinite(x)
        for fn in ("ex2", "rcp"):
            y = op(fn, x)
            r = (ordered(y) - ordered(reference(fn, x))).clamp(-9, 9) + 9
            hist = torch.zeros(BUCKETS * 19, dtype=torch.int64, device=device)
            counts[f"{fn}.histogram"] = counts.get(f"{fn}.histogram", 0) + hist.index_add_(
                0, bucket * 19 + r, r * 0 + 1
            )
            for name, pred in _candidates(fn, x, tables).items():
                _accumulate(counts, f"{fn}.{name}", finite & (floats.bits(pred) != floats.bits(y)), bucket)
    s = Stream(9100, device)
    a, b = floats.fp32_from_bits(s.bits((pairs,))), floats.fp32_from_bits(s.bits((pairs,)))
    y, ok = op("div", a, b), torch.isfinite(a) & torch.isfinite(b)
    for name, pred in div_candidates(op, a, b).items():
        _accumulate(counts, f"div.{name}", ok & (floats.bits(pred) != floats.bits(y)), _bucket(b))
    return {k: v.cpu().numpy() for k, v in counts.items()}


# ---- the model against the unit, in place -------------------------------------------------------

MODELS: dict[str, Callable[[Tensor], Tensor]] = {
    "ex2": sfu.ex2_approx_ftz,
    "rcp": sfu.rcp_approx_ftz,
    "log2": sfu.log2_libdevice,
}
EXAMPLES = 8  # mismatching inputs kept per function


def _mismatches(counts: dict, examples: dict, name: str, got: Tensor, want: Tensor, x: Tensor, y=None) -> None:
    bad = floats.bits(got) != floats.bits(want)
    _accumulate(counts, name, bad, _bucket(y if y is not None else x))
    kept = examples.setdefault(name, [])
    for i in bad.nonzero().flatten()[: EXAMPLES - len(kept)].tolist():
        inputs = [x[i : i + 1]] + ([y[i : i + 1]] if y is not None else [])
        kept.append([hex(int(floats.bits(t))) for t in [*inputs, got[i : i + 1], want[i : i + 1]]])


def model_check(op: Op, device, span=(0, 1 << 32), pairs: int = CHUNK) -> dict[str, Any]:
    """h3lab.emulate.sfu (run on `device`) against `op` bit for bit: ex2, rcp and log2 on every bit
    pattern in `span`, div on `pairs` random pairs of bit patterns and of the attention's range (|acc|
    < 2^10 over l in [1, 2^17]). NaNs count: their bits too. Mismatches per function, per input bucket
    (sign and exponent field; div: of b), and the first few as [inputs..., unit, model] bit patterns."""
    counts: dict[str, Tensor] = {}
    examples: dict[str, list] = {}
    for lo in range(span[0], span[1], CHUNK):
        x = floats.fp32_from_bits(torch.arange(lo, min(lo + CHUNK, span[1]), device=device))
        for fn, model in MODELS.items():
            _mismatches(counts, examples, fn, op(fn, x), model(x), x)
    s = Stream(9200, device)
    a, b = floats.fp32_from_bits(s.bits((pairs,))), floats.fp32_from_bits(s.bits((pairs,)))
    _mismatches(counts, examples, "div.random", op("div", a, b), sfu.div_full(a, b), a, b)
    acc = (s.bits((pairs,)).to(torch.float32) * 2.0**-31 - 1.0) * 1024.0
    ell = exp2_ref(s.bits((pairs,)).to(torch.float32) * (17.0 * 2.0**-32))
    _mismatches(counts, examples, "div.attention", op("div", acc, ell), sfu.div_full(acc, ell), acc, ell)
    totals = {k: int(v.sum()) for k, v in counts.items()}
    buckets = {k: {int(i): int(v[i]) for i in v.nonzero().flatten()[:64].tolist()} for k, v in counts.items()}
    inputs = {fn: span[1] - span[0] for fn in MODELS} | {"div.random": pairs, "div.attention": pairs}
    return {"mismatches": totals, "inputs": inputs, "buckets": buckets, "examples": examples, "span": list(span)}
