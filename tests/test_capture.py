"""The capture of backend calls (h3lab.bench.capture, sm90_capture) on a CPU with the torch backend:
the recording moves no bit, every call replays from its recorded inputs alone, and a replay names the
op whose arithmetic moved."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from h3lab.backend import get_backend
from h3lab.bench import capture, sm90_capture
from h3lab.run import golden


@pytest.fixture(scope="module")
def tiny_capture():
    return sm90_capture.capture_tiny(get_backend("torch", "cpu"), "cpu", "torch")


class _OffByOneSilu:
    """The torch backend with one op moved by one ULP (the block's silu is bf16): what a replay must name."""

    def __init__(self):
        self.inner = get_backend("torch", "cpu")

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def silu(self, x, out_dtype):
        y = self.inner.silu(x, out_dtype)
        return (y.view(torch.int16) ^ 1).view(y.dtype)


def test_a_replay_of_the_capture_gives_its_bits_and_names_the_op_that_moves(tiny_capture):
    record, tensors = tiny_capture
    weights = golden.REFERENCE.weights("cpu").tensors
    rows = capture.replay(record["calls"], tensors, weights, get_backend("torch", "cpu"))
    assert len(rows) == len(record["calls"]) and all(r["same"] for r in rows)
    moved = capture.replay(record["calls"][:3], tensors, weights, _OffByOneSilu())
    assert [r["method"] for r in moved if not r["same"]] == ["silu"]


def test_the_capture_records_every_call_and_its_shards_hold_its_tensors(tmp_path, tiny_capture):
    record, tensors = tiny_capture
    assert record["golden"]["matches"]  # the recording moved no bit of the torch backend's published block
    methods = [c["method"] for c in record["calls"]]
    assert methods[0] == "plan_rows" and "plan_rows()" in methods and "attention_bwd" in methods
    files = sm90_capture.save_shards(tmp_path, "capture_tiny", tensors, limit=4 << 20)
    assert len(files) >= 4 and all(f["bytes"] <= (4 << 20) + (1 << 20) for f in files.values())
    loaded = {k: v for name in files for k, v in load_file(str(tmp_path / name)).items()}
    assert loaded.keys() == tensors.keys() and all(capture.same_bits(loaded[k], tensors[k]) for k in tensors)
    weights = [a for c in record["calls"] for a in c["args"]["list"] if isinstance(a, dict) and "weight" in a]
    assert weights and all(set(w) == {"weight", "dtype", "offset", "shape", "stride"} for w in weights)


def test_a_trajectory_capture_replays_call_for_call_and_holds_the_published_bits():
    record, tensors = sm90_capture.capture_trajectory(get_backend("torch", "cpu"), "cpu", "torch")
    assert record["golden"]["matches"] and record["golden"]["matching"] == 6  # steps 0-2, video and audio
    assert record["problem"]["weights_generator"] == "cpu"  # what lets a CPU emulate a GPU's trajectory
    methods = {c["method"] for c in record["calls"]}
    assert {"attention_fwd", "chain_mm", "unit_reduce", "rope_tables"} <= methods
    rows = capture.replay(record["calls"], tensors, {}, get_backend("torch", "cpu"))
    assert len(rows) == len(record["calls"]) and all(r["same"] for r in rows)


def test_every_gemm_sample_holds_at_least_gemm_elements():
    """A GEMM of few rows (the AdaLN GEMM's timestep rows) takes more columns: rows x columns >= 1024."""
    from h3lab.bench.spot_samples import GEMM_COLS, GEMM_ELEMENTS, GEMM_ROWS, gemm_cols

    assert gemm_cols(GEMM_ROWS) == GEMM_COLS and GEMM_ROWS * GEMM_COLS >= GEMM_ELEMENTS
    for rows in (1, 3, 7, 31):
        assert rows * gemm_cols(rows) >= GEMM_ELEMENTS and (rows * (gemm_cols(rows) - 1) < GEMM_ELEMENTS), rows
    assert gemm_cols(3, least=8) == 342 and gemm_cols(300, least=8) == 8
