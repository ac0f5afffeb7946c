"""A chain of blocks: forward through them, then backward in reverse, recomputing each block's forward
or reusing it.

With `recompute` (the default) memory stays at one block's weights and activations plus each
block's input rows ([R, D] each): the backward of block i reruns its forward from the stored input
(as activation checkpointing does) with the gradient that block i+1 returned as its upstream
gradient. Without it each block's forward records stay until its backward (`h3lab.block.KeptForward`,
as autograd keeps an eager model's activations): no forward runs twice. The forward is
deterministic, so both give the same bits.

The two passes are separate functions because a model's stack gets its upstream gradient only after
the head and the loss: `chain_forward` keeps each block's input rows, `chain_backward` takes them and
the gradient at the last output. `chain_step` is the two in a row (a chain whose batch carries that
gradient).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from h3lab.backend import Backend
from h3lab.batch import PackedBatch
from h3lab.block import TORCH, BlockStep, KeptForward, Trace, block_backward, block_forward, block_step
from h3lab.clock import Timings
from h3lab.comm import BlockComm, LocalComm
from h3lab.model.weights import ModelWeights, block_units
from h3lab.units import UnitWeights


@dataclass(frozen=True, eq=False)
class ChainStep:
    out: Tensor  # [R_local, D]: the last block's output
    dx: Tensor  # [R_local, D]: the gradient at the chain's input
    blocks: dict[int, BlockStep]  # per block: its weight gradients and d temb (out/dx dropped)
    timings: Mapping[str, float]  # forward_s, backward_s (h3lab.clock: read on first access)


@dataclass(frozen=True, eq=False)
class ChainForward:
    """The forward pass of a chain: its output and what its backward reads."""

    out: Tensor  # [R_local, D]: the last block's output, padding rows +0
    inputs: dict[int, Tensor]  # per block, its input rows [R_local, D]; `chain_backward` takes them off
    blocks: tuple[int, ...]  # the blocks, in forward order
    timings: Mapping[str, float]  # forward_s, the blocks' summed (h3lab.clock: read on first access)
    kept: dict[int, KeptForward]  # per block, its forward's records (without `recompute`; else empty)


def chain_forward(
    weights: ModelWeights,
    batch: PackedBatch,
    comm: BlockComm,
    blocks: Sequence[int],
    *,
    backend: Backend,
    trace: Trace | None = None,
    recompute: bool = True,
) -> ChainForward:
    """Blocks `blocks` (in order) forward on this rank's rows, keeping each block's input rows (and,
    without `recompute`, its forward's records: the module docstring).

    `trace` sees the forward ops as `block{i}.{op}`. `batch.grad_out` is not read.

    Raises:
        ValueError: no blocks; anything `block_step` refuses.
    """
    if not blocks:
        raise ValueError("a chain needs at least one block")
    inputs, kept, b, laps = {}, {}, batch, []
    for i in blocks:
        inputs[i] = b.hidden_states
        uw, tr = _unit_weights(weights, i, batch, comm), _traced(trace, i, forward=True)
        if recompute:
            step = block_step(uw, b, comm, backend=backend, backward=False, trace=tr)
            out, lap = step.out, step.timings
        else:
            kept[i] = block_forward(uw, b, comm, backend=backend, trace=tr)
            out, lap = kept[i].out, kept[i].timings
        b = b.with_rows(hidden_states=out)
        laps.append(lap)
    timings = Timings(lambda: {"forward_s": sum(t["forward_s"] for t in laps)})
    return ChainForward(out=b.hidden_states, inputs=inputs, blocks=tuple(blocks), timings=timings, kept=kept)


def chain_backward(
    weights: ModelWeights,
    batch: PackedBatch,
    comm: BlockComm,
    forward: ChainForward,
    grad_out: Tensor,
    *,
    backend: Backend,
    trace: Trace | None = None,
    keep: Callable[[int, BlockStep], BlockStep] | None = None,
) -> ChainStep:
    """The chain's backward from `grad_out` (this rank's rows of the gradient at the last output).

    Block i's forward reruns from its stored input (taken off `forward.inputs`, so each goes once
    its block is done) on `batch`'s row metadata, then its backward; a kept forward (`forward.kept`)
    goes straight to its backward. `trace` sees the backward ops
    (`d.*`, `dx`) as `block{i}.{op}`; the recomputed forward is not traced twice. `keep(i, step)`
    reduces what is kept of block i (e.g. digests instead of 1.3 GB of real weight gradients).

    Raises:
        ValueError: `forward` was used by a backward already (its stored inputs are gone).
    """
    if set(forward.inputs) != set(forward.blocks):
        raise ValueError(
            "this chain forward was used by a backward already (each block's input goes once its block is done); "
            "allowed: one backward per chain_forward"
        )
    g, per_block, laps = grad_out, {}, []
    for i in reversed(forward.blocks):
        x, kept, tr = forward.inputs.pop(i), forward.kept.pop(i, None), _traced(trace, i, forward=False)
        if kept is None:
            b_i = batch.with_rows(hidden_states=x, grad_out=g)
            step = block_step(_unit_weights(weights, i, batch, comm), b_i, comm, backend=backend, trace=tr)
            laps.append((step.timings, ("forward_s", "backward_s")))  # the recomputed forward counts
        else:
            step = block_backward(kept, g, trace=tr)
            laps.append((step.timings, ("backward_s",)))
        g = step.dx
        step = dataclasses.replace(step, out=step.out[:0], dx=None)
        per_block[i] = keep(i, step) if keep is not None else step
    forward_t = forward.timings
    timings = Timings(
        lambda: {"forward_s": forward_t["forward_s"], "backward_s": sum(sum(t[k] for k in ks) for t, ks in laps)}
    )
    return ChainStep(out=forward.out, dx=g, blocks=per_block, timings=timings)


def chain_step(
    weights: ModelWeights,
    batch: PackedBatch,
    comm: BlockComm,
    blocks: Sequence[int],
    *,
    backend: Backend,
    trace: Trace | None = None,
    keep: Callable[[int, BlockStep], BlockStep] | None = None,
    recompute: bool = True,
) -> ChainStep:
    """Blocks `blocks` (in order) on this rank's rows; `batch.grad_out` is the gradient at the last output.

    `trace` sees forward ops as `block{i}.{op}` during the forward pass and backward ops (`d.*`,
    `dx`) during the backward pass; the recomputed forward is not traced twice. `keep(i, step)`
    reduces what is kept of block i (e.g. digests instead of 1.3 GB of real weight gradients).
    `recompute`: see the module docstring.
    """
    fwd = chain_forward(weights, batch, comm, blocks, backend=backend, trace=trace, recompute=recompute)
    return chain_backward(weights, batch, comm, fwd, batch.grad_out, backend=backend, trace=trace, keep=keep)


def _unit_weights(weights: ModelWeights, i: int, batch: PackedBatch, comm: BlockComm) -> UnitWeights:
    return block_units(weights, i, comm.units, batch.device)


def _traced(trace: Trace | None, block: int, *, forward: bool) -> Trace | None:
    if trace is None:
        return None

    def tr(name: str, t: Tensor, space: str) -> Tensor:
        is_backward_op = name.startswith("d.") or name == "dx"
        return trace(f"block{block}.{name}", t, space) if is_backward_op != forward else t

    return tr


def canonical_chain(
    weights: ModelWeights, batch: PackedBatch, blocks: Sequence[int], *, backend: Backend = TORCH, **kwargs
) -> ChainStep:
    """The chain in one process (all units, all rows); the backend defaults to torch, as `canonical_block`'s."""
    return chain_step(weights, batch, LocalComm(), blocks, backend=backend, **kwargs)
