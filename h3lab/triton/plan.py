"""The block's index facts, read on the host without draining the GPU's queue.

A block step needs, before its attention, the canonical row order (h3lab.ops.rows.key_order), the
segment layout of its AdaLN-row reductions and the bounds of every index the row kernels will read,
and RoPE needs the largest position. Computed on the GPU that was five host syncs and ~30 launches;
each sync waits for everything queued, so the GPU idled while the host sorted (2.2 ms at 4096 rows
on the H200, reports/h200/README.md). The metadata is small (R x 3 int64 and one float: 100 KB at
4096 rows), so `plan_rows` queues one copy of it into pinned memory and returns; the block
launches its first GEMMs; the returned function then waits for that copy alone (queued before the
GEMMs), decides everything on the host and seeds the block step's index cache
(h3lab.triton.index_cache), so the row kernels and RoPE that follow check nothing again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from h3lab.triton import rope, rows
from h3lab.triton.index_cache import versions


@dataclass(frozen=True, eq=False)
class RowPlan:
    """Everything `plan_rows` decides for one block step's metadata, decided once beforehand: a CUDA
    graph captures the block with it, since a capture may not wait for the host (h3lab.graph).

    Holds the metadata tensors it was decided from; `plan_rows(..., decided=plan)` checks that the
    block passes these very tensors, unwritten since (torch's version counters), or raises.
    """

    sources: tuple[Tensor, Tensor, Tensor]  # keys [R, 2], segment [R], positions [R, 3]
    source_versions: tuple[int, ...]
    num_segments: int
    order: Tensor  # [R_active] int64 on the keys' device: the canonical order
    order_facts: tuple[int, int, bool] | None  # its (min, max, is arange), from the host copy; None: empty
    layout: tuple[Tensor, Tensor]  # rows grouped by segment, segment starts (device)
    max_abs_position: float  # RoPE's largest |angle| input, checked below 1e6
    ready: torch.cuda.Event | None  # recorded after the device tensors' copy (None on the CPU)

    def seed(self) -> None:
        """Record the plan's facts in the current block step's index cache (no host sync)."""
        rows.seed_plan(self.order, self.order_facts, self.sources[1], self.num_segments, self.layout)
        rope.check_max_abs_position(self.sources[2], self.max_abs_position)

    def device_tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        """(order, rows grouped by segment, segment starts) for use on the current stream: it waits
        for their copy (the plan may have been decided on another stream) and the allocator keeps
        their memory until this stream is done with them."""
        tensors = (self.order, *self.layout)
        # a capture may not wait on an event recorded outside it: h3lab.graph captures after a device
        # synchronisation, so the copy is done by then
        if self.ready is not None and not torch.cuda.is_current_stream_capturing():
            stream = torch.cuda.current_stream(self.order.device)
            stream.wait_event(self.ready)
            for t in tensors:
                t.record_stream(stream)
        return tensors


def decide_rows(keys_R2: Tensor, segment_R: Tensor, num_segments: int, positions_R3: Tensor) -> RowPlan:
    """`plan_rows`' decisions now, waiting for the metadata's copy (one host sync on a GPU)."""
    return _queue(keys_R2, segment_R, num_segments, positions_R3)()


def plan_rows(
    keys_R2: Tensor, segment_R: Tensor, num_segments: int, positions_R3: Tensor, *, decided: RowPlan | None = None
) -> Callable[[], Tensor]:
    """Queue the metadata's copy to the host; the returned function gives the canonical order (on the
    keys' device) once the copy is done, after checking every index (ValueError as the kernels raise),
    and seeds the block step's index cache with what it decided.

    With `decided` (`decide_rows` of these tensors) nothing is copied or waited for: the returned
    function seeds the plan's facts and gives its order.
    """
    if decided is not None:
        check_decided(decided, (keys_R2, segment_R, positions_R3), num_segments)

        def planned() -> Tensor:
            decided.seed()
            return decided.device_tensors()[0]  # it may have been decided on another stream

        return planned
    read = _queue(keys_R2, segment_R, num_segments, positions_R3)

    def order() -> Tensor:
        plan = read()
        plan.seed()
        return plan.order  # copied on this stream: nothing to wait for

    return order


def _queue(keys_R2: Tensor, segment_R: Tensor, num_segments: int, positions_R3: Tensor) -> Callable[[], RowPlan]:
    """Check shapes, queue the metadata's copy; the returned function waits for it and decides."""
    if keys_R2.dim() != 2 or keys_R2.shape[1] != 2 or keys_R2.dtype != torch.int64:
        raise ValueError(f"logical_keys: {keys_R2.dtype} {tuple(keys_R2.shape)}; allowed: torch.int64 [R, 2]")
    R = keys_R2.shape[0]
    rows.check_segments(segment_R, num_segments, R)
    device = keys_R2.device
    if {segment_R.device, positions_R3.device} != {device}:
        raise ValueError(
            f"keys on {device}, segments on {segment_R.device}, positions on {positions_R3.device}; allowed: one device"
        )
    meta = torch.cat([keys_R2, segment_R.to(torch.int64).unsqueeze(1)], dim=1)  # [R, 3]
    biggest = rope.max_abs_position_tensor(positions_R3)  # [1] float32
    if device.type == "cpu":  # the interpreter: the "copy" is already on the host
        meta_h, biggest_h, done = meta, biggest, None
    else:
        meta_h = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True).copy_(meta, non_blocking=True)
        biggest_h = torch.empty(1, dtype=biggest.dtype, pin_memory=True).copy_(biggest, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))  # the copies' stream: the metadata's device, not the current one
    sources = (keys_R2, segment_R, positions_R3)
    read_versions = versions(sources)

    def decide() -> RowPlan:
        if versions(sources) != read_versions:  # the facts below would be stale
            raise ValueError(
                "keys, segments or positions were written between plan_rows and reading its order; "
                "allowed: read the order before writing them"
            )
        if done is not None:
            done.synchronize()  # this copy only, not the GEMMs queued behind it
        order_h, rows_h, starts_h = _decide(meta_h, num_segments)  # the keys first, as the torch backend
        biggest_f = float(biggest_h[0])
        rope.check_angle(biggest_f)  # raises as the kernel would, before anything goes to the device
        packed = torch.from_numpy(np.concatenate([order_h, rows_h, starts_h]))  # one copy to the device
        ready = None
        if device.type != "cpu":  # from pinned memory: a copy from pageable memory would wait for the GPU's queue
            packed = packed.pin_memory().to(device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        n = order_h.size
        layout = (packed[n : 2 * n], packed[2 * n :])
        facts = rows.host_facts(torch.from_numpy(order_h))
        return RowPlan(sources, read_versions, num_segments, packed[:n], facts, layout, biggest_f, ready)

    return decide


def check_decided(plan: RowPlan, sources: tuple[Tensor, Tensor, Tensor], num_segments: int) -> None:
    """`plan` was decided from these very tensors (keys, segments, positions), unwritten since."""
    names = ("logical_keys", "segment_R (the AdaLN indices)", "positions_R3 (the position ids)")
    for name, mine, given in zip(names, plan.sources, sources, strict=True):
        if mine is not given:
            raise ValueError(
                f"decided rows: {name} is not the tensor the plan was decided from; "
                "allowed: the same tensor objects (decide_rows on the block's own metadata)"
            )
    now = versions(sources)
    written = [name for name, a, b in zip(names, plan.source_versions, now, strict=True) if a != b]
    if written:
        raise ValueError(
            f"decided rows: {', '.join(written)} written after decide_rows; "
            "allowed: unwritten since (decide again after writing them)"
        )
    if num_segments != plan.num_segments:
        raise ValueError(f"decided rows: num_segments {num_segments}; allowed: {plan.num_segments}, as decided")


def _decide(meta_h: Tensor, num_segments: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, rows grouped by segment, segment starts), int64, from the host copy of [keys | segment].

    The same indices as h3lab.ops.rows.key_order and h3lab.triton.rows._segments (sorts of unique
    keys and stable sorts have one answer), in numpy: ~2x faster than torch's CPU ops on 4096 rows,
    time the GPU would otherwise idle waiting for the order.
    """
    m = meta_h.numpy()
    k0, k1, seg = m[:, 0], m[:, 1], m[:, 2]
    active = np.flatnonzero(k0 >= 0)
    order = active[np.lexsort((k1[active], k0[active]))]  # key0, then key1, ascending
    s0, s1 = k0[order], k1[order]
    dup = np.flatnonzero((s0[1:] == s0[:-1]) & (s1[1:] == s1[:-1]))
    if dup.size:
        key = [int(s0[dup[0]]), int(s1[dup[0]])]
        raise ValueError(f"logical_keys: duplicate active key {key}; active keys must be unique")
    seg_o = seg[order]
    if seg_o.size and (seg_o.min() < 0 or seg_o.max() >= num_segments):
        raise ValueError(f"segment_R[order]: values in [{seg_o.min()}, {seg_o.max()}]; allowed: [0, {num_segments})")
    grouped = order[np.argsort(seg_o, kind="stable")]
    starts = np.zeros(num_segments + 1, dtype=np.int64)
    np.cumsum(np.bincount(seg_o, minlength=num_segments), out=starts[1:])
    return order.astype(np.int64), grouped.astype(np.int64), starts
