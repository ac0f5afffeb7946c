"""The row plan of one block step, decided on the host, and the index cache that keeps it for the step:
one file on purpose (the plan seeds the cache its checks read; tests patch both here: _facts_of,
_decide). The plan: the canonical row order, the facts its row kernels check, the segment layout of
its AdaLN-row reductions and RoPE's largest position. Imports no Triton: the block enters the cache
on any install, and the Triton launchers (h3lab.triton.rows, h3lab.triton.rope) read their facts here.

The plan. A block step needs, before its attention, the canonical row order
(h3lab.ops.rows.key_order), the segment layout of its AdaLN-row reductions and the bounds of every
index the row kernels will read, and RoPE needs the largest position. Computed on the GPU that is
several host syncs and dozens of launches; each sync waits for everything queued, so the GPU idles
while the host sorts (python -m h3lab.bench.block_profile charges such gaps to their op). The
metadata is small (R x 3 int64 and one float), so `plan_rows` queues one copy of it into pinned
memory and returns; the block launches its first GEMMs; the returned function then waits for that
copy alone (queued before the GEMMs), decides everything on the host and seeds the step's index
cache, so the row kernels and RoPE that follow check nothing again. `decide_rows` decides the same
beforehand (a CUDA graph capture may not wait for the host: h3lab.block.graph).

The index cache. The block passes one `order` to ~20 row reductions, and every check of it is a
host synchronisation that drains the GPU's queue (python -m h3lab.bench.sync_sites). Facts are
cached only inside `index_cache()`, which `block_step` enters, and a model call around its blocks
(h3lab.model: its forward's scope resumed by its backward), so every block of the call reuses the
first block's row plan of the same metadata: there the index tensors are h3lab's own or the
request's, made before the call and never written during it. Outside, every call computes afresh, so a
caller that writes an index tensor behind torch's back (`.data`, a numpy alias), which keeps its
version counter, can never be served stale facts. Inside, keys still hold weak references and
version counters: an in-place write or a new tensor at a reused address is computed afresh.

Dimension legend: R rows (any order, padding included), G segments (AdaLN table rows).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

F32 = torch.float32
MAX_ANGLE = 1e6  # h3lab.ops.fixed.cos_sin's bound

# ---- the index cache ------------------------------------------------------------------------------

_SCOPE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("h3lab_index_cache", default=None)


@contextlib.contextmanager
def index_cache(resume: dict | None = None) -> Iterator[dict]:
    """Reuse index facts until the block exits (nested scopes share the outer one). Yields the scope's
    dict; `resume` re-enters such a dict (a block's backward run apart from its forward)."""
    outer = _SCOPE.get()
    if outer is not None:
        yield outer
        return
    scope = {} if resume is None else resume
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)  # the dict, its weak references and cached tensors go with it


def cached(kind: str, tensors: tuple[Tensor, ...], extra: tuple, compute: Callable[[], Any]) -> Any:
    """compute(), or its value from earlier in this scope for the same unmodified tensors and `extra`."""
    hit = _peek(kind, tensors, extra)  # inference tensors keep no version counter: never cached
    if hit is not None:
        return hit
    value = compute()
    seed(kind, tensors, extra, value)
    return value


def _peek(kind: str, tensors: tuple[Tensor, ...], extra: tuple) -> Any:
    """What `cached` holds for these unmodified tensors and `extra` in this scope, else None (computes nothing)."""
    cache = _SCOPE.get()
    if cache is None or any(t.is_inference() for t in tensors):
        return None
    hit = cache.get((kind, *map(id, tensors), *extra))
    if hit is not None and all(r() is t for r, t in zip(hit[0], tensors, strict=True)) and hit[1] == versions(tensors):
        return hit[2]
    return None


