"""`SeqShard`: which rows of the packed sequence each rank holds, and every per-row tensor sliced with them.

The sequence (the user's S rows) is padded to a multiple of the layout's row shards with padding
rows (first logical key -1, zero contents), which every reduction drops; so any row count works.
CP group c holds rows [c*S'/cp, (c+1)*S'/cp) ("TP rows"); under SP each TP rank holds its
1/tp slice of them ("local rows"). Hidden rows, adaln_indices, position_ids (hence rotary rows),
logical_keys and grad_out are always sliced together (`coshard`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3lab.batch import ROW_FIELDS, PackedBatch
from h3lab.parallel.assemble import row_shard
from h3lab.parallel.layout import Layout


@dataclass(frozen=True)
class SeqShard:
    layout: Layout
    num_rows: int  # rows of the user's batch (active and padding)

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise ValueError(f"num_rows={self.num_rows}: a sequence needs at least one row")

    @property
    def padded_rows(self) -> int:
        n = self.layout.row_shards
        return -(-self.num_rows // n) * n

    def tp_rows(self, rank: int) -> slice:
        """Rows of the rank's CP group (what its TP group works on)."""
        cp_index, _ = self.layout.coords(rank)
        per = self.padded_rows // self.layout.cp
        return slice(cp_index * per, (cp_index + 1) * per)

    def local_rows(self, rank: int) -> slice:
        """Rows the rank holds between TP regions (its SP slice, or its CP group's rows): its row shard
        (h3lab.parallel.assemble.row_shard, from the row groups of `Layout.groups()`)."""
        per = self.padded_rows // self.layout.row_shards
        k = row_shard(self.layout, rank)
        return slice(k * per, (k + 1) * per)

    def pad(self, batch: PackedBatch) -> PackedBatch:
        """`batch` with padding rows appended up to `padded_rows` (key (-1, j), zero contents)."""
        if batch.num_rows != self.num_rows:
            raise ValueError(f"batch has {batch.num_rows} rows, this SeqShard was made for {self.num_rows}")
        extra = self.padded_rows - self.num_rows
        if not extra:
            return batch
        like = {k: getattr(batch, k) for k in ROW_FIELDS}
        pad = {k: v.new_zeros((extra, *v.shape[1:])) for k, v in like.items()}
        pad["logical_keys"][:, 0] = -1
        pad["logical_keys"][:, 1] = torch.arange(extra)
        return PackedBatch(temb=batch.temb, **{k: torch.cat([like[k], pad[k]]) for k in ROW_FIELDS})

    def coshard(self, batch: PackedBatch, rank: int) -> PackedBatch:
        """This rank's local rows of `batch` (unpadded or already padded), every per-row tensor together."""
        padded = batch if batch.num_rows == self.padded_rows else self.pad(batch)
        return padded.rows(self.local_rows(rank))

    def owner_ranks(self) -> list[int]:
        """One rank per distinct row shard, in row order: concatenating their local rows gives the sequence
        (`Layout.groups().rows[0]`)."""
        return list(self.layout.groups().rows[0])
