"""The benchmarks' timing helpers without a GPU: interleaved turns (h3lab.bench.block_gpu), graph_ms's checks."""

from __future__ import annotations

import pytest

from h3lab.bench.block_gpu import interleaved_times
from h3lab.bench.timing import graph_ms


def test_interleaved_times_calls_the_blocks_in_turn_between_syncs():
    log: list[str] = []
    times = interleaved_times(
        {"eager": lambda: log.append("eager"), "canonical": lambda: log.append("canonical")},
        reps=3,
        sync=lambda: log.append("sync"),
    )
    warmup, timed = log[:4], log[4:]
    assert warmup == ["eager", "canonical"] * 2  # two warm-up rounds, nothing timed
    # every timed call sits between two syncs, the blocks alternate, first in one rep, second in the
    # next (ABBA): drift, and what a call leaves to the next, fall on both alike
    ab, ba = (
        ["sync", "eager", "sync", "sync", "canonical", "sync"],
        ["sync", "canonical", "sync", "sync", "eager", "sync"],
    )
    assert timed == ab + ba + ab
    assert {name: len(t) for name, t in times.items()} == {"eager": 3, "canonical": 3}
    assert all(t >= 0.0 for ts in times.values() for t in ts)


def test_graph_ms_refuses_empty_graphs_before_touching_a_gpu():
    for inner, reps in ((0, 30), (10, 0)):
        with pytest.raises(ValueError, match=rf"inner={inner}, reps={reps}; allowed: >= 1 each"):
            graph_ms(lambda: None, inner=inner, reps=reps)
