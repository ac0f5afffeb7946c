"""`BlockComm`: the only places where a layout touches the canonical block.

The block is written once against this interface. A single process (`LocalComm`) holds all eight
units and every row, so each method is the identity and the block is the canonical TP1 block.
A layout (h3lab.parallel.layout) supplies a comm whose methods move bytes between ranks and finish the
unit tree; it never changes the arithmetic. Row spaces, from small to large:
- local rows: this rank's shard (SP splits a TP group's rows);
- TP rows: the rows a tensor-parallel group works on (SP all-gathers them);
- sequence rows: every row of the request (CP all-gathers the TP rows of every CP group).
`site` names the call site for the collective decision records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor

from h3lab.config import NUM_UNITS


class BlockComm(Protocol):
    units: range  # canonical units held by this rank (contiguous; all 8 in one process)

    def reduce_units(
        self, root: Tensor, site: str, *, scatter_rows: bool = False, then: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor:
        """Finish the 8-unit tree from this rank's subtree root; optionally keep only local rows (SP).
        `then`: an elementwise function of the sums (the consumer's rounding): the result is then(sums),
        applied where it saves bytes (before the sums are shared)."""
        ...

    def start_reduce_units(
        self, root: Tensor, site: str, *, scatter_rows: bool = False, then: Callable[[Tensor], Tensor] | None = None
    ) -> Callable[[], Tensor]:
        """`reduce_units` begun now, its result from the returned function: the bytes may move while the
        block queues work that does not need them (the same bits as `reduce_units`)."""
        ...

    def gather_units(self, part: Tensor, site: str, *, dim: int) -> Tensor:
        """Concatenate every TP rank's unit-major slice along `dim` (a copy, no arithmetic)."""
        ...

    def gather_tp_rows(self, x: Tensor, site: str) -> Tensor:
        """Local rows -> TP rows (sequence-parallel all-gather, rank order)."""
        ...

    def gather_seq_rows(self, x: Tensor, site: str) -> Tensor:
        """TP rows -> sequence rows (context-parallel all-gather, global row order)."""
        ...


class LocalComm:
    """One process, all units, all rows: the canonical block."""

    units = range(NUM_UNITS)

    def reduce_units(
        self, root: Tensor, site: str, *, scatter_rows: bool = False, then: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor:
        return then(root) if then is not None else root

    def start_reduce_units(
        self, root: Tensor, site: str, *, scatter_rows: bool = False, then: Callable[[Tensor], Tensor] | None = None
    ) -> Callable[[], Tensor]:
        out = self.reduce_units(root, site, then=then)
        return lambda: out

    def gather_units(self, part: Tensor, site: str, *, dim: int) -> Tensor:
        return part

    def gather_tp_rows(self, x: Tensor, site: str) -> Tensor:
        return x

    def gather_seq_rows(self, x: Tensor, site: str) -> Tensor:
        return x
