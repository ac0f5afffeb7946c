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

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from h3lab import rowplan
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


def _on_node(launcher: Callable[..., Any]) -> Any:
    """A method that calls `launcher` (a kernel module's launcher, taking the protocol method's arguments
    in the protocol's order) with the backend's node type, whose pinned configurations it runs. Its
    signature is the launcher's without the keyword-only `node` and `config`."""

    def method(self: TritonBackend, *args: Any, **kwargs: Any) -> Any:
        return launcher(*args, **kwargs, node=self.node)

    sig = inspect.signature(launcher)
    params = [p for p in sig.parameters.values() if p.kind is not p.KEYWORD_ONLY]
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = sig.replace(parameters=[self_param, *params])  # type: ignore[attr-defined]
    method.__name__, method.__doc__ = launcher.__name__, launcher.__doc__
    return method


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
    mm = _on_node(gemm.mm)
    unit_reduce = _on_node(unit_gemm.unit_mm)

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

    row_mm = _on_node(rows.row_mm)
    row_sum = _on_node(rows.row_sum)
    segment_sum = _on_node(rows.segment_sum)
    chain_sums = _on_node(rows.chain_sums)
    chain_mm = _on_node(chain.chain_mm)
    sums_of_squares = _on_node(squares.sums_of_squares)
    adamw_updates = _on_node(adamw.adamw_updates)
    plan_rows = staticmethod(rowplan.plan_rows)
    round = staticmethod(elementwise.round)

    # ---- row-local ops ------------------------------------------------------------------------
    rms_modulate_fwd = _on_node(norm.rms_modulate_fwd)
    rms_modulate_bwd = _on_node(norm.rms_modulate_bwd)
    qk_norm_rope_fwd = _on_node(norm.qk_norm_rope_fwd)
    qk_norm_rope_bwd = _on_node(norm.qk_norm_rope_bwd)
    swiglu_fwd = _on_node(elementwise.swiglu_fwd)
    swiglu_bwd = _on_node(elementwise.swiglu_bwd)
    gated_residual = _on_node(elementwise.gated_residual)
    silu = _on_node(elementwise.silu)
    silu_bwd = _on_node(elementwise.silu_bwd)
    rope_tables = _on_node(rope.rope_tables)

    # ---- attention over keys in canonical order ----------------------------------------------
    attention_fwd = _on_node(attention.attention_fwd)
    attention_delta = _on_node(attention.attention_delta)
    attention_bwd_q = _on_node(attention.attention_bwd_q)
    attention_bwd_kv = _on_node(attention.attention_bwd_kv)
    attention_bwd = _on_node(attention.attention_bwd)
