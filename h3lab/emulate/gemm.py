"""The sm90 GEMM kernels' arithmetic on any device: mm, the unit-tree GEMM, row_mm and the few-row pair.

Each function gives the bits of its h3lab.triton launcher on an H100/H200 (kernels/sm90.json), as
the kernel computes them (h3lab.triton.gemm, unit_gemm and unit_gemm_sm90, rows, few_rows, chain):
- `mm`: every output element is one chain over K from +0, in BLOCK_K chunks ascending; a chunk is
  BLOCK_K / 16 tensor-core steps (h3lab.emulate.wgmma, the MMA model) for bf16 x bf16, or one
  IEEE FMA per k (h3lab.emulate.fma.fma_dot) when an operand is FP32; the K tail reads +0; then one
  rounding to the output dtype (round to nearest even). Tiles, row buckets, the row tail, TMA,
  persistence and the Gluon pipeline only decide where an element is computed, not how;
- `unit_mm`: per unit one chain from +0 over its column block of every piece, pieces in order,
  each piece's chunks restarting at the unit's start (its last chunk masked at the unit's end);
  then the contract's unit tree in FP32 adds;
- `row_mm`: mm over the rows in key order (K = rows);
- `unit_mm_few_rows`: per unit one IEEE FMA chain over its K (both operands converted to FP32),
  chunks of BLOCK_K with the tail read as +0, then the unit tree;
- `mm_few_k`: per element acc = acc + a[k] * b[k] from +0, k ascending, each product and each sum
  one FP32 rounding (no contraction), then one rounding to the output dtype.
No BLAS and no library reduction: the products and sums are the models' (module docs there).

Dimension legend: M rows, K reduced, N columns, U units, T timesteps (few rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from h3lab.emulate import mma, tiles, wgmma
from h3lab.emulate.fma import fma_dot
from h3lab.ops.fixed import round_to, unit_tree

F32 = torch.float32
OPERAND_DTYPES = (torch.bfloat16, torch.float32)


def _check(fn: str, *tensors: Tensor) -> None:
    for t in tensors:
        if t.dim() != 2 or t.dtype not in OPERAND_DTYPES:
            raise ValueError(f"{fn}: operand {t.dtype} {tuple(t.shape)}; allowed: 2-D, one of {list(OPERAND_DTYPES)}")


def _pad_k(a_MK: Tensor, b_KN: Tensor, block_k: int) -> tuple[Tensor, Tensor]:
    pad = -a_MK.shape[-1] % block_k
    return torch.nn.functional.pad(a_MK, (0, pad)), torch.nn.functional.pad(b_KN, (0, 0, 0, pad))


def chain(a_MK: Tensor, b_KN: Tensor, acc_MN: Tensor, *, ieee: bool, block_k: int, model: mma.MmaModel) -> Tensor:
    """acc continued over K in block_k chunks (the tail read as +0): tensor-core steps or IEEE FMAs.
    Leading dims broadcast (a unit's chain is a batch entry)."""
    if ieee:
        a, b = _pad_k(a_MK.to(F32), b_KN.to(F32), block_k)
        return fma_dot(a, b, acc_MN)
    return wgmma.dot(a_MK, b_KN, acc_MN, model=model, block_k=block_k)


def mm(a_MK: Tensor, b_KN: Tensor, out_dtype: torch.dtype = F32, *, model: mma.MmaModel = mma.SM90) -> Tensor:
    """h3lab.triton.gemm.mm's bits: a @ b, one chain over K per element from +0, rounded once."""
    _check("mm", a_MK, b_KN)
    if a_MK.shape[1] != b_KN.shape[0]:
        raise ValueError(f"mm: a_MK {tuple(a_MK.shape)}, b_KN {tuple(b_KN.shape)}; allowed: a.shape[1] == b.shape[0]")
    ieee = F32 in (a_MK.dtype, b_KN.dtype)
    block_k = tiles.gemm_block_k("gemm", ieee)
    acc = torch.zeros((a_MK.shape[0], b_KN.shape[1]), dtype=F32, device=a_MK.device)
    if acc.numel() and a_MK.shape[1]:
        acc = chain(a_MK, b_KN, acc, ieee=ieee, block_k=block_k, model=model)
    return round_to(acc, out_dtype)


def unit_mm(pieces: Sequence[tuple[Tensor, Tensor]], num_units: int, *, model: mma.MmaModel = mma.SM90) -> Tensor:
    """h3lab.triton.unit_gemm.unit_mm's bits: FP32 [M, N], per unit one chain over its blocks of every
    piece in order, then the unit tree."""
    pieces = list(pieces)
    if not pieces or any(a.shape[1] != b.shape[0] or a.shape[1] % num_units for a, b in pieces):
        shapes = [(tuple(a.shape), tuple(b.shape)) for a, b in pieces]
        raise ValueError(f"unit_mm: pieces {shapes}, {num_units} units; allowed: a.shape[1] == b.shape[0] = U * Kp")
    for a, b in pieces:
        _check("unit_mm", a, b)
    ieee = any(t.dtype == F32 for p in pieces for t in p)
    block_k = tiles.gemm_block_k("unit_gemm", ieee)
    M, N = pieces[0][0].shape[0], pieces[0][1].shape[1]
    acc = torch.zeros((num_units, M, N), dtype=F32, device=pieces[0][0].device)
    if acc.numel():
        for a, b in pieces:
            kp = a.shape[1] // num_units
            a_UMK = a.unflatten(1, (num_units, kp)).transpose(0, 1)
            b_UKN = b.unflatten(0, (num_units, kp))
            acc = chain(a_UMK, b_UKN, acc, ieee=ieee, block_k=block_k, model=model)
    return unit_tree(list(acc.unbind(0)))


def row_mm(
    a_RN: Tensor, b_RK: Tensor, order: Tensor, out_dtype: torch.dtype = F32, *, model: mma.MmaModel = mma.SM90
) -> Tensor:
    """h3lab.triton.rows.row_mm's bits: [N, K] = sum over rows r in `order` of a[r]^T b[r], as mm over
    the rows in key order (the empty sum for no active row)."""
    if order.numel() == 0:
        return torch.zeros((a_RN.shape[1], b_RK.shape[1]), dtype=out_dtype, device=a_RN.device)
    return mm(a_RN.index_select(0, order).t(), b_RK.index_select(0, order), out_dtype, model=model)


def unit_mm_few_rows(a_TK: Tensor, b_KN: Tensor, num_units: int, *, model: mma.MmaModel = mma.SM90) -> Tensor:
    """The backend's unit_reduce_few_rows on sm90: up to `max_rows` rows the few-row kernel
    (h3lab.triton.few_rows.unit_mm_few_rows: IEEE FMA chains per unit, then the tree), past it unit_mm."""
    cfg = tiles.few_rows()
    if a_TK.shape[0] > cfg["max_rows"]:
        return unit_mm([(a_TK, b_KN)], num_units, model=model)
    _check("unit_mm_few_rows", a_TK, b_KN)
    (T, K), N = a_TK.shape, b_KN.shape[1]
    if b_KN.shape[0] != K or K % num_units:
        raise ValueError(f"unit_mm_few_rows: a {tuple(a_TK.shape)}, b {tuple(b_KN.shape)}, {num_units} units")
    kp = K // num_units
    acc = torch.zeros((num_units, T, N), dtype=F32, device=a_TK.device)
    if acc.numel() and kp:
        a_UTK = a_TK.unflatten(1, (num_units, kp)).transpose(0, 1)
        acc = chain(a_UTK, b_KN.unflatten(0, (num_units, kp)), acc, ieee=True, block_k=cfg["BLOCK_K"], model=model)
    return unit_tree(list(acc.unbind(0)))


def mm_few_k(a_KM: Tensor, b_KN: Tensor, out_dtype: torch.dtype = F32, *, model: mma.MmaModel = mma.SM90) -> Tensor:
    """The backend's mm_few_k on sm90: a^T @ b, up to `max_k` the chain kernel (h3lab.triton.chain:
    rounded products added k ascending from +0, no FMA), past it mm."""
    if a_KM.shape[0] > tiles.few_rows()["max_k"]:
        return mm(a_KM.t(), b_KN, out_dtype, model=model)
    _check("mm_few_k", a_KM, b_KN)
    if a_KM.shape[0] != b_KN.shape[0]:
        raise ValueError(f"mm_few_k: a_KM {tuple(a_KM.shape)}, b_KN {tuple(b_KN.shape)}; allowed: the same K")
    a, b = a_KM.to(F32), b_KN.to(F32)
    acc = torch.zeros((a.shape[1], b.shape[1]), dtype=F32, device=a.device)
    for k in range(a.shape[0]):
        acc = acc + a[k].unsqueeze(1) * b[k].unsqueeze(0)  # two roundings: the kernel runs without fusion
    return round_to(acc, out_dtype)
