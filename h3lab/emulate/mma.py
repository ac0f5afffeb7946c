"""The sm90 tensor cores' FP32-accumulating addition (wgmma with bf16 or fp16 inputs), in exact integers.

One MMA step (a k16 wgmma) adds an accumulator c and 16 exact products a_i * b_i:
1. E = the largest of e(a_i) + e(b_i) over the nonzero products and e(c) for a nonzero c, e the
   IEEE unbiased exponent (a product's significand then lies in [1, 4)), and at least -133;
2. each of the 17 terms is truncated toward zero to a multiple of 2^(E - 23 - extra_bits), with
   extra_bits = 2 (FP32's 23 fraction bits at exponent E, plus 2; never finer than 2^-158);
3. the truncated terms are added exactly;
4. the sum is rounded toward zero to FP32, subnormals kept; past FLT_MAX it is +-inf; an exact zero
   is +0 whatever the terms' signs.
The steps of a dot chain in K order: each takes the previous result as c. This is Khattak &
Mikaitis's H100 model (arXiv 2512.07004, `models/H100TC.m`) as issue 31 reads it, with the edge
rules the H200 gave through the kernels' tl.dot tiles (h3lab.bench.mma_probe: every
probe dot equals the model; each recipe below tells its rule from the neighbour in mma_probe's
VARIANTS): overflow gives inf (the overflow recipe), an exact zero sum is +0 (signed_zero),
subnormal inputs and results are kept (their recipes), IEEE rules for inf and NaN with the NaN
0x7FFFFFFF (specials), and the floor of E (subnormal_products, products down to 2^-156: without a
floor, or with -132 or -134, some of its dots differ by one ULP). `HYPOTHESES` names what no probe
drew.

A step without an accumulator (wgmma's scale-d = 0: Triton's tl.dot without acc, e.g. attention's
q k^T) is `c=None`: the sum is the products' alone, the same bits as from c = +0 (a zero sum is +0
either way). The GEMM kernels start from an explicit +0 accumulator (scale-d = 1;
h3lab.bench.ptx_audit lists which site does which).

Vectorised in torch int64 (a step holds [..., M, N, group] products), exact on any device: no BLAS.
Dimension legend: M rows, K reduced, N columns, G the products of one step (<= group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.emulate.floats import FP32, FP32_INF_BITS, decompose, format_of, fp32_from_bits, fp32_rz_bits, shift

I64, I32 = torch.int64, torch.int32
NO_EXP = -(1 << 20)  # the exponent of "no term": below every real one
MMA_DTYPES = (torch.bfloat16, torch.float16)
# what no probe case drew: every adversarial recipe is bf16 (the kernels' MMA dtype), fp16 only random normals
HYPOTHESES = ("fp16 subnormal inputs",)


@dataclass(frozen=True)
class MmaModel:
    """One reading of the tensor cores' addition (module docstring); the defaults are sm90's, as measured.
    The other values of each field are the neighbours the probe tells apart (h3lab.bench.mma_probe)."""

    group: int = 16  # products per step (a k16 instruction)
    extra_bits: int = 2  # alignment bits below FP32's 23 at the largest exponent
    align_min: int = -133  # the least alignment exponent E (-1000: none); at most FP32's emin
    subnormal_inputs: str = "keep"  # bf16/fp16 subnormal inputs enter exactly, or as zeros ("flush")
    subnormal_output: str = "keep"  # a result below 2^-126 is truncated to the 2^-149 grid, or +-0 ("flush")
    overflow: str = "inf"  # a sum past FLT_MAX becomes +-inf, or +-FLT_MAX ("max", IEEE's toward zero)
    # an exact zero sum is +0 ("positive"), or -0 when every term has its sign bit set ("ieee")
    zero_sign: str = "positive"
    # the bits of every NaN result; "specials": inf * 0 and inf - inf give NaN, inf * x != 0 gives inf
    # of the product's sign, as in IEEE arithmetic
    nan_bits: int = 0x7FFFFFFF
    specials: str = "ieee"

    def __post_init__(self) -> None:
        allowed = {
            "subnormal_inputs": ("keep", "flush"),
            "subnormal_output": ("keep", "flush"),
            "overflow": ("max", "inf"),
            "zero_sign": ("ieee", "positive"),
            "specials": ("ieee",),
        }
        for name, values in allowed.items():
            if getattr(self, name) not in values:
                raise ValueError(f"MmaModel.{name}={getattr(self, name)!r}; allowed: {list(values)}")
        if self.group < 1 or not 0 <= self.extra_bits <= 4:  # 4: the aligned products stay below 2^28
            raise ValueError(f"MmaModel group={self.group}, extra_bits={self.extra_bits}; allowed: >= 1, 0 to 4")
        if not -1000 <= self.align_min <= FP32.emin:  # a floor inside the normal range would move normal sums
            raise ValueError(f"MmaModel.align_min={self.align_min}; allowed: -1000 to {FP32.emin}")


SM90 = MmaModel()


def _check_pair(a: Tensor, b: Tensor) -> None:
    if a.dtype != b.dtype or a.dtype not in MMA_DTYPES:
        raise ValueError(f"MMA operands {a.dtype} and {b.dtype}; allowed: both of one of {list(MMA_DTYPES)}")
    if a.dim() < 2 or b.dim() < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"MMA operands {tuple(a.shape)} @ {tuple(b.shape)}; allowed: [..., M, K] @ [..., K, N]")


def _pairwise(x_MG: Tensor, y_GN: Tensor) -> tuple[Tensor, Tensor]:
    """x broadcast to [..., M, 1, G] and y to [..., 1, N, G]: the operands of each product."""
    return x_MG.unsqueeze(-2), y_GN.transpose(-1, -2).unsqueeze(-3)


def _specials(pa, pb, flush: bool, c_parts, c_present: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(nan, +inf, -inf) masks [..., M, N] of one step: IEEE's rules for infinities and NaNs."""
    za = pa.zero | (pa.subnormal if flush else torch.zeros_like(pa.zero))
    zb = pb.zero | (pb.subnormal if flush else torch.zeros_like(pb.zero))
    (na, nb), (ia, ib), (za, zb) = _pairwise(pa.nan, pb.nan), _pairwise(pa.inf, pb.inf), _pairwise(za, zb)
    sa, sb = _pairwise(pa.sign, pb.sign)
    nan = (na | nb | (ia & zb) | (za & ib)).any(-1)
    inf = ia | ib
    pos, neg = (inf & ((sa ^ sb) == 0)).any(-1), (inf & ((sa ^ sb) == 1)).any(-1)
    if c_present:
        nan = nan | c_parts.nan
        pos, neg = pos | (c_parts.inf & (c_parts.sign == 0)), neg | (c_parts.inf & (c_parts.sign == 1))
    return nan | (pos & neg), pos, neg


