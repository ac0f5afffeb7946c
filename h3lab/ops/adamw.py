"""AdamW's update of one piece of FP32 master weights, and the write-back with one rounding: the reference.

Step t, with g = FP32 gradient * clip coefficient, the scalars `s` (ADAMW_SCALARS, FP32):
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + (g * g) * (1 - beta2)
    master = master * decay                                         (decay = 1 - lr * weight_decay)
    master = master - (m / (sqrt(v) / bias2_sqrt + eps)) * step_size
    weight = round_to(master, weight's dtype)
Every operation is a separate IEEE FP32 mul, add, sub, div or sqrt, so element i's result depends on
element i's operands only: a piece updated whole or in slices, on any rank or device, gives the same
bytes. torch's lerp_, addcmul_ and addcdiv_ may fuse a multiply-add on the vector path and not on the
scalar tail, so they are not used; torch's FP32 sqrt on CPU is not correctly rounded either
(`sqrt_f32` says how it is). Every scalar is an element of one FP32 tensor on the piece's
device: CUDA turns a division by a host scalar into a multiply by its reciprocal (another rounding).
`adamw_updates` is this update of many pieces with one clip coefficient and one set of scalars,
and says which pieces' weights hold a NaN or Inf after it; h3lab.triton.adamw is `adamw_updates`
in a few kernel launches (one per group of like pieces).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from h3lab.ops.fixed import round_to, sqrt_f32

# the order of the scalars in the FP32 tensor `s` every update reads
ADAMW_SCALARS = ("decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "bias2_sqrt", "step_size", "eps")
DECAY, BETA1, OMB1, BETA2, OMB2, BIAS2_SQRT, STEP_SIZE, EPS = range(len(ADAMW_SCALARS))
AdamWPiece = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # (master, exp_avg, exp_avg_sq, grad, weight)


def adamw_update(
    master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, coef: Tensor, s: Tensor, weight: Tensor
) -> None:
    """One AdamW step of one piece, in place: the FP32 `master`, `exp_avg`, `exp_avg_sq`, then `weight`.

    `grad` (bf16 or fp32, any strides) is read, never written; `coef` is the clip coefficient (0-d FP32);
    `s` the step's FP32 scalars in ADAMW_SCALARS order; `weight` (bf16 or fp32, a view allowed) gets
    the master rounded once.
    """
    g = grad.to(torch.float32) * coef
    exp_avg.mul_(s[BETA1]).add_(g * s[OMB1])
    exp_avg_sq.mul_(s[BETA2]).add_((g * g).mul_(s[OMB2]))
    master.mul_(s[DECAY])
    denom = sqrt_f32(exp_avg_sq).div_(s[BIAS2_SQRT]).add_(s[EPS])
    master.sub_(torch.div(exp_avg, denom).mul_(s[STEP_SIZE]))
    weight.copy_(round_to(master, weight.dtype))


def adamw_updates(pieces: Sequence[AdamWPiece], coef: Tensor, s: Tensor, go: Tensor | None = None) -> Tensor:
    """`adamw_update` of every piece (master, exp_avg, exp_avg_sq, grad, weight) in order, each with
    `coef` and `s`; [P] bool on the pieces' device: whether piece k's weight holds a NaN or Inf after it.
    `go` (0-d bool on that device; None: true): false leaves every piece as it was (no flag set), so a
    caller can queue the update before it knows whether the step may run (the GPU kernels read it
    there; here it is read on the host)."""
    if go is not None and not bool(go):
        return torch.zeros(len(pieces), dtype=torch.bool, device=s.device)
    for master, exp_avg, exp_avg_sq, grad, weight in pieces:
        adamw_update(master, exp_avg, exp_avg_sq, grad, coef, s, weight)
    if not pieces:
        return torch.zeros(0, dtype=torch.bool, device=s.device)
    return torch.stack([~torch.isfinite(w).all() for *_, w in pieces])
