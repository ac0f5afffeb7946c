"""Where the block's peak memory falls, and what is alive at it: the canonical GPU block and the eager one.

    python -m h3lab.bench.block_memory --out FILE.json [--rows 16384] [--config real] [--top 15]

Per row count, one step of each block (after a warm-up step) runs under the CUDA caching allocator's
history (`torch.cuda.memory._record_memory_history`, Python stacks). Replaying the history's
allocations and frees gives the bytes allocated over the step's start after every event; the first
maximum is the peak (`replay`; the same figure as `torch.cuda.max_memory_allocated` over the step's
start, recorded beside it as `stats_peak_extra_bytes`). Each allocation is named by its stack
(`site`): the block part it was made in (a part function of h3lab.block.forward / backward,
e.g. `_ffn_backward`; a source line of the eager block) with that part's line and code, and by the
op the host had last passed where torch can record it (`_set_memory_metadata`, torch >= 2.10): the
canonical block's trace hook names each op ("after attn.sdpa"), a dispatch mode names the eager
block's aten ops, whose autograd backward runs on the calling thread so that its allocations carry
this stack. The record: the peak (bytes, bytes per row, where), each part's own maximum in step
order, and the `--top` largest tensors alive at the peak, each with the part and line that made it.
"""

from __future__ import annotations

import argparse
import contextlib
import linecache
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from h3lab.backend import get_backend
from h3lab.batch import packed_batch
from h3lab.block import canonical_block
from h3lab.config import H3Config
from h3lab.io.env import capture as capture_env
from h3lab.io.jsonfile import write_json
from h3lab.reference.eager import eager_block
from h3lab.reference.oracle import rope_cos_sin
from h3lab.weights import synthetic_block

BENCH_FORMAT = "h3lab-bench-block-memory-v1"
# the files whose frames name a block part. "step": the canonical step's parts, each a function that
# the step's `forward` / `backward` calls (a frame deeper in these files is a helper of that part);
# "entry": the canonical block's entry points (what they allocate themselves, e.g. the assembly of
# the weight gradients); "line": the eager block's one function, a part per source line
PART_FILES = {
    "h3lab/block/forward.py": "step",
    "h3lab/block/backward.py": "step",
    "h3lab/block/step.py": "entry",
    "h3lab/reference/eager.py": "line",
}
NO_PART = "(no frame in a block part)"
GIB = 2**30


@dataclass(frozen=True)
class Alloc:
    """One allocation of the history: its event index, bytes, part, site and the op named with it."""

    event: int
    size: int
    part: str
    site: str
    op: str


@dataclass(frozen=True)
class Replay:
    """The history replayed: bytes over the start after each event, the peak, what is alive at it."""

    extra: list[int]  # after each event
    peak_event: int  # the first event at the maximum (-1: no event)
    peak_bytes: int
    live: list[Alloc]  # the allocations alive at the peak, largest first
    parts: list[dict[str, Any]]  # consecutive events of one part: its maximum, in step order


def _file_key(filename: str) -> str | None:
    name = filename.replace("\\", "/")
    return next((k for k in PART_FILES if name.endswith(k)), None)


