"""The training step's profile by part (h3lab.bench.train_profile, h3lab.bench.step_parts): kernels
charged to the part whose marker the host passed last before launching them, and both sides'
markers in the order of the step's parts (CPU: the markers only; the GPU times need CUDA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3lab.bench import train_profile, train_step
from h3lab.bench.step_parts import _bounds, _events, by_part, side_by_side
from h3lab.config import H3Config
from h3lab.model.packing import request_of_rows
from h3lab.model.weights import SyntheticWeights

PARTS = ["stack forward", "head", "loss", "head backward", "stack backward", "embed backward", "clip", "update"]


def _trace(path: Path) -> Path:
    def mark(ts, name, tid=1):
        return {"ph": "X", "cat": "user_annotation", "name": f"h3lab:{name}", "ts": ts, "dur": 1, "tid": tid}

    def launch(ts, corr, tid=1):
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": ts,
            "dur": 2,
            "args": {"correlation": corr},
            "tid": tid,
        }

    def kernel(ts, dur, corr, name):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [
        launch(100, 1),
        kernel(150, 1000, 1, "embed_k"),  # before any marker: the first part
        mark(200, "embed.hidden"),
        launch(210, 2),
        kernel(1200, 3000, 2, "stack_k"),
        mark(220, "block0.attn"),  # a marker that opens no part: still the stack
        launch(230, 3),
        kernel(4200, 500, 3, "stack_k"),
        mark(300, "stack.out", tid=2),
        launch(310, 4, tid=2),
        kernel(4700, 2000, 4, "head_k"),  # another thread
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_kernels_are_charged_to_the_part_of_their_launch(tmp_path):
    parts = by_part(_trace(tmp_path / "t.json"), train_profile.canonical_part, "sample + embed")
    assert list(parts) == ["sample + embed", "stack forward", "head"]
    assert [parts[p]["gpu_ms"] for p in parts] == [1.0, 3.5, 2.0]  # kernel time, not launch time
    assert [parts[p]["launches"] for p in parts] == [1, 2, 1]
    assert parts["stack forward"]["kernels"] == [["stack_k", 3.5, 2]]
    assert parts["stack forward"]["most_launched"] == [["stack_k", 2]]
    assert parts["sample + embed"]["host_ms"] == pytest.approx(0.1) and parts["stack forward"]["host_ms"] == 0.1
    rows = side_by_side(parts, {"sample + embed": {"gpu_ms": 0.5}, "update": {"gpu_ms": 1.0}})
    assert [r["part"] for r in rows] == ["sample + embed", "stack forward", "head", "update"]
    assert rows[0]["ratio"] == 2.0 and rows[1]["ratio"] is None and rows[3]["canonical_ms"] == 0.0


def test_a_trace_without_gpu_events_is_named(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]}))
    with pytest.raises(ValueError, match="no GPU events"):
        by_part(path, train_profile.canonical_part, "sample + embed")


def test_both_sides_mark_the_steps_parts_in_order(tmp_path):
    args = ["--config", "tiny", "--blocks", "0-1", "--rows", "400", "--device", "cpu", "--steps", "2", "--warmup", "1"]
    a = train_step.parse_args(["--out", str(tmp_path / "r.json"), *args])
    config = H3Config.named("tiny")
    weights = SyntheticWeights(config, seed=0, device=a.device, generator=a.device)
    inputs = request_of_rows(config, a.rows, 1)
    canonical = train_profile._canonical_trace(a, weights, inputs, tmp_path)
    eager = train_profile._eager_trace(a, weights, inputs, tmp_path)
    step = [*PARTS, "sample + embed"]  # the update's end opens the next step's sample + embed
    # the canonical side's traced gradients sit apart, between its backward and its clip
    traced = [*PARTS[: PARTS.index("clip")], train_profile.TRACE, *PARTS[PARTS.index("clip") :], "sample + embed"]
    assert [p for _, p in _bounds(_events(canonical), train_profile.canonical_part)] == traced * 2
    assert [p for _, p in _bounds(_events(eager), train_profile.EAGER_PARTS.get)] == ["sample + embed", *step * 2]


def test_the_profile_refuses_a_cpu(capsys, tmp_path):
    assert train_profile.main(["--out", str(tmp_path / "r.json"), "--config", "tiny", "--device", "cpu"]) == 2
    assert "--device cpu; allowed: cuda" in capsys.readouterr().err
