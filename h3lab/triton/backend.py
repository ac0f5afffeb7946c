"""`TritonBackend`: the Backend protocol of h3lab.backend computed by the Triton kernels of h3lab.triton.

Every kernel runs the configuration pinned for this node type (kernels/<node>.json); `describe()`
returns that file for run records. Which bits each family gives:
- GEMMs (mm, unit_reduce, row_mm, the few-row AdaLN pair) and attention: tensor-core (or IEEE FP32)
  sums in pinned tile orders, their own bits, equal across layouts on one GPU type
  (h3lab.triton.gemm, unit_gemm, few_rows, attention);
- row-local ops (norms, RoPE and its tables, SwiGLU, silu, gated residual), the row chains
  (row_sum, segment_sum), the float32 modules' chain GEMM and the training step's sums of squares
  and AdamW update: the torch backend's bits, by construction (h3lab.triton.norm, elementwise,
  rope, rows, chain, squares, adamw).

Constructed for a CUDA device (`get_backend("triton", device)`); interpreter runs on CPU
(TRITON_INTERPRET=1) name the node type explicitly: `TritonBackend("cpu", node="sm90")`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from h3lab import rowplan
from h3lab.ops.fixed import Pieces
from h3lab.triton import (
    adamw,
    attention,
    chain,
    configs,
    elementwise,
    few_rows,
    gemm,
    norm,
    rope,
    rows,
    squares,
    unit_gemm,
)

F32 = torch.float32


class TritonBackend:
    """The h3-parallel-v1 contract as Triton kernels, one pinned configuration per node type."""

    name = "triton"

    def __init__(self, device: torch.device | str, node: str | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.node = configs.node_of(self.device)
            if node is not None and node != self.node:
                raise ValueError(
                    f"node {node!r} named for {self.device}, which is {self.node!r}; allowed: {self.node!r}"
                )
        elif configs.interpreting() and node is not None:
            self.node = node
        else:
            raise ValueError(
                f"TritonBackend needs a CUDA device, got {self.device}; allowed: cuda, or a CPU device with "
                f"TRITON_INTERPRET=1 and an explicit node (one of {configs.available()})"
            )
        configs.pinned("norm", self.node)  # fail at construction when the node type has no pinned file
        if not configs.verified(self.node):
            warnings.warn(
                f"kernels/{self.node}.json is not verified: its configurations compile for {self.node} "
                f"(python -m h3lab.bench.compile_pinned --node {self.node}), but no bits, timings or layouts "
                "have been checked on such a GPU (kernels/README.md)",
                stacklevel=2,
            )

    def describe(self) -> dict[str, Any]:
        """The pinned configurations this backend runs, plus the Triton version (for run records)."""
        return configs.describe(self.node)

    # ---- GEMMs and cross-row reductions --------------------------------------------------------
    def mm(self, a_MK: Tensor, b_KN: Tensor, out_dtype: torch.dtype = F32) -> Tensor:
        return gemm.mm(a_MK, b_KN, out_dtype, node=self.node)

    def unit_reduce(self, pieces: Pieces, num_units: int) -> Tensor:
        return unit_gemm.unit_mm(pieces, num_units, node=self.node)

    # The AdaLN pair: up to the pinned few-row limit (16 timesteps on sm90) the few-row kernels, past
    # it the tiled ones. T is the batch's timestep count, the same on every rank, so a layout never
    # changes which kernel (and which bits) a block gets.
    def unit_reduce_few_rows(self, a_TK: Tensor, b_KN: Tensor, num_units: int) -> Tensor:
        if a_TK.shape[0] <= configs.pinned("few_rows", self.node)["max_rows"]:
            return few_rows.unit_mm_few_rows(a_TK, b_KN, num_units, node=self.node)
        return unit_gemm.unit_mm([(a_TK, b_KN)], num_units, node=self.node)

    def mm_few_k(self, a_KM: Tensor, b_KN: Tensor, out_dtype: torch.dtype = F32) -> Tensor:
        if a_KM.shape[0] <= configs.pinned("few_rows", self.node)["max_k"]:
            return few_rows.mm_few_k(a_KM, b_KN, out_dtype, node=self.node)
        return gemm.mm(a_KM.t(), b_KN, out_dtype, node=self.node)

    def row_mm(self, a_RN: Tensor, b_RK: Tensor, order: Tensor, out_dtype: torch.dtype = F32) -> Tensor:
        return rows.row_mm(a_RN, b_RK, order, out_dtype, node=self.node)

    def row_sum(self, x_R: Tensor, order: Tensor) -> Tensor:
        return rows.row_sum(x_R, order, node=self.node)

    def segment_sum(self, x_R: Tensor, segment_R: Tensor, num_segments: int, order: Tensor) -> Tensor:
        return rows.segment_sum(x_R, segment_R, num_segments, order, node=self.node)

    def chain_mm(self, a_MK: Tensor, b_KN: Tensor) -> Tensor:
        return chain.chain_mm(a_MK, b_KN, node=self.node)

    def sums_of_squares(self, xs: Sequence[Tensor]) -> Tensor:
        return squares.sums_of_squares(xs, node=self.node)

    def adamw_update(
        self, master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, coef: Tensor, s: Tensor, weight: Tensor
    ) -> None:
        adamw.adamw_update(master, exp_avg, exp_avg_sq, grad, coef, s, weight, node=self.node)

    def chain_sums(
        self, row_xs: list[Tensor], segment_xs: list[Tensor], segment_R: Tensor, num_segments: int, order: Tensor
    ) -> tuple[list[Tensor], list[Tensor]]:
        return rows.chain_sums(row_xs, segment_xs, segment_R, num_segments, order, node=self.node)

    def plan_rows(
        self,
        keys_R2: Tensor,
        segment_R: Tensor,
        num_segments: int,
        positions_R3: Tensor,
        *,
        decided: rowplan.RowPlan | None = None,
    ) -> Callable[[], Tensor]:
        return rowplan.plan_rows(keys_R2, segment_R, num_segments, positions_R3, decided=decided)

    def round(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        return elementwise.round(x, dtype)

    # ---- row-local ops ------------------------------------------------------------------------
    def rms_modulate_fwd(
        self, x: Tensor, w: Tensor, scale: Tensor, shift: Tensor, eps: float, out_dtype: torch.dtype
    ) -> Tensor:
        return norm.rms_modulate_fwd(x, w, scale, shift, eps, out_dtype, node=self.node)

    def rms_modulate_bwd(
        self, dm: Tensor, x: Tensor, w: Tensor, scale: Tensor, eps: float
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return norm.rms_modulate_bwd(dm, x, w, scale, eps, node=self.node)

    def qk_norm_rope_fwd(
        self, q_RHD: Tensor, w: Tensor, cos: Tensor, sin: Tensor, eps: float, out_dtype: torch.dtype
    ) -> Tensor:
        return norm.qk_norm_rope_fwd(q_RHD, w, cos, sin, eps, out_dtype, node=self.node)

    def qk_norm_rope_bwd(
        self, dout_RHD: Tensor, q_RHD: Tensor, w: Tensor, cos: Tensor, sin: Tensor, eps: float, out_dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        return norm.qk_norm_rope_bwd(dout_RHD, q_RHD, w, cos, sin, eps, out_dtype, node=self.node)

    def swiglu_fwd(self, h: Tensor, g: Tensor, out_dtype: torch.dtype) -> Tensor:
        return elementwise.swiglu_fwd(h, g, out_dtype, node=self.node)

    def swiglu_bwd(self, da: Tensor, h: Tensor, g: Tensor, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return elementwise.swiglu_bwd(da, h, g, out_dtype, node=self.node)

    def gated_residual(self, x: Tensor, gate: Tensor, y: Tensor, out_dtype: torch.dtype) -> Tensor:
        return elementwise.gated_residual(x, gate, y, out_dtype, node=self.node)

    def silu(self, x: Tensor, out_dtype: torch.dtype) -> Tensor:
        return elementwise.silu(x, out_dtype, node=self.node)

    def silu_bwd(self, dy: Tensor, x: Tensor) -> Tensor:
        return elementwise.silu_bwd(dy, x, node=self.node)

    def rope_tables(self, position_ids_R3: Tensor, rope_freq_dim: int, theta: float) -> tuple[Tensor, Tensor]:
        return rope.rope_tables(position_ids_R3, rope_freq_dim, theta, node=self.node)

    # ---- attention over keys in canonical order ----------------------------------------------
    def attention_fwd(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float, out_dtype: torch.dtype
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        return attention.attention_fwd(q, k, v, scale, out_dtype, node=self.node)

    def attention_delta(self, do: Tensor, o_ref: Tensor) -> Tensor:
        return attention.attention_delta(do, o_ref, node=self.node)

    def attention_bwd_q(
        self, q: Tensor, do: Tensor, stats: Sequence[Tensor], delta: Tensor, k: Tensor, v: Tensor, scale: float
    ) -> Tensor:
        return attention.attention_bwd_q(q, do, stats, delta, k, v, scale, node=self.node)

    def attention_bwd_kv(
        self, q: Tensor, do: Tensor, stats: Sequence[Tensor], delta: Tensor, k: Tensor, v: Tensor, scale: float
    ) -> tuple[Tensor, Tensor]:
        return attention.attention_bwd_kv(q, do, stats, delta, k, v, scale, node=self.node)
