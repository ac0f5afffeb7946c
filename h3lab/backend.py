"""The one backend seam: which kernels compute the block.

- `torch`: the canonical arithmetic in plain torch ops (h3lab.ops), on CPU and GPU. Built only
  from correctly rounded IEEE operations, so it gives the same bits on any device.
- `triton`: the same contract as GPU kernels (h3lab.triton; CUDA only). Its reduction orders are
  fixed too, but tensor-core sums differ from the torch chains, so its bits are its own (pinned
  per node type in kernels/), equal across every layout on one GPU type.
- `emulate-sm90`: the triton backend's bits on sm90 GPUs (H100, H200), computed on a CPU from
  models of what those kernels' instructions compute (h3lab.emulate): a GPU result anyone can
  check. Slow (a model, not a kernel); CPU only.
- `baseline`: what people run today — library GEMMs (BLAS / cuBLAS) in whatever order they pick,
  one GEMM per rank over its local K instead of unit partials, physical row order for weight
  gradients. It exists so reports can show where bits diverge; it is never a fallback.

`get_backend(name, device)` is the one constructor: an entry point (the CLI, a runner's rank, a
notebook, a benchmark) builds the backend once and passes the object down; everything below takes
a `Backend`, never a name, and no `None` stands for torch. A choice that cannot be honoured raises,
nothing falls back silently. Every method computes in FP32 and rounds once to `out_dtype`
where it has one; without one it returns FP32.

Dimension legend: M rows, K reduced, N columns, R rows, H heads, Dh head_dim, G segments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from h3lab.emulate import attention as emulated_attention
from h3lab.emulate import gemm as emulated_gemm
from h3lab.emulate.mma import SM90, MmaModel
from h3lab.ops import adamw, chain, elementwise, gemm, norm, rope, rows, squares, unit_gemm
from h3lab.ops import attention as att
from h3lab.ops.adamw import AdamWPiece
from h3lab.ops.fixed import round_to
from h3lab.ops.unit_gemm import Pieces
from h3lab.rowplan import RowPlan

EMULATED = {"emulate-sm90": "sm90"}  # CPU backends that give a GPU architecture's triton bits
CONTRACT_BACKENDS = ("torch", "triton", *EMULATED)  # the backends that compute under h3-parallel-v1
BACKENDS = (*CONTRACT_BACKENDS, "baseline")  # baseline: library kernels, the reference point of the baseline mode
F32 = torch.float32


class Backend(Protocol):
    name: str

    # GEMMs: a row's bits never depend on M, a column's never on N
    def mm(self, a_MK: Tensor, b_KN: Tensor, out_dtype: torch.dtype = F32) -> Tensor: ...
    def unit_reduce(self, pieces: Pieces, num_units: int) -> Tensor: ...  # FP32 [M, N]: chains, then the tree
    def row_mm(self, a_RN: Tensor, b_RK: Tensor, order: Tensor, out_dtype: torch.dtype = F32) -> Tensor: ...
    # the AdaLN projection's few-row GEMMs (T timesteps): d temb's unit tree, and dW = a^T b with K = T
    def unit_reduce_few_rows(self, a_TK: Tensor, b_KN: Tensor, num_units: int) -> Tensor: ...
    def mm_few_k(self, a_KM: Tensor, b_KN: Tensor, out_dtype: torch.dtype = F32) -> Tensor: ...
    def row_sum(self, x_R: Tensor, order: Tensor) -> Tensor: ...
    # the float32 modules' GEMM (embedders, heads, time embedder, their weight gradients): FP32 [M, N]
    # with h3lab.ops.chain.chain_mm's bits on every backend and device
    def chain_mm(self, a_MK: Tensor, b_KN: Tensor) -> Tensor: ...
    # the training step, with the references' bits on every backend: each tensor's sum of squares
    # (h3lab.ops.squares.sum_of_squares) as one FP32 [P] tensor; AdamW on many pieces (h3lab.ops.adamw),
    # with a [P] bool of the pieces whose weights it left NaN or Inf, run only where `go` is true
    def sums_of_squares(self, xs: Sequence[Tensor]) -> Tensor: ...
    def adamw_updates(
        self, pieces: Sequence[AdamWPiece], coef: Tensor, s: Tensor, go: Tensor | None = None
    ) -> Tensor: ...
    # the canonical row order (h3lab.ops.rows.key_order), as a function to call when it is needed:
    # a GPU backend starts reading the metadata to the host now and checks every index its row
    # reductions and RoPE will read when called (a host sync mid-block drains the GPU's queue)
    def plan_rows(
        self,
        keys_R2: Tensor,
        segment_R: Tensor,
        num_segments: int,
        positions_R3: Tensor,
        *,
        decided: RowPlan | None = None,
    ) -> Callable[[], Tensor]: ...
    def segment_sum(self, x_R: Tensor, segment_R: Tensor, num_segments: int, order: Tensor) -> Tensor: ...
    # row_sum of each row_x and segment_sum of each segment_x, as those calls give them (a backend may
    # run the independent chains side by side)
    def chain_sums(
        self, row_xs: list[Tensor], segment_xs: list[Tensor], segment_R: Tensor, num_segments: int, order: Tensor
    ) -> tuple[list[Tensor], list[Tensor]]: ...
    def round(self, x: Tensor, dtype: torch.dtype) -> Tensor: ...

    # row-local ops
    def rms_modulate_fwd(
        self, x: Tensor, w: Tensor, scale: Tensor, shift: Tensor, eps: float, out_dtype: torch.dtype
    ) -> Tensor: ...
    def rms_modulate_bwd(
        self, dm: Tensor, x: Tensor, w: Tensor, scale: Tensor, eps: float
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...
    def qk_norm_rope_fwd(
        self, q_RHD: Tensor, w: Tensor, cos: Tensor, sin: Tensor, eps: float, out_dtype: torch.dtype
    ) -> Tensor: ...
    def qk_norm_rope_bwd(
        self, dout_RHD: Tensor, q_RHD: Tensor, w: Tensor, cos: Tensor, sin: Tensor, eps: float, out_dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]: ...
    def swiglu_fwd(self, h: Tensor, g: Tensor, out_dtype: torch.dtype) -> Tensor: ...
    def swiglu_bwd(self, da: Tensor, h: Tensor, g: Tensor, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]: ...
    def gated_residual(self, x: Tensor, gate: Tensor, y: Tensor, out_dtype: torch.dtype) -> Tensor: ...
    def silu(self, x: Tensor, out_dtype: torch.dtype) -> Tensor: ...  # the AdaLN input silu(temb)
    def silu_bwd(self, dy: Tensor, x: Tensor) -> Tensor: ...
    def rope_tables(self, position_ids_R3: Tensor, rope_freq_dim: int, theta: float) -> tuple[Tensor, Tensor]: ...

    # attention over keys in canonical order; `stats` are per-(head, query) [H, Q] tensors that
    # replay the probabilities exactly (context parallelism gathers them with the queries)
    def attention_fwd(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float, out_dtype: torch.dtype
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]: ...
    def attention_delta(self, do: Tensor, o_ref: Tensor) -> Tensor: ...
    def attention_bwd_q(
        self, q: Tensor, do: Tensor, stats: Sequence[Tensor], delta: Tensor, k: Tensor, v: Tensor, scale: float
    ) -> Tensor: ...
    def attention_bwd_kv(
        self, q: Tensor, do: Tensor, stats: Sequence[Tensor], delta: Tensor, k: Tensor, v: Tensor, scale: float
    ) -> tuple[Tensor, Tensor]: ...
    # every query and every key, each in canonical order: (attention_bwd_q's dq, attention_bwd_kv's
    # dk and dv), their bytes, where a backend has a fused kernel in one launch
    def attention_bwd(
        self, q: Tensor, do: Tensor, stats: Sequence[Tensor], delta: Tensor, k: Tensor, v: Tensor, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class TorchBackend:
    """The canonical arithmetic (h3-parallel-v1) in torch ops; CPU and CUDA, the same bits on both."""

    name = "torch"

    mm = staticmethod(gemm.mm)
    unit_reduce = staticmethod(unit_gemm.unit_mm)

    def unit_reduce_few_rows(self, a_TK: Tensor, b_KN: Tensor, num_units: int) -> Tensor:
        return self.unit_reduce([(a_TK, b_KN)], num_units)  # the chains have no tile size: any M is few

    def mm_few_k(self, a_KM: Tensor, b_KN: Tensor, out_dtype: torch.dtype = F32) -> Tensor:
        return self.mm(a_KM.t(), b_KN, out_dtype)

    row_mm = staticmethod(rows.row_mm)
    row_sum = staticmethod(rows.row_sum)
    segment_sum = staticmethod(rows.segment_sum)
    adamw_updates = staticmethod(adamw.adamw_updates)

    def chain_mm(self, a_MK: Tensor, b_KN: Tensor) -> Tensor:
        return chain.chain_mm(a_MK, b_KN)

    sums_of_squares = staticmethod(squares.sums_of_squares)

    def chain_sums(
        self, row_xs: list[Tensor], segment_xs: list[Tensor], segment_R: Tensor, num_segments: int, order: Tensor
    ) -> tuple[list[Tensor], list[Tensor]]:
        sums = [self.row_sum(x, order) for x in row_xs]
        return sums, [self.segment_sum(x, segment_R, num_segments, order) for x in segment_xs]

    round = staticmethod(round_to)

    def plan_rows(
        self,
        keys_R2: Tensor,
        segment_R: Tensor,
        num_segments: int,
        positions_R3: Tensor,
        *,
        decided: RowPlan | None = None,
    ) -> Callable[[], Tensor]:
        if decided is not None:
            raise ValueError(
                f"decided rows with backend {self.name!r}; allowed: backend 'triton' (this backend "
                "decides its row order on the device, as it goes)"
            )
        order = rows.key_order(keys_R2)  # torch's ops check their indices as they go
        return lambda: order

    def rms_modulate_fwd(self, x, w, scale, shift, eps, out_dtype):
        return round_to(norm.rms_modulate_fwd(x, w, scale, shift, eps), out_dtype)

    rms_modulate_bwd = staticmethod(norm.rms_modulate_bwd)

    def qk_norm_rope_fwd(self, q_RHD, w, cos, sin, eps, out_dtype):
        return round_to(norm.qk_norm_rope_fwd(q_RHD, w, cos, sin, eps), out_dtype)

    def qk_norm_rope_bwd(self, dout_RHD, q_RHD, w, cos, sin, eps, out_dtype):
        dq, dw_rows = norm.qk_norm_rope_bwd(dout_RHD, q_RHD, w, cos, sin, eps)
        return round_to(dq, out_dtype), dw_rows

    def swiglu_fwd(self, h, g, out_dtype):
        return round_to(elementwise.swiglu_fwd(h, g), out_dtype)

    def swiglu_bwd(self, da, h, g, out_dtype):
        dh, dg = elementwise.swiglu_bwd(da, h, g)
        return round_to(dh, out_dtype), round_to(dg, out_dtype)

    def gated_residual(self, x, gate, y, out_dtype):
        return round_to(elementwise.gated_residual(x, gate, y), out_dtype)

    def silu(self, x, out_dtype):
        return round_to(elementwise.silu(x), out_dtype)

    silu_bwd = staticmethod(elementwise.silu_bwd)
    rope_tables = staticmethod(rope.rope_tables)

    def attention_fwd(self, q, k, v, scale, out_dtype):
        o32, rowmax, denom = att.attention_fwd(q, k, v, scale)
        return round_to(o32, out_dtype), o32, (rowmax, denom)

    attention_delta = staticmethod(att.attention_delta)

    def attention_bwd_q(self, q, do, stats, delta, k, v, scale):
        return att.attention_bwd_q(q, do, *stats, delta, k, v, scale)

    def attention_bwd_kv(self, q, do, stats, delta, k, v, scale):
        return att.attention_bwd_kv(q, do, *stats, delta, k, v, scale)

    def attention_bwd(self, q, do, stats, delta, k, v, scale):
        # no fused kernel: the two (this backend's subclasses inherit it with their own two)
        dq = self.attention_bwd_q(q, do, stats, delta, k, v, scale)
        return dq, *self.attention_bwd_kv(q, do, stats, delta, k, v, scale)


class EmulateSM90Backend(TorchBackend):
    """The triton backend's bits on sm90 GPUs (kernels/sm90.json), computed on a CPU.

    The GEMMs and attention follow the kernels' arithmetic (h3lab.emulate.gemm, .attention: the
    tensor cores' addition, the IEEE FMA chains, the row sums' layouts, the special instructions);
    everything else the triton backend computes with the torch backend's bits by construction (the
    row-local ops, the row chains, the chain GEMM, the sums of squares, AdamW): TorchBackend's.
    `model`: the tensor cores' addition (default h3lab.emulate.mma.SM90).
    """

    name = "emulate-sm90"

    def __init__(self, model: MmaModel = SM90) -> None:
        self.model = model

    def mm(self, a_MK: Tensor, b_KN: Tensor, out_dtype: torch.dtype = F32) -> Tensor:
        return emulated_gemm.mm(a_MK, b_KN, out_dtype, model=self.model)

    def unit_reduce(self, pieces: Pieces, num_units: int) -> Tensor:
        return emulated_gemm.unit_mm(pieces, num_units, model=self.model)

    def unit_reduce_few_rows(self, a_TK: Tensor, b_KN: Tensor, num_units: int) -> Tensor:
        return emulated_gemm.unit_mm_few_rows(a_TK, b_KN, num_units, model=self.model)

    def mm_few_k(self, a_KM: Tensor, b_KN: Tensor, out_dtype: torch.dtype = F32) -> Tensor:
        return emulated_gemm.mm_few_k(a_KM, b_KN, out_dtype, model=self.model)

    def row_mm(self, a_RN: Tensor, b_RK: Tensor, order: Tensor, out_dtype: torch.dtype = F32) -> Tensor:
        return emulated_gemm.row_mm(a_RN, b_RK, order, out_dtype, model=self.model)

    def attention_fwd(self, q, k, v, scale, out_dtype):
        return emulated_attention.forward(q, k, v, scale, out_dtype, model=self.model)

    def attention_delta(self, do: Tensor, o_ref: Tensor) -> Tensor:
        return emulated_attention.delta(do, o_ref)

    def attention_bwd_q(self, q, do, stats, delta, k, v, scale):
        return emulated_attention.bwd_q(q, do, stats, delta, k, v, scale, model=self.model)

    def attention_bwd_kv(self, q, do, stats, delta, k, v, scale):
        return emulated_attention.bwd_kv(q, do, stats, delta, k, v, scale, model=self.model)


class BaselineBackend(TorchBackend):
    """Library kernels where people use them: torch.mm, sums, index_add_, softmax; row-local ops shared."""

    name = "baseline"

    def mm(self, a_MK: Tensor, b_KN: Tensor, out_dtype: torch.dtype = F32) -> Tensor:
        return torch.mm(a_MK, b_KN.to(a_MK.dtype)).to(out_dtype)

    def unit_reduce(self, pieces: Pieces, num_units: int) -> Tensor:
        # one GEMM over everything this rank holds, as a plain row-parallel Linear shard does
        a = torch.cat([a for a, _ in pieces], dim=1)
        b = torch.cat([b for _, b in pieces], dim=0)
        return self.mm(a, b)

    def row_mm(self, a_RN: Tensor, b_RK: Tensor, order: Tensor, out_dtype: torch.dtype = F32) -> Tensor:
        active = order.sort().values  # physical order, padding dropped
        return torch.mm(a_RN[active].t(), b_RK[active].to(a_RN.dtype)).to(out_dtype)

    def row_sum(self, x_R: Tensor, order: Tensor) -> Tensor:
        return x_R[order.sort().values].to(F32).sum(0)

    def segment_sum(self, x_R: Tensor, segment_R: Tensor, num_segments: int, order: Tensor) -> Tensor:
        active = order.sort().values
        out = x_R.new_zeros((num_segments, *x_R.shape[1:]), dtype=F32)
        return out.index_add_(0, segment_R[active], x_R[active].to(F32))

    def round(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        return x.to(dtype)

    def attention_fwd(self, q, k, v, scale, out_dtype):
        s = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)).float() * scale
        rowmax = s.amax(-1)
        o = torch.matmul(torch.softmax(s, dim=-1), v.transpose(0, 1).float()).transpose(0, 1)
        return o.to(out_dtype), o, (rowmax, torch.exp(s - rowmax.unsqueeze(-1)).sum(-1))

    def attention_delta(self, do: Tensor, o_ref: Tensor) -> Tensor:
        return (do.float() * o_ref.float()).sum(-1).transpose(0, 1)

    def _ds(self, q, do, stats, delta, k, v, scale):
        rowmax, denom = stats
        s = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)).float() * scale
        p = torch.exp(s - rowmax.unsqueeze(-1)) / denom.unsqueeze(-1)
        dp = torch.matmul(do.transpose(0, 1).float(), v.permute(1, 2, 0).float())
        return p * (dp - delta.unsqueeze(-1)), p

    def attention_bwd_q(self, q, do, stats, delta, k, v, scale):
        ds, _ = self._ds(q, do, stats, delta, k, v, scale)
        return (torch.matmul(ds, k.transpose(0, 1).float()) * scale).transpose(0, 1)

    def attention_bwd_kv(self, q, do, stats, delta, k, v, scale):
        ds, p = self._ds(q, do, stats, delta, k, v, scale)
        dk = torch.matmul(ds.transpose(1, 2), q.transpose(0, 1).float()) * scale
        dv = torch.matmul(p.transpose(1, 2), do.transpose(0, 1).float())
        return dk.transpose(0, 1), dv.transpose(0, 1)


def get_backend(name: str, device: torch.device | str = "cpu") -> Backend:
    """The backend named `name` for `device`. Raises when it cannot be honoured."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; allowed: {list(BACKENDS)}")
    if name == "torch":
        return TorchBackend()
    if name == "baseline":
        return BaselineBackend()
    if name in EMULATED:
        if device.type != "cpu":
            raise ValueError(f"backend {name!r} runs on a CPU, got {device}; allowed on {device.type}: torch, triton")
        return EmulateSM90Backend()
    if device.type != "cuda":
        allowed = ", ".join(["torch", *EMULATED])
        raise ValueError(f"backend 'triton' needs a CUDA device, got {device}; allowed on {device.type}: {allowed}")
    from h3lab.triton.backend import TritonBackend  # CUDA-only import

    return TritonBackend(device)