def seed(kind: str, tensors: tuple[Tensor, ...], extra: tuple, value: Any) -> None:
    """Record `value` as what `cached` would compute for these tensors, in this scope (none: dropped).

    For facts computed elsewhere: from the host copy a device index tensor was made from.
    """
    cache = _SCOPE.get()
    if cache is not None and not any(t.is_inference() for t in tensors):
        cache[(kind, *map(id, tensors), *extra)] = (tuple(weakref.ref(t) for t in tensors), versions(tensors), value)


def versions(tensors: tuple[Tensor, ...]) -> tuple[int, ...]:
    """torch's in-place write counters of `tensors`: a fact holds while they are unchanged."""
    return tuple(t._version for t in tensors)


# ---- index facts: what the row kernels check before they read -----------------------------------


def index_facts(t: Tensor) -> tuple[int, int, bool]:
    """(min, max, t == arange(n)) of a non-empty 1-D index tensor: one host sync, once per scope (none for
    a tensor whose facts are known: `know_facts`)."""
    return cached("facts", (t,), (), lambda: _known(t) or _facts_of(t))


# index tensors h3lab makes once and reads many times outside a block step (a request's key orders,
# the timesteps' arange), by id: (a weak reference, the version counter when told, the facts)
_KNOWN: dict[int, tuple[weakref.ref, int, tuple[int, int, bool]]] = {}


def know_facts(t: Tensor, facts: tuple[int, int, bool]) -> None:
    """Remember the `index_facts` of `t`, an index tensor h3lab made and never writes, while it lives
    unwritten (torch's version counter), in every scope and outside them: its row reductions then
    check it without a host sync. `facts` come from where `t` was made (`host_facts` of its host
    copy, or known by construction: an arange)."""
    if t.is_inference():  # no version counter: a write could not be seen
        return
    key = id(t)

    def gone(ref: weakref.ref) -> None:
        if _KNOWN.get(key, (None,))[0] is ref:
            del _KNOWN[key]

    _KNOWN[key] = (weakref.ref(t, gone), t._version, facts)


def known_facts(t: Tensor) -> tuple[int, int, bool] | None:
    """`index_facts` of `t` where they are known without a host sync (this scope's cache, or
    `know_facts`), else None: for a fast path that may be skipped, never for a check."""
    return _known(t) or _peek("facts", (t,), ())


def _known(t: Tensor) -> tuple[int, int, bool] | None:
    hit = _KNOWN.get(id(t))
    return hit[2] if hit is not None and hit[0]() is t and hit[1] == t._version else None


def _facts_of(t: Tensor) -> tuple[int, int, bool]:
    arange = torch.arange(t.numel(), device=t.device)
    lo, hi, ident = torch.stack([t.min(), t.max(), (t == arange).all().to(t.dtype)]).tolist()
    return lo, hi, bool(ident)


def host_facts(order_host: Tensor) -> tuple[int, int, bool] | None:
    """`index_facts` of a host index tensor (None when empty), for `seed_plan`."""
    return _facts_of(order_host) if order_host.numel() else None


def check_bounds(name: str, t: Tensor, limit: int) -> None:
    """Indices out of range would read outside x in a kernel: check them (see index_facts)."""
    if t.numel():
        lo, hi, _ = index_facts(t)
        if lo < 0 or hi >= limit:
            raise ValueError(f"{name}: values in [{lo}, {hi}]; allowed: [0, {limit})")


def reads_in_place(n_order: int, n_rows: int, facts: Callable[[], tuple[int, int, bool] | None]) -> bool:
    """Whether h3lab.triton.rows.row_mm uses its rows in place: `order` is arange(n_rows) (`facts`: its
    `index_facts`, asked for only when the lengths match). Launches differ with it, so a CUDA graph's
    signature holds it."""
    if n_order != n_rows:
        return False
    found = facts()
    return n_order == 0 or (found is not None and bool(found[2]))


# ---- the segment layout of the AdaLN-row reductions ---------------------------------------------


