"""The block benchmark's interleaved timing (h3lab.bench.block_gpu.interleaved_times), without a GPU."""

from __future__ import annotations

from h3lab.bench.block_gpu import interleaved_times


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