def _has_specials(*xs: Tensor | None) -> bool:
    """Whether any operand holds an infinity or a NaN (one device sync; the step skips their rules if not)."""
    return any(x is not None and not bool(torch.isfinite(x).all()) for x in xs)


def mma_step(
    a_MG: Tensor, b_GN: Tensor, c_MN: Tensor | None, model: MmaModel = SM90, *, specials: bool = True
) -> Tensor:
    """One MMA step: FP32 [..., M, N] = c + sum over g of a[..., m, g] * b[..., g, n] (module docstring).

    G <= model.group products per element; c is FP32 [..., M, N] or None (no accumulator).
    `specials=False` skips the infinity and NaN rules: only for operands known to be finite.
    """
    _check_pair(a_MG, b_GN)
    if a_MG.shape[-1] > model.group:
        raise ValueError(f"mma_step: {a_MG.shape[-1]} products; allowed: at most model.group = {model.group}")
    # a product sig_a * sig_b is worth 2^(e_a + e_b - 2 frac); on the grid 2^(E - 23 - extra) it is
    # (sig_a * sig_b) << (23 + extra - 2 frac) >> (E - e_a - e_b): one right shift, truncating toward
    # zero on magnitudes (below 2^28 for extra_bits <= 4: int32)
    lift = FP32.frac_bits + model.extra_bits - 2 * format_of(a_MG.dtype).frac_bits
    flush = model.subnormal_inputs == "flush"
    pa, pb = decompose(a_MG), decompose(b_GN)
    sig_a = (torch.where(pa.subnormal, 0, pa.sig) if flush else pa.sig).to(I32) << lift
    sig_b = (torch.where(pb.subnormal, 0, pb.sig) if flush else pb.sig).to(I32)
    (ma, mb), (ea, eb) = _pairwise(sig_a, sig_b), _pairwise(pa.exp.to(I32), pb.exp.to(I32))
    (sa, sb) = _pairwise(pa.sign.to(torch.bool), pb.sign.to(torch.bool))
    prod, pexp, psign = ma * mb, ea + eb, sa ^ sb  # [..., M, N, G]: exact products (scaled)
    top = torch.where(prod != 0, pexp, NO_EXP).amax(-1)
    pc = decompose(c_MN) if c_MN is not None else None
    if pc is not None:
        top = torch.maximum(top, torch.where(pc.sig != 0, pc.exp, NO_EXP).to(I32))
    top = top.clamp(min=model.align_min)
    terms = prod >> (top.unsqueeze(-1) - pexp).clamp(0, 31)
    total = torch.where(psign, -terms, terms).sum(-1, dtype=I64)
    negative = psign.all(-1)
    if pc is not None:
        tc = shift(pc.sig, pc.exp - top.to(I64) + model.extra_bits)
        total = total + torch.where(pc.sign == 1, -tc, tc)
        negative = negative & (pc.sign == 1)
    unit = top.to(I64) - FP32.frac_bits - model.extra_bits  # one step of the aligned grid: 2^unit
    sign = (total < 0).to(I64)
    out = fp32_rz_bits(sign, total.abs(), unit, subnormals=model.subnormal_output, overflow=model.overflow)
    zero_sign = negative.to(I64) << 31 if model.zero_sign == "ieee" else torch.zeros_like(out)
    out = torch.where(total == 0, zero_sign, out)
    if specials:
        nan, pos, neg = _specials(pa, pb, flush, pc, pc is not None)
        out = torch.where(pos, FP32_INF_BITS, torch.where(neg, FP32_INF_BITS | (1 << 31), out))
        out = torch.where(nan, model.nan_bits, out)
    return fp32_from_bits(out)


