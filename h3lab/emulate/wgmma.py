"""The tensor cores' dots at the speed a CPU needs: h3lab.emulate.mma's model in a few float passes.

`mma.mma_step` states the model in int64 shifts; this computes the same bits for finite operands
with a few passes of float arithmetic that is exact by construction, which lets a CPU run the
emulated tiny block in seconds. Per MMA step (G <= model.group products of one output element,
plus its accumulator c), the exact path in float64:
- E, the largest of e(a) + e(b) over the nonzero products and e(c), from the operands' exponent
  fields: an int16 max-plus over the group (a zero operand gets an exponent below every real one);
- a product of two bf16 (fp16) values has at most 16 (22) significant bits: exact in float64;
- truncating a term to a multiple of 2^(E - 23 - extra_bits): scaling by a power of two is exact,
  `trunc` is exact;
- the sum of the truncated terms: integers of magnitude below 2^27 each (2^26 for c), at most 17 of
  them, so every partial sum is an integer below 2^32 and float64 adds them exactly in any order
  (the `sum` here is no library reduction order: no addition rounds);
- S * 2^(E - 25) is exact in float64; its rounding toward zero to FP32 is the round-to-nearest
  conversion stepped one ulp toward zero where it went away from zero.
The fast path (`_fast_step`, most steps) is the same arithmetic where every product and E lie well
inside FP32's normal range: E as the largest power of two 2^(e(a) + e(b)) of the group, products and
scaled terms in FP32 (exact there), the truncation an int32 conversion, the sum in int32 (below
2^31), and the rounding toward zero by dropping float64 fraction bits. It declines (None) every step
where one of those conditions fails, and the exact path computes that step.
The model's rules for an exact zero sum, an FP32-subnormal result and overflow are applied as its
fields say (`zero_sign`, `subnormal_output`, `overflow`). Cases whose rules are HYPOTHESES this code
does not restate (a product or operand below FP32's normal range, a subnormal accumulator,
infinities and NaNs) go to `mma.mma_step` itself for the elements and steps they touch, so the two
agree for every input whatever rules mma holds (tests/test_emulate_wgmma.py compares them).

Dimension legend: B batch (leading dims flattened), M rows, K reduced, N columns, G products of a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from h3lab.emulate import mma
from h3lab.emulate.floats import format_of

F32, F64, I16 = torch.float32, torch.float64, torch.int16
NO_EXP = -4000  # the exponent of a zero operand: a sum of two stays in int16 and below every real one
TINY_EXP = -2000  # a subnormal operand's exponent for the hypothesis check: forces its elements to mma
NORMAL_MIN = 2.0**-126  # FP32's smallest normal
# a product whose exponent-field sum is below this may fall below FP32's normal range (its
# significand lies in [1, 4)): the elements of such a step go to mma.mma_step
LOWEST_SAFE = -125
TARGET_ELEMENTS = 1 << 18  # products per row chunk and step: the float64 temporaries stay in cache


def exponents(x: Tensor, subnormal: int = TINY_EXP) -> Tensor:
    """int16: the IEEE unbiased exponent field of bf16/fp16/fp32 values, NO_EXP for zeros and
    `subnormal` for subnormals (infinities and NaNs: the field's exponent, bias + 1)."""
    fmt = format_of(x.dtype)
    view = x.contiguous().view(torch.int16 if fmt.width == 16 else torch.int32).to(torch.int32)
    field = (view >> fmt.frac_bits) & ((1 << fmt.exp_bits) - 1)
    magnitude = view & ((1 << (fmt.width - 1)) - 1)
    e = torch.where(field == 0, torch.full_like(field, subnormal), field - fmt.bias)
    return torch.where(magnitude == 0, torch.full_like(field, NO_EXP), e).to(I16)


def _pow2(e: Tensor) -> Tensor:
    """float64 2^e for integer e in [-1022, 1023], from the exponent bits (exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(F64)


class _Operands:
    """One dot's operands, prepared once, each step's group first ([steps, G, B, rows]): FP32 values
    and powers of two 2^e for the fast path; float64 values, exponent fields and sign bits, built on
    first use, for the exact one; per-step lowest exponents for the hypothesis check."""

    def __init__(self, a_BMK: Tensor, b_BKN: Tensor, group: int) -> None:
        self.group = group
        self.raw_a, self.raw_bt = a_BMK, b_BKN.transpose(-1, -2).contiguous()  # [B, M, K], [B, N, K]
        self.a32, self.bt32 = self._by_step(self.raw_a.to(F32)), self._by_step(self.raw_bt.to(F32))
        self.a2, self.bt2 = _power_of_two(self.a32), _power_of_two(self.bt32)
        # the lowest nonzero exponent of each operand row (column) per step: TINY_EXP for subnormals
        lo = lambda x: torch.where(x == NO_EXP, 4000, x.to(torch.int32)).amin(1)  # noqa: E731
        self.lo_a, self.lo_b = lo(self._by_step(exponents(a_BMK))), lo(self._by_step(exponents(self.raw_bt)))
        # steps in which no element can hold a product below the safe range (the common case)
        self.safe = (self.lo_a.amin(dim=(1, 2)) + self.lo_b.amin(dim=(1, 2)) >= LOWEST_SAFE).tolist()
        self._exact: dict[str, Tensor] | None = None

    def _by_step(self, x: Tensor) -> Tensor:
        """[B, rows, K] -> [steps, G, B, rows]."""
        return x.unflatten(-1, (-1, self.group)).permute(2, 3, 0, 1).contiguous()

    @property
    def exact(self) -> dict[str, Tensor]:
        """The exact path's operands: float64 values, int16 exponent fields, sign bits."""
        if self._exact is None:
            a, bt = self.raw_a, self.raw_bt
            self._exact = {
                "a64": self.a32.to(F64),
                "bt64": self.bt32.to(F64),
                "ea": self._by_step(exponents(a)),
                "ebt": self._by_step(exponents(bt)),
                "sa": self._by_step(torch.signbit(a)),
                "sbt": self._by_step(torch.signbit(bt)),
            }
        return self._exact


def _power_of_two(x_f32: Tensor) -> Tensor:
    """FP32 2^e(x) for normal x (its exponent bits alone), 0 for zeros and subnormals."""
    return (x_f32.view(torch.int32) & 0x7F800000).view(F32)


def _rz_f32(x: Tensor) -> Tensor:
    """float64 values of FP32's normal range (or past it) rounded toward zero to FP32: the low 29 bits
    of the float64 fraction dropped, then an exact conversion (past FLT_MAX: inf)."""
    return (x.view(torch.int64) & ~((1 << 29) - 1)).view(F64).to(F32)


def _round_fp32(x: Tensor, model: mma.MmaModel) -> Tensor:
    """FP32 of the exact float64 values x rounded toward zero, with the model's overflow and subnormal rules."""
    y = x.to(torch.float32)
    away = y.to(F64).abs() > x.abs()
    y = torch.where(away, torch.nextafter(y, torch.zeros_like(y)), y)  # toward zero; past FLT_MAX: FLT_MAX
    if model.overflow == "inf":
        y = torch.where(x.abs() >= 2.0**128, torch.copysign(torch.full_like(y, float("inf")), y), y)
    if model.subnormal_output == "flush":
        y = torch.where(x.abs() < NORMAL_MIN, torch.copysign(torch.zeros_like(y), y), y)
    return y


def _zero_signs(ops: _Operands, s: int, rows: slice, c: Tensor | None, y: Tensor, total: Tensor, model) -> Tensor:
    """y with its exact zero sums (total == 0) given the model's sign ("positive": +0, as computed)."""
    if model.zero_sign == "positive":
        return y
    zero = total == 0
    if not bool(zero.any()):
        return y
    ex = ops.exact
    neg = (ex["sa"][s, :, :, rows].unsqueeze(-1) ^ ex["sbt"][s].unsqueeze(-2)).all(0)
    neg = neg & torch.signbit(c) if c is not None else neg
    return torch.where(zero, torch.where(neg, -0.0, 0.0).to(y.dtype), y)


def _fast_step(ops: _Operands, s: int, rows: slice, c: Tensor | None, model: mma.MmaModel) -> Tensor | None:
    """The step in FP32 products, or None where its conditions fail: every product within FP32's
    normal range (exact there: at most 16 significant bits; `safe` and pe <= 126), E in [-100, 127]
    (so 2^(25 - E) is a normal FP32, the result is normal: no subnormal accumulator follows), terms
    summed in int32 (16 below 2^27: below 2^31). Then S * 2^(E-25) in float64 and `_rz_f32`."""
    if model.group > 16 or model.extra_bits != 2 or model.subnormal_output != "keep" or not ops.safe[s]:
        return None
    top = (ops.a2[s, :, :, rows].unsqueeze(-1) * ops.bt2[s].unsqueeze(-2)).amax(0)  # 2^(max pe) [B, m, N]
    if float(top.max()) > 2.0**126:  # a product that FP32 may not hold
        return None
    if c is not None:
        top = torch.maximum(top, _power_of_two(c))
    field = top.view(torch.int32) >> 23  # E + 127 (0: no nonzero term)
    if int(field.min()) < 27:  # E < -100
        return None
    inv = ((279 - field) << 23).view(F32)  # 2^(25 - E)
    p = ops.a32[s, :, :, rows].unsqueeze(-1) * ops.bt32[s].unsqueeze(-2)  # [G, B, m, N], exact
    total = p.mul_(inv).to(torch.int32).sum(0, dtype=torch.int32).to(F64)  # truncations toward zero, exact sum
    if c is not None:
        total += (c * inv).to(torch.int32).to(F64)
    unit = ((field.to(torch.int64) - 25 - 127 + 1023) << 52).view(F64)  # 2^(E - 25)
    x = total * unit
    y = _rz_f32(x)
    if model.overflow == "max":
        y = y.clamp(-torch.finfo(F32).max, torch.finfo(F32).max)
    return _zero_signs(ops, s, rows, c, y, total, model)


def _step(ops: _Operands, s: int, rows: slice, c: Tensor | None, model: mma.MmaModel) -> Tensor:
    """One MMA step (step s's G products) of rows `rows`: FP32 [B, m, N] from c (FP32 [B, m, N] or None)."""
    fast = _fast_step(ops, s, rows, c, model)
    if fast is not None:
        return fast
    ex = ops.exact
    ea, ebt = ex["ea"][s, :, :, rows], ex["ebt"][s]
    top = (ea.unsqueeze(-1) + ebt.unsqueeze(-2)).amax(0).to(torch.int32)  # [B, m, N]
    if c is not None:
        top = torch.maximum(top, exponents(c).to(torch.int32))
    top = torch.where(top < NO_EXP // 2, 0, top)  # no nonzero term: the sum is 0 at any scale
    unit = top - 23 - model.extra_bits
    p = ex["a64"][s, :, :, rows].unsqueeze(-1) * ex["bt64"][s].unsqueeze(-2)  # [G, B, m, N], exact
    p.mul_(_pow2(-unit)).trunc_()
    total = p.sum(0)  # integers below 2^32: exact in any order (module docstring)
    if c is not None:
        total += (c.to(F64) * _pow2(-unit)).trunc_()
    y = _zero_signs(ops, s, rows, c, _round_fp32(total * _pow2(unit), model), total, model)
    return _hypotheses(ops, s, rows, c, y, model)


def _hypotheses(ops: _Operands, s: int, rows: slice, c: Tensor | None, y: Tensor, model: mma.MmaModel) -> Tensor:
    """y with the elements whose step touches an unconfirmed rule recomputed by mma.mma_step."""
    flag = None
    if not ops.safe[s]:
        flag = (ops.lo_a[s, :, rows].unsqueeze(-1) + ops.lo_b[s].unsqueeze(-2)) < LOWEST_SAFE
    if c is not None:
        sub = (c != 0) & (c.abs() < NORMAL_MIN)
        flag = sub if flag is None else flag | sub
    if flag is None or not bool(flag.any()):
        return y
    b, m, n = flag.nonzero(as_tuple=True)
    g = slice(s * model.group, (s + 1) * model.group)
    a_sel = ops.raw_a[:, rows, g][b, m].unsqueeze(-2)  # [F, 1, G]
    b_sel = ops.raw_bt[:, :, g][b, n].unsqueeze(-1)  # [F, G, 1]
    c_sel = c[b, m, n].reshape(-1, 1, 1) if c is not None else None
    y = y.clone()
    y[b, m, n] = mma.mma_step(a_sel, b_sel, c_sel, model, specials=False).reshape(-1)
    return y


def dot(
    a_MK: Tensor,
    b_KN: Tensor,
    c_MN: Tensor | None = None,
    *,
    model: mma.MmaModel = mma.SM90,
    block_k: int | None = None,
) -> Tensor:
    """FP32 [..., M, N]: exactly `h3lab.emulate.mma.dot(a, b, c, model=model, block_k=block_k)`.

    a [..., M, K], b [..., K, N] bf16 or fp16 (one dtype), c FP32 [..., M, N] or None (a first step
    without accumulator); leading dims broadcast. Operands with an infinity or a NaN go to mma.dot.
    """
    mma._check_pair(a_MK, b_KN)
    if c_MN is not None and c_MN.dtype != torch.float32:
        raise ValueError(f"dot: c has dtype {c_MN.dtype}; allowed: torch.float32")
    step = block_k or model.group
    if step % model.group:
        raise ValueError(f"dot: block_k={block_k}; allowed: a multiple of model.group = {model.group}")
    if mma._has_specials(a_MK, b_KN, c_MN):
        return mma.dot(a_MK, b_KN, c_MN, model=model, block_k=block_k)
    batch = torch.broadcast_shapes(a_MK.shape[:-2], b_KN.shape[:-2], c_MN.shape[:-2] if c_MN is not None else ())
    (M, K), N = a_MK.shape[-2:], b_KN.shape[-1]
    if K == 0 and c_MN is None:
        return torch.zeros((*batch, M, N), dtype=torch.float32, device=a_MK.device)
    pad = -K % step
    a = torch.nn.functional.pad(a_MK, (0, pad)).expand(*batch, M, K + pad).reshape(-1, M, K + pad)
    b = torch.nn.functional.pad(b_KN, (0, 0, 0, pad)).expand(*batch, K + pad, N).reshape(-1, K + pad, N)
    c = c_MN.expand(*batch, M, N).reshape(-1, M, N) if c_MN is not None else None
    ops = _Operands(a, b, model.group)
    out = torch.empty((a.shape[0], M, N), dtype=torch.float32, device=a.device)
    rows_per = max(1, TARGET_ELEMENTS // max(1, a.shape[0] * N * model.group))
    for r0 in range(0, M, rows_per):
        rows = slice(r0, min(M, r0 + rows_per))
        acc = c[:, rows] if c is not None else None
        for s in range((K + pad) // model.group):
            acc = _step(ops, s, rows, acc, model)
        out[:, rows] = acc if acc is not None else 0.0
    return out.reshape(*batch, M, N)


def chain_dot(
    pieces: Sequence[tuple[Tensor, Tensor]],
    c_MN: Tensor | None = None,
    *,
    model: mma.MmaModel = mma.SM90,
    block_k: int | None = None,
) -> Tensor:
    """Exactly `h3lab.emulate.mma.chain_dot`: one FP32 chain over the pieces in order, each piece's K
    padded to block_k on its own."""
    return mma.chain_dot(pieces, c_MN, model=model, block_k=block_k, dot_fn=dot)