def check_segments(segment_R: Tensor, num_segments: int, R: int) -> None:
    """segment_R must be one int per row of an R-row tensor; its values are checked where they are read."""
    if segment_R.shape != (R,) or segment_R.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"segment_R: {segment_R.dtype} {tuple(segment_R.shape)}; allowed: int [R={R}]")
    if num_segments < 0:
        raise ValueError(f"num_segments={num_segments}; allowed: >= 0")


def segment_layout(segment_R: Tensor, num_segments: int, order: Tensor, R: int) -> tuple[Tensor, Tensor]:
    """(the active rows grouped by segment, key order inside each; each segment's start), checked, once
    per scope: from the plan when it seeded them, else computed on the device."""
    check_segments(segment_R, num_segments, R)
    check_bounds("order", order, R)
    return cached("segments", (segment_R, order), (num_segments,), lambda: _segments(segment_R, order, num_segments))


def _segments(segment_R: Tensor, order: Tensor, num_segments: int) -> tuple[Tensor, Tensor]:
    seg = segment_R.index_select(0, order).to(torch.int64)
    check_bounds("segment_R[order]", seg, num_segments)  # active rows only: padding may carry any segment
    rows = order.index_select(0, torch.argsort(seg, stable=True))
    counts = torch.zeros(num_segments, dtype=torch.int64, device=seg.device)
    counts.scatter_add_(0, seg, torch.ones_like(seg))  # integer adds: exact in any order; bincount would sync
    starts = torch.zeros(num_segments + 1, dtype=torch.int64, device=seg.device)  # int64 as the plan's
    starts[1:] = torch.cumsum(counts, 0)
    return rows, starts


def seed_plan(
    order: Tensor,
    facts: tuple[int, int, bool] | None,
    segment_R: Tensor,
    num_segments: int,
    layout: tuple[Tensor, Tensor],
) -> None:
    """Record, for this block step, the facts of `order` (`host_facts` of its host copy) and the
    segment layout of (segment_R, order), decided on the host: the reductions then make no host sync
    for them."""
    if facts is not None:
        seed("facts", (order,), (), facts)
    seed("segments", (segment_R, order), (num_segments,), layout)


# ---- RoPE's largest position ----------------------------------------------------------------------


def max_abs_position_tensor(pos: Tensor) -> Tensor:
    """[1] float32 on pos's device: max |float32(position)|, the largest angle (0 for no rows)."""
    if not pos.numel():
        return torch.zeros(1, dtype=F32, device=pos.device)
    return pos.to(F32).abs().amax().reshape(1)


def check_angle(biggest: float) -> None:
    """Raise as the reference does for angles of 1e6 rad or more (NaN positions pass, as in the
    reference: NaN tables)."""
    if biggest >= MAX_ANGLE:
        raise ValueError(f"cos_sin: |angle| up to {biggest:.3g}; allowed below 1e6 rad")


def check_max_abs_position(pos: Tensor, biggest: float) -> None:
    """`check_angle`, then remember the check for this block step (the plan reads `biggest` on the
    host and calls this before the tables are made)."""
    check_angle(biggest)
    seed("max_abs_f32", (pos,), (), biggest)


def checked_max_abs_position(pos: Tensor) -> float:
    """RoPE's largest |angle| input for these positions, checked: a host sync unless the plan read it."""
    biggest = cached("max_abs_f32", (pos,), (), lambda: float(max_abs_position_tensor(pos)[0]))
    check_max_abs_position(pos, biggest)
    return biggest


