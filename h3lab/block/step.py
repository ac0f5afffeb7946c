"""The canonical MiniMax-H3 block: forward, input gradient and every weight gradient, written out.

Dimension legend: R rows (local / TP / sequence row spaces, see h3lab.comm), D hidden, A attention
width, F SwiGLU width, E time_embed_dim, T timesteps, H heads, Dh head_dim; `_u` = one canonical
unit. The math is diffusers' `MiniMaxH3TransformerBlock`; the arithmetic follows h3lab.contract:
FP32 inside every op, one rounding (`R`) at its output, unit partials + the 8-unit tree wherever a
reduction crosses units, logical-key order wherever it crosses rows. The backward is explicit, so
no autograd kernel choice can change an order. `block_step` is the one implementation; layouts
drive it through a `BlockComm` and a `UnitWeights` slice, `canonical_block` with neither.

The step in parts: h3lab.block.forward (F1-F11, and the records it keeps for the backward, with
the rule of every tensor's lifetime), h3lab.block.backward (B11-B1), h3lab.block.rowspace (this
rank's row spaces and units), h3lab.rowplan (the canonical row order, decided on the host).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.backend import Backend, TorchBackend
from h3lab.batch import PackedBatch
from h3lab.block.backward import backward as run_backward
from h3lab.block.forward import Forward, Step, Trace, forward, zero_padding
from h3lab.block.result import BlockResult
from h3lab.block.rowspace import RowSpace
from h3lab.clock import Clock, Timings
from h3lab.comm import BlockComm, LocalComm
from h3lab.contract import check_device, strict_mode
from h3lab.rowplan import RowPlan, index_cache
from h3lab.units import UnitWeights, assemble_unit_grads, unit_weights
from h3lab.weights import BlockWeights

__all__ = ["BlockStep", "KeptForward", "Trace", "block_backward", "block_forward", "block_step", "canonical_block"]


@dataclass(frozen=True, eq=False)
class BlockStep:
    """What one rank computes: its local rows of out/dx, its unit slices of dW, replicated grads."""

    out: Tensor  # [R_local, D], padding rows zero
    dx: Tensor | None  # [R_local, D], padding rows zero (None: forward only)
    dw_units: dict[str, dict[int, Tensor]] | None  # unit-sharded parameters, per unit
    dw_replicated: dict[str, Tensor] | None  # norm1, norm2, norm_q, norm_k (every rank holds all)
    dtemb: Tensor | None  # [T, E] float32
    # forward_s, backward_s (this rank, collectives included): on CUDA the GPU's own clock (events, read
    # on first access: h3lab.clock), so a stretch where the GPU waits for the host, e.g. in a gloo
    # collective, counts; on CPU wall time
    timings: Mapping[str, float]


@dataclass(frozen=True, eq=False)
class KeptForward:
    """A block's forward with the records its backward reads (`block_backward` uses them up): what a
    chain keeps instead of recomputing the forward in its backward pass. The forward is deterministic,
    so the backward's bits are those of the recomputed one; the records stay in memory until then."""

    out: Tensor  # [R_local, D], padding rows zero
    batch: PackedBatch  # the forward's batch (its input rows); `block_backward` adds grad_out
    step: Step
    forward: Forward
    index_scope: dict  # the forward's index facts (h3lab.rowplan.index_cache), which the backward reuses
    timings: Mapping[str, float]  # forward_s (h3lab.clock: read on first access)


TORCH = TorchBackend()  # canonical_block's default: the canonical arithmetic, the same bits on every device


def _no_trace(name: str, t: Tensor, space: str) -> Tensor:
    return t


def canonical_block(
    weights: BlockWeights,
    batch: PackedBatch,
    *,
    backend: Backend = TORCH,
    decided_rows: RowPlan | None = None,
    trace: Trace | None = None,
) -> BlockResult:
    """Forward, dX, every dW and d temb of one H3 block under the h3-parallel-v1 contract.

    Args:
        weights: one block's tensors (`h3lab.load_block` or `h3lab.weights.synthetic_block`).
        batch: one packed request with its upstream gradient (`h3lab.packed_batch`).
        backend: the kernels, built once by `h3lab.backend.get_backend(name, device)`: "torch" (this
            entry point's default, CPU and GPU), "triton" (GPU) or "baseline" (library kernels, not
            layout-invariant: the reference point of the baseline mode); or a backend object such as
            `TritonBackend("cpu", node=...)` under the Triton interpreter.
        decided_rows: the row plan of this batch's metadata decided beforehand
            (`h3lab.rowplan.decide_rows`, backend "triton"): the step then never waits for the
            host, as a CUDA graph capture needs (h3lab.block.graph).
        trace: sees every op's output in execution order (`Trace`; h3lab.run.trace records them).

    Returns:
        `BlockResult`: out and dx in the activation dtype, dw in each parameter's dtype, keyed by
        diffusers names, dtemb in float32. Padding rows of out and dx are zero.

    Raises:
        ValueError: shapes that do not match the config, an unsupported device or dtype, TF32 on.
    """
    step = block_step(
        unit_weights(weights), batch, LocalComm(), backend=backend, decided_rows=decided_rows, trace=trace
    )
    dw = assemble_unit_grads(step.dw_units, LocalComm.units) | step.dw_replicated
    names = list(weights.tensors)  # diffusers order
    return BlockResult(out=step.out, dx=step.dx, dw={k: dw[k] for k in names}, dtemb=step.dtemb)


