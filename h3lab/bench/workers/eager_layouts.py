"""The eager baseline at a layout: its process groups, this rank's rows and RoPE tables.

What a user runs instead of the deterministic layout (h3lab.reference.eager): the same `Layout`
(tp, cp, sp), the same rows and ranks, Megatron/TorchTitan-style collectives. Rows split as
`SeqShard` splits them, but with no padding rows: the row count must divide into the row shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from h3lab.batch import PackedBatch
from h3lab.parallel.layout import Layout
from h3lab.parallel.procgroups import RankGroups, new_groups
from h3lab.parallel.seqshard import SeqShard
from h3lab.reference.eager import EagerCollectives, EagerParallel, tp_shard
from h3lab.reference.oracle import rope_cos_sin
from h3lab.weights import BlockWeights

EagerGroups = RankGroups[dist.ProcessGroup]  # the layout's TP, CP and row groups, as this rank sees them


def eager_groups(layout: Layout, rank: int) -> EagerGroups:
    """Create the groups (h3lab.parallel.procgroups); every rank of the world calls this in the same
    order (a rank outside the layout too: it gets no group)."""
    return new_groups(layout, dict.fromkeys(("tp", "cp", "rows"), dist.new_group), rank=rank)


def eager_parallel(layout: Layout, groups: EagerGroups, ops: EagerCollectives | None = None) -> EagerParallel:
    """This rank's `EagerParallel` for `layout` (collectives through `ops`)."""
    rows_size = layout.row_shards
    return EagerParallel(
        tp_group=groups.tp,
        tp_size=layout.tp,
        cp_group=groups.cp,
        cp_size=layout.cp,
        sp=layout.sp,
        rows_group=groups.rows,
        rows_size=rows_size,
        ops=ops or EagerCollectives(),
    )


@dataclass(frozen=True, eq=False)
class EagerInputs:
    """One rank's inputs of the eager layout: its shard of the weights, its rows, RoPE of its TP rows."""

    shard: dict[str, Tensor] | None  # None at tp1: the whole block
    batch: PackedBatch  # local rows
    cos: Tensor  # [R_tp, P] bf16
    sin: Tensor


def eager_inputs(w: BlockWeights, full: PackedBatch, layout: Layout, rank: int) -> EagerInputs:
    """This rank's eager inputs from the whole block and the whole (unpadded) batch.

    Raises:
        ValueError: rows that do not divide into the layout's row shards.
    """
    shards = layout.row_shards
    if full.num_rows % shards:
        raise ValueError(
            f"the eager baseline of {layout.name} splits {full.num_rows} rows into {shards} equal shards; "
            f"allowed: a multiple of {shards} rows"
        )
    seq = SeqShard(layout, full.num_rows)
    tp_rows = seq.tp_rows(rank)
    cos, sin = rope_cos_sin(full.position_ids[tp_rows].cpu(), w.config)
    _, tp_index = layout.coords(rank)
    shard = tp_shard(w, tp_index, layout.tp) if layout.tp > 1 else None
    device = full.device
    return EagerInputs(
        shard=shard,
        batch=full.rows(seq.local_rows(rank)),
        cos=cos.to(device).to(torch.bfloat16),
        sin=sin.to(device).to(torch.bfloat16),
    )
