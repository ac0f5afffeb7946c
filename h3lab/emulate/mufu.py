"""The sm90 special-function unit's interpolator (MUFU.EX2 and MUFU.RCP), in exact integers.

MUFU evaluates a function of a 23-bit fixed-point fraction j (ex2: the fraction of x, so 2^(j/2^23);
rcp: the fraction of x's significand, so 1/(1 + j/2^23)) as a table-driven quadratic (Oberman & Siu,
"A high-performance area-efficient multifunction interpolator", ARITH 2005): the m high bits of j
pick a segment and its coefficients C0, C1, C2 (26, 16 and 10 bits), the n = 23 - m low bits x_l
give, in units of 2^-15 of the result's ULP,

    acc = C0 * 2^13 + K + s * C1 * x_l + C2 * (sq(x_l) >> (2n - 15)),   result = acc >> 15 (floor)

with s = +1 for ex2 and -1 for rcp, K a constant of the function, and sq(x_l) the squarer's
partial-product array of x_l (the bits b_i b_j 2^(i+j+1), i < j, and b_i 4^i) kept in its top 15
columns only: the terms of lower columns are dropped, not rounded. Every other step is exact.
ex2: m = 6, the result the 24-bit significand of a value in [1, 2); rcp: m = 7, the result in units
of 2^-24 of a value in (1/2, 1] (2^24 for j = 0).

The coefficients (`mufu_tables.json`, 4 KB) were fitted to the H200's outputs
(h3lab.bench.sfu_probe): ex2 at every x = k / 2^24 of [0, 1) (odd k read the same fraction as k - 1:
the unit cuts x to 23 fraction bits) and rcp at every significand of [1, 2). In each segment one
(C1, C2) fits all 2^n outputs (no other near the least-squares fit does); C0 * 2^13 + K is then
fixed to an interval, and one residue K mod 2^13 lies in every segment's interval (ex2 0x17E2, rcp
0x07E7). The tables reproduce all 2^23 outputs of each function (tests/test_emulate_sfu.py checks
the probe's sha256 of them).
How x becomes j, and the exponent around it, is h3lab.emulate.sfu's.

Dimension legend: any shape; every function is elementwise (int64 in, int64 out).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

I64 = torch.int64
FRACTION_BITS = 23  # j: a 23-bit fraction
SQUARE_COLUMNS = 15  # the squarer's top columns the C2 product uses
ACC_SHIFT = 15  # acc's units: 2^-15 of the result's ULP
C0_SHIFT = 13  # C0's units: 2^-2 of the result's ULP
TABLES = Path(__file__).with_name("mufu_tables.json")
FUNCTIONS = ("ex2", "rcp")


@cache
def _table(name: str) -> tuple[int, int, int, tuple[tuple[int, ...], ...]]:
    entry = json.loads(TABLES.read_text())["functions"][name]
    columns = tuple(zip(*entry["coefficients"], strict=True))  # (C0s, C1s, C2s)
    assert len(columns[0]) == 1 << entry["index_bits"], f"{name}: one coefficient triple per segment"
    return entry["index_bits"], entry["offset"], entry["c1_sign"], columns


def truncated_square(x_l: Tensor, n: int) -> Tensor:
    """The squarer's partial products of the n-bit x_l in columns >= 2n - SQUARE_COLUMNS, summed (int64)."""
    low = 2 * n - SQUARE_COLUMNS
    out = torch.zeros_like(x_l)
    for i in range(n):
        first = max(i + 1, low - i - 1)  # the partner bits j > i whose column i + j + 1 is kept
        partners = x_l & (((1 << n) - 1) & ~((1 << first) - 1))
        row = (partners << (i + 1)) + ((1 << (2 * i)) if 2 * i >= low else 0)
        out = out + ((x_l >> i) & 1) * row
    return out


@cache
def _square_terms(n: int, device: str) -> Tensor:
    """int64 [2^n]: truncated_square(x_l) >> (2n - SQUARE_COLUMNS) for every x_l (what C2 multiplies)."""
    x_l = torch.arange(1 << n, dtype=I64)
    return (truncated_square(x_l, n) >> (2 * n - SQUARE_COLUMNS)).to(device)


def interpolate(name: str, j: Tensor) -> Tensor:
    """int64: the unit's result for the 23-bit fractions j (int64 in [0, 2^23)) of `name` (module docstring)."""
    if name not in FUNCTIONS:
        raise ValueError(f"MUFU function {name!r}; allowed: {list(FUNCTIONS)}")
    m, offset, c1_sign, (c0, c1, c2) = _table(name)
    n = FRACTION_BITS - m
    seg, x_l = j >> n, j & ((1 << n) - 1)
    base = ((torch.tensor(c0, dtype=I64) << C0_SHIFT) + offset).to(j.device)[seg]
    slope = (c1_sign * torch.tensor(c1, dtype=I64)).to(j.device)[seg]
    curve = torch.tensor(c2, dtype=I64).to(j.device)[seg]
    return (base + slope * x_l + curve * _square_terms(n, str(j.device))[x_l]) >> ACC_SHIFT