def _check(uw: UnitWeights, b: PackedBatch, backend: Backend) -> None:
    if isinstance(backend, str):
        raise ValueError(
            f"backend {backend!r} is a name; allowed: a backend object, h3lab.backend.get_backend({backend!r}, device)"
        )
    c = uw.config
    check_device(b.device)
    if b.hidden_states.shape[1] != c.hidden_size:
        raise ValueError(
            f"hidden_states has {b.hidden_states.shape[1]} channels; the block's hidden_size is {c.hidden_size}"
        )
    if b.temb.shape[1] != c.time_embed_dim:
        raise ValueError(f"temb has {b.temb.shape[1]} channels; the block's time_embed_dim is {c.time_embed_dim}")
    devices = {t.device for t in uw.replicated.values()}
    if devices != {b.device}:
        raise ValueError(f"weights on {sorted(map(str, devices))} but the batch on {b.device}; move one of them")


def block_step(
    uw: UnitWeights,
    b: PackedBatch,
    comm: BlockComm,
    *,
    backend: Backend,
    backward: bool = True,
    trace: Trace | None = None,
    decided_rows: RowPlan | None = None,
) -> BlockStep:
    """The block on this rank's rows and units; `comm` supplies the layout's data movement.

    `backward=False` stops after the forward (a chain recomputes each block's forward in its
    backward pass); `trace` receives every op's output (h3lab.run.trace); `backend` and
    `decided_rows`: see `canonical_block` (`decided_rows` with `LocalComm` only: a layout's gathered
    metadata are tensors of its own).
    """
    _check(uw, b, backend)
    with _step_context(b):
        return _block_step(uw, b, comm, backend, backward, trace or _no_trace, decided_rows)


def block_forward(
    uw: UnitWeights, b: PackedBatch, comm: BlockComm, *, backend: Backend, trace: Trace | None = None
) -> KeptForward:
    """The block's forward on this rank's rows and units, kept for `block_backward` (`trace` sees the
    forward's ops). `b.grad_out` is not read."""
    _check(uw, b, backend)
    with _step_context(b) as scope:
        clock = Clock(b.device)
        step = _step(uw, b, comm, backend, trace or _no_trace)
        kept = forward(step, b, None)
        clock.lap()
        out = zero_padding(kept.rows.active, kept.out)
    return KeptForward(out, b, step, kept._replace(out=out), scope, clock.timings(["forward_s"]))


def block_backward(kept: KeptForward, grad_out: Tensor, *, trace: Trace | None = None) -> BlockStep:
    """The backward of a kept forward from `grad_out` ([R_local, D], this rank's rows): the BlockStep
    `block_step` gives for the same batch with that gradient (`trace` sees the backward's ops).

    Raises:
        ValueError: `kept` was used by a backward already (its records are gone).
    """
    if len(kept.forward.tape) == 0:
        raise ValueError("this kept forward was used by a backward already; allowed: one backward per block_forward")
    b = kept.batch.with_rows(grad_out=grad_out)
    step = dataclasses.replace(kept.step, tr=trace or _no_trace)
    f = kept.forward
    with _step_context(b, kept.index_scope):
        clock = Clock(b.device)
        dx, dw_units, dw_replicated, dtemb = run_backward(step, b, f.rows, f.st, f.tape)
        clock.lap()
    forward_t, backward_t = kept.timings, clock.timings(["backward_s"])
    timings = Timings(lambda: dict(forward_t) | dict(backward_t))
    return BlockStep(kept.out, dx, dw_units, dw_replicated, dtemb, timings)


@contextlib.contextmanager
def _step_context(b: PackedBatch, index_scope: dict | None = None) -> Iterator[dict]:
    """What every part of a block step runs under: strict mode, no autograd, the batch's CUDA device
    current (rank 1 of a NCCL layout holds cuda:1 while the current device may still be cuda:0: Triton
    launches on the current one) and one index-fact scope (yielded; `index_scope` resumes one)."""
    on_device = torch.cuda.device(b.device) if b.device.type == "cuda" else contextlib.nullcontext()
    with strict_mode(), torch.no_grad(), on_device, index_cache(index_scope) as scope:
        yield scope


def _step(uw: UnitWeights, b: PackedBatch, comm: BlockComm, be: Backend, tr: Trace) -> Step:
    return Step(be, tr, uw, RowSpace(comm), b.hidden_states.dtype, uw.q[comm.units[0]].dtype, b.num_timesteps)


def _block_step(
    uw: UnitWeights,
    b: PackedBatch,
    comm: BlockComm,
    be: Backend,
    backward: bool,
    tr: Trace,
    decided_rows: RowPlan | None,
) -> BlockStep:
    clock = Clock(b.device)
    step = _step(uw, b, comm, be, tr)
    out, rows, st, tape = forward(step, b, decided_rows)
    clock.lap()
    out = zero_padding(rows.active, out)
    if not backward:
        return BlockStep(out, None, None, None, None, clock.timings(["forward_s"], {"backward_s": 0.0}))
    dx, dw_units, dw_replicated, dtemb = run_backward(step, b, rows, st, tape)
    clock.lap()
    timings = clock.timings(["forward_s", "backward_s"])
    return BlockStep(out=out, dx=dx, dw_units=dw_units, dw_replicated=dw_replicated, dtemb=dtemb, timings=timings)
