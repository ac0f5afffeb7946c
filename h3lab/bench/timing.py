"""GPU-only time of a call: `inner` calls captured in one CUDA graph, replayed between CUDA events.

`triton.testing.do_bench` flushes L2 before each call and its events include the part of the host's
launch cost that outlasts the flush; a graph replays the calls back to back with no host in
between, so this is the kernels' own time (warm L2). Used by the scripts under reports/ that sweep
kernel candidates on a GPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from h3lab.graph import capture


def graph_ms(fn: Callable[[], Any], inner: int = 10, reps: int = 30) -> float:
    """Median milliseconds per call of `fn` over `reps` replays of a graph of `inner` calls (captured by
    h3lab.graph.capture after one warm-up round, which compiles). `fn` must be capturable: no host syncs."""
    if inner < 1 or reps < 1:
        raise ValueError(f"graph_ms: inner={inner}, reps={reps}; allowed: >= 1 each")
    graph, _ = capture(lambda: [fn() for _ in range(inner)], warmup=1)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)
