"""The whole canonical MiniMax-H3 transformer, forward: embed -> block stack -> head.

Dimension legend: S packed rows, D hidden.

The seam a layout drives. Only the block stack is distributed: every block goes through
`h3lab.block.block_step` with the caller's `BlockComm` and this rank's unit slice of the block's
weights, on the rows the caller co-sharded (`rows_shard`, e.g. `SeqShard.coshard`). Everything
before and after (timestep MLP, input projections, token refiner, norm_out, heads) is replicated:
every rank computes it in full from the same inputs, so it is layout-invariant by construction and
needs no collective. That is a deliberate choice, not a limit of the contract: those parts are
small. The refiner is 2 blocks over the Nt text rows against 50 blocks over all S rows (a 768p 4 s
request packs S ~ 33,000 rows; with Nt ~ 500 the refiner is ~0.06% of the stack's GEMM work), the
heads are float32 GEMMs of 96 + 32 output columns, and the one all-gather of the stack's output per
forward is the only communication they add.

`transformer_forward(weights, inputs, backend=get_backend("torch"))` with the defaults is the canonical
single-process model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor

from h3lab.backend import Backend
from h3lab.batch import PackedBatch
from h3lab.block import Trace, block_step
from h3lab.comm import BlockComm, LocalComm
from h3lab.finite import check_counts, deferred_checks
from h3lab.model.embed import Embedded, embed
from h3lab.model.head import ModelOutput, head
from h3lab.model.inputs import ModelInputs
from h3lab.model.weights import ModelWeights, block_units
from h3lab.rowplan import index_cache

RowsShard = Callable[[PackedBatch], PackedBatch]  # the whole sequence -> this rank's local rows (padded or not)


def run_blocks(
    weights: ModelWeights,
    batch: PackedBatch,
    comm: BlockComm,
    *,
    blocks: Iterable[int] | None = None,
    backend: Backend,
    trace: Trace | None = None,
) -> PackedBatch:
    """The block stack on this rank's rows: `batch` with hidden_states replaced by the last block's out.

    Loads one block at a time (`h3lab.model.weights.block_units`: `weights.block(i)` sliced to
    `comm.units`, or a `ShardedWeights`' own shards), runs
    `block_step(..., backward=False)`; padding rows come out +0. `blocks` defaults to every block
    in order; `trace` receives each op as `block{i}.{op}`.
    """
    for i in range(weights.config.num_layers) if blocks is None else blocks:
        uw = block_units(weights, i, comm.units, batch.device)
        tr = None if trace is None else prefixed(trace, f"block{i}.")
        step = block_step(uw, batch, comm, backend=backend, backward=False, trace=tr)
        batch = batch.with_rows(hidden_states=step.out)
        del uw, step  # one block's weights alive at a time
    return batch


def prefixed(trace: Trace, prefix: str) -> Trace:
    """`trace` seeing every name with `prefix` in front (`block3.`, `step1.`)."""
    return lambda name, t, space: trace(prefix + name, t, space)


def gather_sequence(local: PackedBatch, comm: BlockComm, full: PackedBatch, *, site: str = "model") -> Tensor:
    """This rank's stack output -> all S sequence rows in packed order (padding dropped), checked by key.

    `local.hidden_states` is what is gathered (the stack's output, or the gradient at its input);
    `site` names the two gathers (`{site}.out`, `{site}.keys`) in the collective records.

    Raises:
        ValueError: the gathered rows are not `full`'s rows in order followed only by padding
            (a `rows_shard` that reorders rows or drops one).
    """
    rows = lambda t, at: comm.gather_seq_rows(comm.gather_tp_rows(t, at), at)  # noqa: E731
    x_SD, keys = rows(local.hidden_states, f"{site}.out"), rows(local.logical_keys, f"{site}.keys")
    S = full.num_rows

    def verdict(wrong: list[int]) -> None:
        if keys.shape[0] < S or any(wrong):
            raise ValueError(
                f"rows_shard: gathered {keys.shape[0]} rows that are not the sequence's {S} rows in order plus "
                "padding (key < 0) at the end; allowed: SeqShard-style contiguous shards of the padded sequence"
            )

    if keys.shape[0] < S:
        verdict([])
    if keys is not full.logical_keys:  # one process holding every row gathers nothing: nothing to check
        misplaced = (keys[:S] != full.logical_keys).any(dim=1).sum() + (keys[S:, 0] >= 0).sum()
        check_counts(misplaced.reshape(1), verdict)  # read with the call's other checks (h3lab.finite)
    return x_SD[:S]


@deferred_checks()
@index_cache()  # one row plan and one set of index facts for every block (h3lab.rowplan)
def transformer_forward(
    weights: ModelWeights,
    inputs: ModelInputs,
    *,
    backend: Backend,
    comm: BlockComm | None = None,
    rows_shard: RowsShard | None = None,
    trace: Trace | None = None,
) -> ModelOutput:
    """The model's velocity for the video and audio rows of `inputs` (diffusers' forward, canonical arithmetic).

    Args:
        weights: a `ModelWeights` provider (`CheckpointWeights`, `SyntheticWeights`).
        inputs: one packed request (`model_inputs` makes one).
        backend: the block stack's backend (`h3lab.backend.get_backend`: torch, triton, baseline);
            also runs the refiner's and norm_out's bf16 ops. The float32 modules always use `chain_mm`.
        comm: the layout's `BlockComm` (default `LocalComm()`: one process, all units, all rows).
        rows_shard: the sequence -> this rank's local rows, contiguous and in order, padding only
            at the end, e.g. `lambda b: SeqShard(layout, inputs.num_rows).coshard(b, rank)`;
            None: this rank holds every row (TP without SP or CP).
        trace: receives every op of every block (`block{i}.{op}`) and the replicated stages
            (`embed.temb`, `embed.hidden`, `stack.out`, `head.video`, `head.audio`).

    Returns:
        `ModelOutput` (float32), the same on every rank.
    """
    comm = LocalComm() if comm is None else comm
    tr = trace or (lambda name, t, space: None)
    emb = embed(weights, inputs, backend=backend)
    tr("embed.temb", emb.batch.temb, "replicated"), tr("embed.hidden", emb.batch.hidden_states, "replicated")
    local = emb.batch if rows_shard is None else rows_shard(emb.batch)
    out = gather_sequence(run_blocks(weights, local, comm, backend=backend, trace=trace), comm, emb.batch)
    tr("stack.out", out, "replicated")
    result = head(weights, out, emb, backend=backend)
    tr("head.video", result.video, "replicated"), tr("head.audio", result.audio, "replicated")
    return result


__all__ = [
    "Embedded",
    "ModelOutput",
    "RowsShard",
    "embed",
    "gather_sequence",
    "head",
    "run_blocks",
    "transformer_forward",
]
