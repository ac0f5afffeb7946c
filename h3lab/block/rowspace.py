"""One rank's rows and units inside a block step: the gathers between its row spaces, the slices of
its unit-major tensors, and the cross-row chain sums of gathered row sets.

Row spaces (h3lab.comm), from small to large: local rows (this rank's shard), TP rows (its tensor-
parallel group's), sequence rows (the whole request's). Every cross-row reduction reads sequence
rows in the canonical order; a gather under `LocalComm` is the identity (the tensor itself), under
SP or CP a copy.

Dimension legend: R rows, D hidden, G segments (AdaLN table rows), n one unit's width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from h3lab import rowplan
from h3lab.backend import Backend
from h3lab.comm import BlockComm

ChainSet = tuple[Tensor, Callable[[Tensor, str], Tensor], str]  # (rows, the gather to sequence rows, its site)


@dataclass(frozen=True, eq=False)
class RowSpace:
    """The gathers and unit slices of the rank that `comm` belongs to."""

    comm: BlockComm

    @property
    def units(self) -> range:
        return self.comm.units

    def tp(self, t_local: Tensor, site: str) -> Tensor:
        """Local rows -> TP rows."""
        return self.comm.gather_tp_rows(t_local, site)

    def seq(self, t_tp: Tensor, site: str) -> Tensor:
        """TP rows -> sequence rows."""
        return self.comm.gather_seq_rows(t_tp, site)

    def seq_local(self, t_local: Tensor, site: str) -> Tensor:
        """Local rows -> sequence rows (both gathers under one site)."""
        return self.seq(self.tp(t_local, site), site)

    def seq_in_order(self, t_tp: Tensor, site: str, order: Tensor) -> Tensor:
        """TP rows -> the sequence's active rows in canonical order (a copy: padding dropped)."""
        return self.seq(t_tp, site)[order]

    def tp_from_order(self, t_c: Tensor, order: Tensor, n_rows: int) -> Tensor:
        """The inverse of `seq_in_order` where the TP rows are the sequence's (no CP): canonical-order
        rows back into `n_rows` rows, padding rows zero; `t_c` itself where `order` is known, without a
        host sync, to be arange(n_rows) (the same bytes either way)."""
        if rowplan.reads_in_place(order.numel(), n_rows, lambda: rowplan.known_facts(order)):
            return t_c
        return t_c.new_zeros((n_rows, *t_c.shape[1:])).index_copy_(0, order, t_c)

    def seq_columns_in_order(self, t_HR: Tensor, site: str, order: Tensor) -> Tensor:
        """`seq_in_order` of a [H, R_tp] per-(head, row) tensor: [H, R_active]."""
        return self.seq(t_HR.transpose(0, 1), site)[order].transpose(0, 1)

    def unit_rows(self, t: Tensor, n: int) -> dict[int, Tensor]:
        """Each held unit's block of `n` rows of a unit-major tensor, as views."""
        first = self.units.start
        return {u: t[(u - first) * n : (u - first + 1) * n] for u in self.units}

    def unit_cols(self, t: Tensor, n: int) -> dict[int, Tensor]:
        """Each held unit's block of `n` columns of a unit-major tensor, as views."""
        first = self.units.start
        return {u: t[:, (u - first) * n : (u - first + 1) * n] for u in self.units}


def sum_chain_sets(
    be: Backend,
    row_sets: list[ChainSet],
    table_sets: list[ChainSet],
    segment_R: Tensor,
    num_segments: int,
    order: Tensor,
) -> tuple[list[Tensor], list[Tensor]]:
    """be.chain_sums of the gathered row sets (row_sum) and table sets (segment_sum), the same bits as
    one call per set.

    A gather that copies (SP or CP layouts) has its set summed alone at once, so one gathered FP32
    [R_seq, D] copy is alive at a time: the block's peak memory is in this part of the backward.
    Sets used in place go side by side in one call (on the GPU one launch: a set alone is
    latency-bound). Every rank takes the same path (the layout decides), so the gathers meet in
    one order.
    """
    outs: list[list[Tensor | None]] = [[None] * len(row_sets), [None] * len(table_sets)]
    in_place: list[list[tuple[int, Tensor]]] = [[], []]
    for kind, sets in enumerate((row_sets, table_sets)):
        for i, (t, gather, site) in enumerate(sets):
            g = gather(t, site)
            if g is t:
                in_place[kind].append((i, g))
                continue
            sums, segs = be.chain_sums(*(([g], []) if kind == 0 else ([], [g])), segment_R, num_segments, order)
            outs[kind][i] = (sums + segs)[0]
            del g  # before the next set's gather
    if in_place[0] or in_place[1]:
        got = be.chain_sums([g for _, g in in_place[0]], [g for _, g in in_place[1]], segment_R, num_segments, order)
        for kind in (0, 1):
            for (i, _), out in zip(in_place[kind], got[kind], strict=True):
                outs[kind][i] = out
    assert all(o is not None for kinds in outs for o in kinds), "every chain set summed once"
    return outs[0], outs[1]  # type: ignore[return-value]