def site(frames: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """(part, site) of an allocation from its Python frames (innermost first, as torch records them).

    The part frame: in the canonical step, the function its `forward` / `backward` called (the frame
    inside the outermost "step" frame); else the innermost frame in a part file. part = that
    function (an eager line: "function:line"); site = "function (file:line): code" of that frame, the
    line of the part that led to the allocation. (NO_PART, the innermost frame) for an allocation
    made outside every part file."""
    hits = [(f, key) for f in frames if (key := _file_key(f.get("filename", ""))) is not None]
    steps = [(f, key) for f, key in hits if PART_FILES[key] == "step"]
    if steps:
        f, key = steps[-2] if len(steps) > 1 else steps[-1]
    elif hits:
        f, key = hits[0]
    elif frames:
        f = frames[0]
        return NO_PART, f"{f.get('name', '?')} ({f.get('filename', '?')}:{f.get('line', '?')})"
    else:
        return NO_PART, "(no Python frame)"
    code = linecache.getline(f["filename"], f["line"]).strip()
    where = f"{f['name']} ({key.removeprefix('h3lab/')}:{f['line']})"
    part = f"{f['name']}:{f['line']}" if PART_FILES[key] == "line" else f["name"]
    return part, f"{where}: {code}" if code else where


def replay(events: Sequence[dict[str, Any]]) -> Replay:
    """Replay an allocator history (the trace entries of one device, oldest first).

    An "alloc" adds its bytes; the first of "free_requested" / "free_completed" for its address
    removes them (torch counts memory as freed at the request). A free of an address allocated
    before the history starts removes its bytes too, so the figures are bytes over the start, as
    `max_memory_allocated() - memory_allocated()` at the start. Other actions (segments, snapshots,
    out-of-memory) do not change allocated bytes.

    Raises:
        ValueError: an alloc at an address that is alive (a history with events missing).
    """
    live: dict[int, Alloc] = {}
    requested: set[int] = set()  # addresses freed by request whose completion is still to come
    extra, now = [], 0
    peak_event, peak_bytes, peak_live = -1, 0, {}
    parts: list[dict[str, Any]] = []
    for i, e in enumerate(events):
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            if addr in live:
                raise ValueError(f"event {i}: alloc at {addr:#x}, which is alive; allowed: a complete history")
            part, where = site(e.get("frames", []))
            live[addr] = Alloc(i, e["size"], part, where, e.get("user_metadata", ""))
            now += e["size"]
        elif action == "free_requested" or (action == "free_completed" and addr not in requested):
            freed = live.pop(addr, None)
            now -= freed.size if freed is not None else e["size"]
            if action == "free_requested":
                requested.add(addr)
        elif action == "free_completed":
            requested.discard(addr)
        extra.append(now)
        if action == "alloc":
            _extend_parts(parts, live[addr], i, now)
        if now > peak_bytes:
            peak_event, peak_bytes, peak_live = i, now, dict(live)
    ranked = sorted(peak_live.values(), key=lambda a: (-a.size, a.event))
    return Replay(extra, peak_event, peak_bytes, ranked, parts)


def _extend_parts(parts: list[dict[str, Any]], a: Alloc, event: int, now: int) -> None:
    """A part's run goes on while its allocations follow each other; frees never start a run."""
    if not parts or parts[-1]["part"] != a.part:
        parts.append({"part": a.part, "first_event": event, "max_bytes": now, "max_site": a.site})
    elif now > parts[-1]["max_bytes"]:
        parts[-1] |= {"max_bytes": now, "max_site": a.site}
    parts[-1]["last_event"] = event


def summarize(events: Sequence[dict[str, Any]], rows: int, top: int = 15) -> dict[str, Any]:
    """The JSON record of one block's history: the peak, where it falls, what is alive at it."""
    r = replay(events)
    at = events[r.peak_event] if r.peak_event >= 0 else {}
    peak_part, peak_site = site(at.get("frames", []))
    by_part: dict[str, int] = {}
    for a in r.live:
        by_part[a.part] = by_part.get(a.part, 0) + a.size
    return {
        "peak_extra_bytes": r.peak_bytes,
        "peak_extra_gib": r.peak_bytes / GIB,
        "peak_bytes_per_row": r.peak_bytes / rows,
        "events": len(events),
        "peak": {
            "event": r.peak_event,
            "part": peak_part,
            "site": peak_site,
            "op": at.get("user_metadata", ""),
            "alloc_bytes": at.get("size", 0),
        },
        "parts": [p | {"max_gib": p["max_bytes"] / GIB} for p in r.parts],
        "live_at_peak": {
            "count": len(r.live),
            "gib": sum(a.size for a in r.live) / GIB,
            "by_part_gib": {k: v / GIB for k, v in sorted(by_part.items(), key=lambda kv: -kv[1])},
            "top": [_tensor_record(a) for a in r.live[:top]],
        },
    }


def _tensor_record(a: Alloc) -> dict[str, Any]:
    return {"gib": a.size / GIB, "bytes": a.size, "part": a.part, "site": a.site, "op": a.op, "event": a.event}


@contextlib.contextmanager
def _op_names(name: Callable[[str], None] | None) -> Iterator[None]:
    """Names each aten op's allocations by the op (a dispatch mode), where torch can label them."""
    if name is None:
        yield
        return
    from torch.utils._python_dispatch import TorchDispatchMode

    class Named(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name(str(func))
            return func(*args, **(kwargs or {}))

    with Named():
        yield


def _metadata_setter() -> Callable[[str], None] | None:
    """torch's label for the allocations that follow (thread-local; torch >= 2.10), or None."""
    return getattr(torch.cuda.memory, "_set_memory_metadata", None)


def record(fn: Callable[[], Any]) -> tuple[list[dict[str, Any]], int]:
    """(the allocator's history of one call of `fn` on the current device, the call's peak bytes over
    its start by the allocator's own statistics). Disabling the history clears it, so each recording
    holds one call."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        setter = _metadata_setter()
        if setter is not None:
            setter("")
    events = snapshot["device_traces"][torch.cuda.current_device()]
    return list(events), torch.cuda.max_memory_allocated() - base


def measure(c: H3Config, rows: int, top: int) -> dict[str, Any]:
    """Both blocks' records at `rows` rows of config `c` (synthetic weights and batch, as block_gpu)."""
    dev = torch.device("cuda")
    w = synthetic_block(c, 0, seed=0).to(dev)
    b = packed_batch(c, rows, seed=1).to(dev)
    cos, sin = (t.to(dev).to(torch.bfloat16) for t in rope_cos_sin(b.position_ids.cpu(), c))
    label = _metadata_setter()
    be = get_backend("triton", dev)

    def mark(name: str, t: torch.Tensor, space: str) -> torch.Tensor:
        label(f"after {name}")  # the allocations that follow are this op's successors'
        return t

    def canonical() -> dict:
        return canonical_block(w, b, backend=be, trace=mark if label is not None else None).tensors()

    def eager() -> dict:
        # autograd's backward on this thread, so that its allocations carry this stack and op names
        with torch.autograd.set_multithreading_enabled(False), _op_names(label):
            return eager_block(w, b, cos, sin, True)

    out: dict[str, Any] = {}
    for name, fn in (("canonical", canonical), ("eager", eager)):
        fn()  # warm-up: compiles, fills the index caches, sizes the allocator's pool
        events, stats = record(fn)
        out[name] = summarize(events, rows, top) | {
            "stats_peak_extra_bytes": stats,
            "stats_peak_extra_gib": stats / GIB,
        }
        torch.cuda.empty_cache()
    out["ratio_peak"] = out["canonical"]["peak_extra_bytes"] / out["eager"]["peak_extra_bytes"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; refuses row counts and --top that cannot run before any GPU work."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="16384")
    ap.add_argument("--config", default="real")
    ap.add_argument("--top", type=int, default=15, help="the largest tensors alive at the peak to name")
    a = ap.parse_args(argv)
    parts = a.rows.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        ap.error(f"--rows {a.rows!r}; allowed: positive integers, comma-separated")
    if a.top < 1:
        ap.error(f"--top {a.top}; allowed: >= 1")
    a.rows = [int(p) for p in parts]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("block_memory needs a CUDA device (the CUDA caching allocator's history)")
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict[str, Any] = {
        "format": BENCH_FORMAT,
        "config": a.config,
        "env": capture_env(torch.device("cuda")),
        "op_labels": _metadata_setter() is not None,
        "rows": {},
    }
    for rows in a.rows:
        out["rows"][rows] = r = measure(H3Config.named(a.config), rows, a.top)
        for name in ("canonical", "eager"):
            p = r[name]
            print(
                f"{rows} {name}: peak {p['peak_extra_gib']:.3f} GiB (allocator {p['stats_peak_extra_gib']:.3f}) "
                f"in {p['peak']['site']} [{p['peak']['op']}]",
                flush=True,
            )
        write_json(a.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
