"""The GPU-idle-gap reader (h3lab.bench.gaps) on a hand-written chrome trace."""

from __future__ import annotations

import json

import pytest

from h3lab.bench.gaps import gaps


def _trace(tmp_path, events):
    p = tmp_path / "trace.json"
    p.write_text(json.dumps({"traceEvents": events}))
    return p


def test_gaps_are_charged_to_the_last_marker_before_the_launch(tmp_path):
    def k(name, ts, dur, corr):
        return {
            "ph": "X",
            "cat": "kernel",
            "name": name,
            "ts": ts,
            "dur": dur,
            "args": {"stream": 7, "correlation": corr},
        }

    def launch(ts, corr):
        return {
            "ph": "X",
            "cat": "cuda_driver",
            "name": "cuLaunchKernel",
            "ts": ts,
            "dur": 2,
            "args": {"correlation": corr},
        }

    mark = lambda name, ts: {"ph": "X", "cat": "user_annotation", "name": "h3lab:" + name, "ts": ts, "dur": 0}  # noqa: E731
    events = [
        launch(0, 1),
        k("a", 10, 100, 1),  # busy 10..110
        mark("norm1", 20),
        launch(25, 2),
        k("b", 110, 50, 2),  # back to back: no gap
        mark("rope", 30),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 40, "dur": 125},
        launch(290, 3),
        k("c", 300, 10, 3),  # idle 160..300 = 140 us, launched after "rope"
        mark("attn", 305),
        launch(320, 4),
        k("d", 330, 10, 4),  # 20 us after "attn"
        k("other-stream", 400, 1000, 99) | {"args": {"stream": 9, "correlation": 99}},
    ]
    r = gaps(_trace(tmp_path, events))
    assert r["span_us"] == 330 and r["busy_us"] == 170 and r["idle_us"] == 160 and r["gaps"] == 2
    assert r["idle_by_op_us"] == {"rope": 140, "attn": 20}
    assert r["largest"][0] == {
        "gap_us": 140,
        "before_kernel": "c",
        "after_op": "rope",
        "syncs": {"cudaStreamSynchronize": 1},
    }
    assert r["largest"][1]["syncs"] == {}


def test_a_trace_without_gpu_events_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no GPU events"):
        gaps(_trace(tmp_path, [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]))
