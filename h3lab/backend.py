"""The one backend seam: which kernels compute the block's reductions.

- `torch`: the canonical arithmetic in plain torch ops (h3lab.ops), on CPU and GPU.
- `triton`: the same contract as GPU kernels (h3lab.kernels; CUDA only).
- `baseline`: what people run today — library GEMMs (BLAS / cuBLAS), whatever order they pick,
  one GEMM per rank over its local K instead of unit partials, physical row order for weight
  gradients. It exists so reports can show where bits diverge; it is never a fallback.

`get_backend` is the only place a backend is chosen; an explicit choice that cannot be honoured
raises, nothing falls back silently.

Dimension legend: M rows, K reduced, N columns, R rows of a cross-row reduction, G segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from h3lab.ops import attention as att
from h3lab.ops import rows
from h3lab.ops.fixed import chain_mm, unit_tree

BACKENDS = ("torch", "triton", "baseline")
Pieces = Sequence[tuple[Tensor, Tensor]]  # one unit's chained GEMM operands (a_MK, b_KN), in order


class Backend(Protocol):
    name: str

    def mm(self, a_MK: Tensor, b_KN: Tensor) -> Tensor:
        """a @ b, FP32 [M, N]; a row's bits may not depend on M nor a column's on N."""
        ...

    def unit_reduce(self, units: Sequence[Pieces]) -> Tensor:
        """Per unit one chain over its pieces, then the subtree over the units: FP32 [M, N]."""
        ...

    def row_mm(self, a_RN: Tensor, b_RK: Tensor, order: Tensor) -> Tensor: ...

    def row_sum(self, x_R: Tensor, order: Tensor) -> Tensor: ...

    def segment_sum(self, x_R: Tensor, segment_R: Tensor, num_segments: int, order: Tensor) -> Tensor: ...

    def attention_fwd(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]: ...

    def attention_bwd_q(self, *args: Tensor | float) -> Tensor: ...

    def attention_bwd_kv(self, *args: Tensor | float) -> tuple[Tensor, Tensor]: ...


class TorchBackend:
    """The canonical arithmetic (h3-parallel-v1) in torch ops; CPU and CUDA."""

    name = "torch"

    def mm(self, a_MK: Tensor, b_KN: Tensor) -> Tensor:
        return chain_mm(a_MK, b_KN)

    def unit_reduce(self, units: Sequence[Pieces]) -> Tensor:
        partials = []
        for pieces in units:
            acc = None
            for a, b in pieces:
                acc = chain_mm(a, b, acc)
            partials.append(acc)
        return unit_tree(partials)

    row_mm = staticmethod(rows.row_mm)
    row_sum = staticmethod(rows.row_sum)
    segment_sum = staticmethod(rows.segment_sum)
    attention_fwd = staticmethod(att.attention_fwd)
    attention_bwd_q = staticmethod(att.attention_bwd_q)
    attention_bwd_kv = staticmethod(att.attention_bwd_kv)


class BaselineBackend:
    """Library kernels in the same block structure: torch.mm, torch.sum, index_add_, softmax."""

    name = "baseline"

    def mm(self, a_MK: Tensor, b_KN: Tensor) -> Tensor:
        return torch.mm(a_MK, b_KN.to(a_MK.dtype)).to(torch.float32)

    def unit_reduce(self, units: Sequence[Pieces]) -> Tensor:
        # one GEMM over everything this rank holds, as a plain row-parallel Linear shard does
        a = torch.cat([a for pieces in units for a, _ in pieces], dim=1)
        b = torch.cat([b for pieces in units for _, b in pieces], dim=0)
        return self.mm(a, b)

    def row_mm(self, a_RN: Tensor, b_RK: Tensor, order: Tensor) -> Tensor:
        active = order.sort().values  # physical order, padding dropped
        return torch.mm(a_RN[active].t(), b_RK[active].to(a_RN.dtype)).to(torch.float32)

    def row_sum(self, x_R: Tensor, order: Tensor) -> Tensor:
        return x_R[order.sort().values].to(torch.float32).sum(0)

    def segment_sum(self, x_R: Tensor, segment_R: Tensor, num_segments: int, order: Tensor) -> Tensor:
        active = order.sort().values
        out = x_R.new_zeros((num_segments, *x_R.shape[1:]), dtype=torch.float32)
        return out.index_add_(0, segment_R[active], x_R[active].to(torch.float32))

    def attention_fwd(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        s = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)).float() * scale
        rowmax = s.amax(-1)
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p, v.transpose(0, 1).float())
        return o.transpose(0, 1), rowmax, torch.exp(s - rowmax.unsqueeze(-1)).sum(-1)

    def _probs_ds(self, q, do, rowmax, denom, delta, k, v, scale):
        s = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)).float() * scale
        p = torch.exp(s - rowmax.unsqueeze(-1)) / denom.unsqueeze(-1)
        dp = torch.matmul(do.transpose(0, 1).float(), v.permute(1, 2, 0).float())
        return p * (dp - delta.unsqueeze(-1)), p

    def attention_bwd_q(self, q, do, rowmax, denom, delta, k, v, scale) -> Tensor:
        ds, _ = self._probs_ds(q, do, rowmax, denom, delta, k, v, scale)
        return (torch.matmul(ds, k.transpose(0, 1).float()) * scale).transpose(0, 1)

    def attention_bwd_kv(self, q, do, rowmax, denom, delta, k, v, scale) -> tuple[Tensor, Tensor]:
        ds, p = self._probs_ds(q, do, rowmax, denom, delta, k, v, scale)
        dk = torch.matmul(ds.transpose(1, 2), q.transpose(0, 1).float()) * scale
        dv = torch.matmul(p.transpose(1, 2), do.transpose(0, 1).float())
        return dk.transpose(0, 1), dv.transpose(0, 1)


def get_backend(name: str | None, device: torch.device | str = "cpu") -> Backend:
    """The backend named `name` for `device` (None: "torch"). Raises when it cannot be honoured."""
    device = torch.device(device)
    name = name or "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; allowed: {list(BACKENDS)}")
    if name == "torch":
        return TorchBackend()
    if name == "baseline":
        return BaselineBackend()
    if device.type != "cuda":
        raise ValueError(f"backend 'triton' needs a CUDA device, got {device}; allowed on {device.type}: torch")
    from h3lab.kernels import triton_backend

    return triton_backend.TritonBackend(device)
