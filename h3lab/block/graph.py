"""The canonical block captured in a CUDA graph: captured once per weights, shapes and row signature,
then each call copies a batch in and replays the whole forward+backward with one launch.

Why: a block step launches ~150 kernels, and an h3lab GEMM launch costs the host several times a
cuBLAS call (Triton's binder and launcher, TMA descriptors), so the GPU waits for the host, and at
a few hundred rows the step is host-bound (python -m h3lab.bench.block_profile measures the launch
cost and the GPU's idle gaps; h3lab.bench.block_gpu the step with and without a graph). A replay
costs the host one graph launch and ten small copies, plus the row plan's decision (below) unless
it was decided ahead.

The bits are the eager step's: a replay runs the same kernels with the same configurations and
arguments, on the capture's own buffers (a GPU test compares the bytes of replays and eager
steps). What one capture fixes:
- the shapes, the weights' storage, the device;
- the row signature: how many rows are active and whether they already arrive in canonical order
  (then the weight gradients read them in place, otherwise through a gather: another launch
  sequence, h3lab.rowplan.reads_in_place). A capture may not wait for the host, so the row
  plan (h3lab.rowplan) is decided on the host before each replay — a host sync that waits
  for the work queued on its stream, unless decided ahead on another stream — and its device
  tensors are copied into the capture's;
- the outputs' memory: each call overwrites the last call's `BlockResult`; clone what you keep.
A batch with another row signature needs another capture (~the eager step's peak memory each,
held until the `GraphedBlock` is dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from h3lab import rowplan
from h3lab.backend import get_backend
from h3lab.batch import FIELDS, PackedBatch
from h3lab.block.result import BlockResult
from h3lab.block.step import canonical_block
from h3lab.rowplan import RowPlan
from h3lab.weights import BlockWeights

T = TypeVar("T")


def capture(fn: Callable[[], T], *, warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, T]:
    """(graph, fn's outputs): `fn` called `warmup` times on a side stream (Triton compiles, cuBLAS and
    allocator warm-up stay out of the graph, as torch.cuda.graph's docs ask), then captured once."""
    if warmup < 1:
        raise ValueError(f"warmup={warmup}; allowed: >= 1 (the first call compiles, which a capture may not)")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class GraphedBlock:
    """`canonical_block(weights, batch, backend="triton")` as one CUDA graph for this batch's shapes
    and row signature; `graphed(batch)` replays it on another batch of the same signature.

    Raises:
        ValueError: a batch not on a CUDA device; at a call, a batch whose shapes, dtypes, device or
            row signature differ from the captured one, or a `decided_rows` not decided from this
            batch's own metadata tensors, or written since (h3lab.rowplan.check_decided).
    """

    def __init__(self, weights: BlockWeights, batch: PackedBatch, *, warmup: int = 2) -> None:
        if batch.device.type != "cuda":
            raise ValueError(f"GraphedBlock: batch on {batch.device}; allowed: a CUDA device (CUDA graphs)")
        self.device = batch.device
        with torch.cuda.device(self.device):  # the capture's stream is the batch's device's
            # private copies: a call copies its batch into these, the addresses the graph reads
            self.batch = PackedBatch(**{k: getattr(batch, k).clone() for k in FIELDS})
            self.rows = self.decide(self.batch)
            self.captured_signature = self.signature(self.rows)
            be = get_backend("triton", self.device)  # built once: every replay runs these kernels
            self.graph, self.result = capture(
                lambda: canonical_block(weights, self.batch, backend=be, decided_rows=self.rows), warmup=warmup
            )

    def decide(self, batch: PackedBatch) -> RowPlan:
        """The row plan of `batch`'s metadata: a host sync that waits for the work queued on the current
        stream. To decide ahead, while the last replay runs, call it under another stream once the
        metadata is on the device (`with torch.cuda.stream(side):`); the call waits for the plan's copy."""
        keys, segments, positions, num_segments = _metadata(batch)
        return rowplan.decide_rows(keys, segments, num_segments, positions)

    def signature(self, rows: RowPlan) -> tuple[int, bool]:
        """(active rows, read in place): what of a row plan the captured launches depend on."""
        n = rows.order.numel()
        return n, rowplan.reads_in_place(n, self.batch.num_rows, lambda: rows.order_facts)

    def __call__(self, batch: PackedBatch, *, decided_rows: RowPlan | None = None) -> BlockResult:
        """Copy `batch` in, replay; the result's tensors are overwritten by the next call.

        `decided_rows`: `self.decide(batch)` made earlier; by default decided now.
        """
        for name in FIELDS:
            new, mine = getattr(batch, name), getattr(self.batch, name)
            if (new.shape, new.dtype, new.device) != (mine.shape, mine.dtype, mine.device):
                raise ValueError(
                    f"{name}: {new.dtype} {list(new.shape)} on {new.device}; allowed: "
                    f"{mine.dtype} {list(mine.shape)} on {mine.device}, as captured"
                )
        with torch.cuda.device(self.device):
            rows = self.decide(batch) if decided_rows is None else decided_rows
            keys, segments, positions, num_segments = _metadata(batch)
            rowplan.check_decided(rows, (keys, segments, positions), num_segments)
            if self.signature(rows) != self.captured_signature:
                raise ValueError(
                    f"row signature (active rows, in place) {self.signature(rows)}; allowed: "
                    f"{self.captured_signature}, as captured (capture another GraphedBlock)"
                )
            for name in FIELDS:
                getattr(self.batch, name).copy_(getattr(batch, name))
            for mine, new in zip((self.rows.order, *self.rows.layout), rows.device_tensors(), strict=True):
                mine.copy_(new)
            self.graph.replay()
        return self.result


def _metadata(b: PackedBatch) -> tuple[Tensor, Tensor, Tensor, int]:
    """(keys, segments, positions, number of segments) as block_step hands them to the row plan."""
    return b.logical_keys, b.adaln_indices, b.position_ids, 3 * b.num_timesteps