def dot(
    a_MK: Tensor, b_KN: Tensor, c_MN: Tensor | None = None, *, model: MmaModel = SM90, block_k: int | None = None
) -> Tensor:
    """FP32 [..., M, N] = a @ b (+ c) as the tensor cores add it: steps of model.group products, K ascending.

    c: FP32 [..., M, N], or None for a first step without accumulator (module docstring).
    block_k: K is zero-padded to a multiple of it, as a kernel's last BLOCK_K chunk reads +0 past K
    (the extra steps add +0 products: they can move only the sign of a zero). Default: model.group.
    """
    _check_pair(a_MK, b_KN)
    if c_MN is not None and c_MN.dtype != torch.float32:
        raise ValueError(f"dot: c has dtype {c_MN.dtype}; allowed: torch.float32")
    step = block_k or model.group
    if step % model.group:
        raise ValueError(f"dot: block_k={block_k}; allowed: a multiple of model.group = {model.group}")
    K = a_MK.shape[-1]
    pad = -K % step
    if pad:
        a_MK = torch.nn.functional.pad(a_MK, (0, pad))
        b_KN = torch.nn.functional.pad(b_KN, (0, 0, 0, pad))
    acc = c_MN
    specials = model.overflow == "inf" or _has_specials(a_MK, b_KN, c_MN)  # else none can arise
    for k0 in range(0, K + pad, model.group):
        a_g, b_g = a_MK[..., k0 : k0 + model.group], b_KN[..., k0 : k0 + model.group, :]
        acc = mma_step(a_g, b_g, acc, model, specials=specials)
    if acc is None:  # K = 0 and no accumulator: the empty sum
        shape = (*torch.broadcast_shapes(a_MK.shape[:-2], b_KN.shape[:-2]), a_MK.shape[-2], b_KN.shape[-1])
        acc = torch.zeros(shape, dtype=torch.float32, device=a_MK.device)
    return acc


def chain_dot(
    pieces: Sequence[tuple[Tensor, Tensor]],
    c_MN: Tensor | None = None,
    *,
    model: MmaModel = SM90,
    block_k: int | None = None,
    dot_fn: Callable[..., Tensor] | None = None,
) -> Tensor:
    """One FP32 chain over several (a [..., M, Kp], b [..., Kp, N]) pieces in order (a unit of the
    unit-tree GEMM: each piece's K padded to block_k on its own, as its chunks restart at the piece);
    each piece through `dot_fn` (default `dot`; h3lab.emulate.wgmma.dot has its bits, faster)."""
    acc, step = c_MN, dot if dot_fn is None else dot_fn
    for a, b in pieces:
        acc = step(a, b, acc, model=model, block_k=block_k)
    if acc is None:
        raise ValueError("chain_dot: no pieces and no accumulator; allowed: at least one piece")
    return acc
