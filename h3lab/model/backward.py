"""The whole transformer's backward under h3-parallel-v1: forward keeping what the backward reads,
then the gradient of every parameter the trained depth touches, by diffusers name.

Dimension legend: S packed rows, D hidden, T timesteps, E time_embed_dim.

The trained depth is a contiguous block range A..B with everything around it: the embedders, the
token refiner, the time MLP, norm_out and both heads. As in the forward (h3lab.model.transformer),
only the block stack is distributed:
- forward: `embed` (replicated) -> this rank's rows (`rows_shard`) -> `chain_forward` over A..B,
  keeping each block's input rows -> the output gathered to all S rows -> `head` (replicated);
- backward, given the gradient at the head's output (the loss's, float32): `head_backward`
  (replicated, all S rows) -> this rank's rows of that gradient, taken with the same `rows_shard`
  (`SeqShard.coshard` of the sequence whose `grad_out` it is) -> `chain_backward` (blocks B..A,
  each forward recomputed from its input, or kept from the forward without `recompute`) -> the
  gradient at the stack's input gathered to all S rows in packed order, padding dropped ->
  `embed_backward` (replicated).
So everything outside the stack is layout-invariant by construction, the stack by the chain's
guarantees. d temb: every block returns its share ([T, E] FP32, replicated) and norm_out's AdaLN
one more; their sum is one left-to-right FP32 chain from +0 in forward order, blocks A..B
ascending, then norm_out: (((+0 + d_A) + d_A+1) + ... + d_B) + d_norm_out, then the time MLP's
backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from h3lab.backend import Backend
from h3lab.batch import PackedBatch
from h3lab.block import Trace
from h3lab.clock import Clock, Timings
from h3lab.comm import BlockComm, LocalComm
from h3lab.finite import deferred_checks
from h3lab.model.chain import ChainForward, chain_backward, chain_forward
from h3lab.model.embed import Embedded, embed
from h3lab.model.embed_grad import embed_backward
from h3lab.model.head import ModelOutput, head
from h3lab.model.head_grad import head_backward
from h3lab.model.inputs import ModelInputs
from h3lab.model.transformer import RowsShard, gather_sequence
from h3lab.model.weights import ModelWeights
from h3lab.ops.fixed import chain_sum
from h3lab.rowplan import index_cache


@dataclass(frozen=True, eq=False)
class ModelForward:
    """One forward of the trained depth and everything its backward reads (`model_backward` consumes it)."""

    output: ModelOutput  # float32, the same on every rank
    emb: Embedded  # the stack's input, all S rows (replicated)
    stack_out: Tensor  # [S, D] the stack's output gathered, packed order (replicated)
    local: PackedBatch  # this rank's rows of the stack's input
    chain: ChainForward  # each block's input rows (this rank's)
    weights: ModelWeights
    blocks: tuple[int, ...]
    backend: Backend
    comm: BlockComm
    rows_shard: RowsShard | None
    trace: Trace | None
    timings: Mapping[str, float]  # forward_s (h3lab.clock: read on first access)
    index_scope: dict  # the forward's row plan and index facts (h3lab.rowplan.index_cache), for the backward


@dataclass(frozen=True, eq=False)
class ModelGradients:
    """This rank's gradients of the trained depth: replicated ones in full, the blocks' unit-sharded ones
    per unit (`BlockStep.dw_units`; `h3lab.units.assemble_unit_grads` makes all 8 diffusers-shaped)."""

    replicated: dict[str, Tensor]  # diffusers name -> gradient: every non-block parameter, each block's 4 norms
    units: dict[int, dict[str, dict[int, Tensor]]]  # block -> unit-gradient name -> unit -> slice
    dtemb: Tensor  # [T, E] float32, the summed d temb (replicated)
    timings: Mapping[str, float]  # forward_s, backward_s, stack_forward_s, stack_backward_s (h3lab.clock)


def check_blocks(blocks: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """`blocks` as a tuple, if they are a contiguous ascending range A..B inside the model.

    Raises:
        ValueError: empty, not ints, not contiguous and ascending, or past the model's blocks.
    """
    b = tuple(blocks)
    ints = all(isinstance(i, int) and not isinstance(i, bool) for i in b)
    if not b or not ints or b != tuple(range(b[0], b[0] + len(b))) or b[0] < 0 or b[-1] >= num_layers:
        raise ValueError(
            f"blocks {list(b)!r}; allowed: a non-empty contiguous ascending range A..B within 0..{num_layers - 1}"
        )
    return b


def _no_trace(name: str, t: Tensor, space: str) -> Tensor:
    return t


@deferred_checks()
def model_forward(
    weights: ModelWeights,
    inputs: ModelInputs,
    *,
    blocks: Sequence[int],
    backend: Backend,
    comm: BlockComm | None = None,
    rows_shard: RowsShard | None = None,
    trace: Trace | None = None,
    recompute: bool = True,
) -> ModelForward:
    """The model's forward through blocks `blocks` (the bits of `transformer_forward` with those blocks).

    Args:
        weights, inputs, backend, comm, rows_shard: as `h3lab.model.transformer_forward`.
        blocks: the trained depth, a contiguous ascending range A..B.
        trace: receives every op of every block's forward (`block{i}.{op}`) and the replicated stages
            (`embed.temb`, `embed.hidden`, `stack.out`, `head.video`, `head.audio`); `model_backward`
            passes it on.
        recompute: the blocks' forwards rerun in `model_backward` (True) or kept until then
            (h3lab.model.chain: the same bits, more memory, less time).

    Raises:
        ValueError: a bad block range, or anything `transformer_forward` refuses.
    """
    blocks = check_blocks(blocks, weights.config.num_layers)
    comm = LocalComm() if comm is None else comm
    tr, clock = trace or _no_trace, Clock(inputs.device)
    with index_cache() as scope:  # one row plan and one set of index facts for every block (h3lab.rowplan)
        emb = embed(weights, inputs, backend=backend)
        tr("embed.temb", emb.batch.temb, "replicated"), tr("embed.hidden", emb.batch.hidden_states, "replicated")
        local = emb.batch if rows_shard is None else rows_shard(emb.batch)
        chain = chain_forward(weights, local, comm, blocks, backend=backend, trace=trace, recompute=recompute)
        out = gather_sequence(local.with_rows(hidden_states=chain.out), comm, emb.batch)
        tr("stack.out", out, "replicated")
        result = head(weights, out, emb, backend=backend)
        tr("head.video", result.video, "replicated"), tr("head.audio", result.audio, "replicated")
    clock.lap()
    timings = clock.timings(["forward_s"])
    return ModelForward(
        result, emb, out, local, chain, weights, blocks, backend, comm, rows_shard, trace, timings, scope
    )


@deferred_checks()
def model_backward(forward: ModelForward, d_output: ModelOutput) -> ModelGradients:
    """Every gradient of the trained depth given d output (float32, shaped as `forward.output`).

    `trace` (the forward's) sees the backward ops of every block and `d.stack.out` (the stack's
    upstream gradient, all rows), `d.stack.in` (the gradient at its input, gathered), `d.temb`.

    The forward record is used up (its chain's stored inputs go as the blocks are done): one
    backward per `model_forward`.

    Raises:
        ValueError: `d_output` of another shape or dtype than the output; a forward used already.
    """
    f, tr, clock = forward, forward.trace or _no_trace, Clock(forward.stack_out.device)
    with index_cache(resume=f.index_scope):  # the forward's row plan and index facts
        emb = f.emb
        hg = head_backward(f.weights, f.stack_out, emb, d_output, backend=f.backend)
        tr("d.stack.out", hg.d_hidden, "replicated")
        full = emb.batch.with_rows(grad_out=hg.d_hidden)
        grad_local = full.grad_out if f.rows_shard is None else f.rows_shard(full).grad_out
        chain = chain_backward(f.weights, f.local, f.comm, f.chain, grad_local, backend=f.backend, trace=f.trace)
        d_in = gather_sequence(f.local.with_rows(hidden_states=chain.dx), f.comm, emb.batch, site="model.dx")
        tr("d.stack.in", d_in, "replicated")
        dtemb = chain_sum(torch.stack([chain.blocks[i].dtemb for i in f.blocks] + [hg.dtemb]))  # forward order
        tr("d.temb", dtemb, "replicated")
        replicated = embed_backward(f.weights, emb.inputs, d_in, dtemb, backend=f.backend) | hg.grads
        for i in f.blocks:
            replicated |= {f"transformer_blocks.{i}.{k}": v for k, v in chain.blocks[i].dw_replicated.items()}
    clock.lap()
    backward_t, forward_t, stack_f, stack_b = clock.timings(["backward_s"]), f.timings, f.chain.timings, chain.timings
    timings = Timings(
        lambda: (
            {"forward_s": forward_t["forward_s"], "backward_s": backward_t["backward_s"]}
            | {"stack_forward_s": stack_f["forward_s"], "stack_backward_s": stack_b["backward_s"]}
        )
    )
    return ModelGradients(replicated, {i: chain.blocks[i].dw_units for i in f.blocks}, dtemb, timings)
