"""The special-function unit's coefficient tables (h3lab/emulate/mufu_tables.json) fitted again from a probe's files.

    python -m h3lab.bench.mufu_fit DIR [--out PATH]      (any CPU, about two minutes)

DIR is an sm90_probe folder with the sfu part (summary.json, sfu.npz, sfu_grid.npz). Its ex2 outputs
at every k / 2^24 of [0, 1) (even k: the unit reads 23 fraction bits) and its rcp outputs at every
significand of [1, 2) are the 2^23 results of each interpolator (h3lab.emulate.mufu's docstring has
the form). Per segment: a least-squares fit of y + 1/2 on (1, x_l, sq(x_l)) gives C1 and C2 near
their values; every integer pair within SPAN of it is tried, and a pair fits where some A satisfies
y * 2^15 <= A + s C1 x_l + C2 sq(x_l) < (y + 1) * 2^15 for all 2^n outputs (A then lies in an
interval). Exactly one pair must fit; then one residue K of A mod 2^13 must lie in every segment's
interval, and C0 = (A - K) / 2^13. Prints whether the fit equals the package's tables; --out writes it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from h3lab.emulate import floats, mufu

SPAN = (80, 4)  # C1 and C2 are searched within +-SPAN of the least-squares fit
FUNCTIONS = {"ex2": {"index_bits": 6, "c1_sign": 1}, "rcp": {"index_bits": 7, "c1_sign": -1}}
UNIT = 1 << mufu.ACC_SHIFT


def outputs(probe_dir: Path) -> dict[str, Tensor]:
    """{function: int64 [2^23]} the unit's results at every 23-bit fraction, rebuilt from the saved sets."""
    from h3lab.bench import sfu_probe, sfu_sweeps

    part = json.loads((probe_dir / "summary.json").read_text())["parts"]["sfu"]
    saved, sets = sfu_probe.load(probe_dir), sfu_probe.sample_sets("cpu", part["grid_bits"], part["samples"])
    got = {}
    for name in ("ex2.grid_pos", "rcp.mantissas"):
        op, x, y = sets[name]
        arrays = {k: saved[f"{name}.{k}"] for k in ("r", "ex_idx", "ex_bits")}
        got[name] = floats.bits(sfu_probe.decode(arrays, part["sets"][name]["form"], sfu_sweeps.reference(op, x, y)))
    ex2 = (got["ex2.grid_pos"][0::2] & 0x7FFFFF) | (1 << 23)  # [1, 2): the significand
    rcp_field = (got["rcp.mantissas"] >> 23) & 0xFF
    rcp = ((got["rcp.mantissas"] & 0x7FFFFF) | (1 << 23)) << (rcp_field - 126)  # units of 2^-24: 2^24 for 1
    return {"ex2": ex2, "rcp": rcp}


def _interval(y: Tensor, x_l: Tensor, sq: Tensor, slope: int, curve: int) -> tuple[int, int] | None:
    """[lo, hi) of the A that make floor((A + slope x_l + curve sq) / 2^15) = y everywhere, or None."""
    terms = slope * x_l + curve * sq
    lo, hi = int((y * UNIT - terms).max()), int(((y + 1) * UNIT - terms).min())
    return (lo, hi) if lo < hi else None


def fit_segment(y: Tensor, n: int, c1_sign: int) -> tuple[int, int, int, int]:
    """(C1, C2, lo, hi) of the one pair that fits the segment's outputs y (int64 [2^n]); A in [lo, hi)."""
    x_l = torch.arange(1 << n, dtype=torch.int64)
    sq = mufu._square_terms(n, "cpu")
    design = np.stack([np.ones(1 << n), x_l.numpy(), sq.numpy()], 1).astype(np.float64)
    c, *_ = np.linalg.lstsq(design, y.numpy() + 0.5, rcond=None)
    fits = []
    for C2 in range(round(c[2] * UNIT) - SPAN[1], round(c[2] * UNIT) + SPAN[1] + 1):
        for C1 in range(round(c1_sign * c[1] * UNIT) - SPAN[0], round(c1_sign * c[1] * UNIT) + SPAN[0] + 1):
            if _interval(y[::64], x_l[::64], sq[::64], c1_sign * C1, C2) is None:  # most fail on a sample
                continue
            found = _interval(y, x_l, sq, c1_sign * C1, C2)
            if found is not None:
                fits.append((C1, C2, *found))
    if len(fits) != 1:
        raise ValueError(f"{len(fits)} (C1, C2) pairs fit a segment; allowed: exactly one")
    return fits[0]


def fit(y: Tensor, index_bits: int, c1_sign: int) -> dict[str, Any]:
    """The table of one function from its 2^23 results y (module docstring)."""
    n = mufu.FRACTION_BITS - index_bits
    segments = [fit_segment(y[s << n : (s + 1) << n], n, c1_sign) for s in range(1 << index_bits)]
    step = 1 << mufu.C0_SHIFT
    offsets = set(range(step))
    for _, _, lo, hi in segments:
        offsets &= {a % step for a in range(lo, min(hi, lo + step))}
    if len(offsets) != 1:
        raise ValueError(f"{len(offsets)} offsets K lie in every segment's interval; allowed: exactly one")
    (K,) = offsets
    rows = [[(lo + (K - lo) % step - K) >> mufu.C0_SHIFT, C1, C2] for C1, C2, lo, _ in segments]
    return {"index_bits": index_bits, "offset": K, "c1_sign": c1_sign, "coefficients": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe_dir", type=Path, help="an sm90_probe folder with the sfu part")
    ap.add_argument("--out", type=Path, help="write the fitted tables here (JSON)")
    args = ap.parse_args(argv)
    results = outputs(args.probe_dir)
    fitted = {name: fit(results[name], **spec) for name, spec in FUNCTIONS.items()}
    package = json.loads(mufu.TABLES.read_text())["functions"]
    same = {name: fitted[name] == package[name] for name in FUNCTIONS}
    if args.out:
        args.out.write_text(json.dumps({"functions": fitted}, indent=1) + "\n")
    print(f"mufu_fit: {json.dumps(same)} (fitted tables equal to {mufu.TABLES.name})")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