# ---- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RowPlan:
    """Everything `plan_rows` decides for one block step's metadata, decided once beforehand: a CUDA
    graph captures the block with it, since a capture may not wait for the host (h3lab.block.graph).

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
        seed_plan(self.order, self.order_facts, self.sources[1], self.num_segments, self.layout)
        check_max_abs_position(self.sources[2], self.max_abs_position)

    def device_tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        """(order, rows grouped by segment, segment starts) for use on the current stream: it waits
        for their copy (the plan may have been decided on another stream) and the allocator keeps
        their memory until this stream is done with them."""
        tensors = (self.order, *self.layout)
        # a capture may not wait on an event recorded outside it: h3lab.block.graph captures after a device
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
    sources = (keys_R2, segment_R, positions_R3)
    if decided is not None:
        check_decided(decided, sources, num_segments)
    else:  # the blocks of one model call read the same metadata: the first block's plan serves them all
        decided = _peek("plan", sources, (num_segments,))
    if decided is not None:

        def planned() -> Tensor:
            decided.seed()
            return decided.device_tensors()[0]  # it may have been decided on another stream

        return planned
    read = _queue(keys_R2, segment_R, num_segments, positions_R3)

    def order() -> Tensor:
        plan = read()
        plan.seed()
        seed("plan", sources, (num_segments,), plan)
        return plan.order  # copied on this stream: nothing to wait for

    return order


def _queue(keys_R2: Tensor, segment_R: Tensor, num_segments: int, positions_R3: Tensor) -> Callable[[], RowPlan]:
    """Check shapes, queue the metadata's copy; the returned function waits for it and decides."""
    if keys_R2.dim() != 2 or keys_R2.shape[1] != 2 or keys_R2.dtype != torch.int64:
        raise ValueError(f"logical_keys: {keys_R2.dtype} {tuple(keys_R2.shape)}; allowed: torch.int64 [R, 2]")
    R = keys_R2.shape[0]
    check_segments(segment_R, num_segments, R)
    device = keys_R2.device
    if {segment_R.device, positions_R3.device} != {device}:
        raise ValueError(
            f"keys on {device}, segments on {segment_R.device}, positions on {positions_R3.device}; allowed: one device"
        )
    meta = torch.cat([keys_R2, segment_R.to(torch.int64).unsqueeze(1)], dim=1)  # [R, 3]
    biggest = max_abs_position_tensor(positions_R3)  # [1] float32
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
        check_angle(biggest_f)  # raises as the kernel would, before anything goes to the device
        packed = torch.from_numpy(np.concatenate([order_h, rows_h, starts_h]))  # one copy to the device
        ready = None
        if device.type != "cpu":  # from pinned memory: a copy from pageable memory would wait for the GPU's queue
            packed = packed.pin_memory().to(device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        n = order_h.size
        layout = (packed[n : 2 * n], packed[2 * n :])
        facts = host_facts(torch.from_numpy(order_h))
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

    The same indices as h3lab.ops.rows.key_order and `_segments` (sorts of unique keys and stable
    sorts have one answer), in numpy: faster than torch's CPU ops at these sizes, and the GPU waits for
    the order meanwhile (python -m h3lab.bench.block_profile times the host's part of a step).
    """
    m = meta_h.numpy()
    k0, k1, seg = m[:, 0], m[:, 1], m[:, 2]
    active = np.flatnonzero(k0 >= 0)
    order = active[np.lexsort((k1[active], k0[active]))]  # key0, then key1, ascending
    s0, s1 = k0[order], k1[order]
    dup = np.flatnonzero((s0[1:] == s0[:-1]) & (s1[1:] == s1[:-1]))
    if dup.size:
        key = [int(s0[dup[0]]), int(s1[dup[0]])]
        raise ValueError(f"logical_keys: duplicate active key {key}; allowed: each active key once")
    seg_o = seg[order]
    if seg_o.size and (seg_o.min() < 0 or seg_o.max() >= num_segments):
        raise ValueError(f"segment_R[order]: values in [{seg_o.min()}, {seg_o.max()}]; allowed: [0, {num_segments})")
    grouped = order[np.argsort(seg_o, kind="stable")]
    starts = np.zeros(num_segments + 1, dtype=np.int64)
    np.cumsum(np.bincount(seg_o, minlength=num_segments), out=starts[1:])
    return order.astype(np.int64), grouped.astype(np.int64), starts
