"""Every bad value is one clear line naming the value and what is allowed, never a traceback, and
nothing is written: the CLI's checks, the batch's, and non-finite values made visible."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from h3lab import H3Config, packed_batch
from h3lab.batch import ROW_FIELDS, PackedBatch
from h3lab.io.rundir import owner_record
from h3lab.launch.launcher import MAX_LOCAL_PROCESSES
from h3lab.metrics import compare
from h3lab.run.summary import format_summary
from tests.conftest import RUN, one_line_error


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--timeout", "nan"], ("timeout nan s", "allowed: a finite number of seconds > 0")),
        (["--timeout", "inf"], ("timeout inf s", "allowed: a finite number")),
        (["--timeout", "0"], ("timeout 0.0 s", "allowed: a finite number")),
        (["--timeout", "-1"], ("timeout -1.0 s", "allowed: a finite number")),
        (["--trajectory", "0"], ("--trajectory 0", "allowed: a number of sampler steps >= 1")),
        (["--seed", str(2**64)], (f"seed={2**64}", "allowed: an int in [0, 2**64 - 1]")),
        (["--seed", "-1"], ("seed=-1", "allowed: an int in [0, 2**64 - 1]")),
        (["--weights-seed", str(2**70)], (f"weights_seed={2**70}", "allowed")),
        (["--nnodes", "0"], ("nnodes=0", "allowed: an int >= 1")),
        (["--node-rank", "1"], ("node_rank=1", "allowed: 0..0 for nnodes=1")),
        (["--node-rank", "-1"], ("node_rank=-1", "allowed: 0..0")),
        (["--backend", "triton"], ("backend 'triton' runs on CUDA only", "allowed here: ['torch']")),
    ],
)
def test_a_bad_run_value_is_one_line_and_writes_nothing(capsys, tmp_path, extra, expected):
    one_line_error(capsys, [*RUN, *extra, "--out", str(tmp_path / "run")], *expected)
    assert not (tmp_path / "run").exists()


def test_world_sizes_past_one_machine_and_node_counts_out_of_range(capsys, tmp_path):
    out = ["--out", str(tmp_path / "run")]
    one_line_error(
        capsys,
        ["run", "--layout", "cp1000", "--synthetic", "tiny", *out],
        "layout cp1000: 1000 processes on this machine",
        f"allowed: at most {MAX_LOCAL_PROCESSES} per machine",
    )
    two_nodes = ["run", "--layout", "tp2:2x1", "--synthetic", "tiny", "--nnodes", "2", *out]
    one_line_error(capsys, [*two_nodes, "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"], "node_rank=2")
    one_line_error(capsys, [*two_nodes, "--rdzv-endpoint", "127.0.0.1:99999"], "'127.0.0.1:99999'", "allowed:")
    one_line_error(capsys, [*two_nodes, "--rdzv-endpoint", "nohostport"], "'nohostport'", "HOST:PORT")
    assert not (tmp_path / "run").exists()


def test_an_out_that_cannot_be_a_run_folder_is_refused(capsys, tmp_path):
    (tmp_path / "file").write_text("mine")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    one_line_error(capsys, [*RUN, "--out", str(tmp_path / "file")], "is a file, not a folder", "allowed:")
    one_line_error(capsys, [*RUN, "--out", str(tmp_path / "dangling")], "is a dangling link", "allowed:")
    assert (tmp_path / "file").read_text() == "mine" and not (tmp_path / "nowhere").exists()
    # sysfs refuses new folders even to root: a place no run can write
    one_line_error(capsys, [*RUN, "--out", "/sys/h3lab-run"], "'/sys/h3lab-run': cannot create it", "writable")
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o555)
    if os.geteuid() != 0:  # root writes into mode 0o555 folders anyway: sysfs above covers it
        one_line_error(capsys, [*RUN, "--out", str(readonly / "run")], "cannot create it", "writable")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    one_line_error(capsys, [*RUN, "--out", str(busy)], "is not empty (holds notes.txt)", "allowed:")
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]


def test_a_config_that_is_not_an_object_is_refused(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("[1, 2]")
    (ckpt / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    argv = ["run", "--layout", "tp2", "--checkpoint", str(ckpt), "--out", str(tmp_path / "run")]
    one_line_error(capsys, argv, "holds a JSON list", "allowed: a JSON object of config keys")
    (ckpt / "config.json").write_text("{not json")
    one_line_error(capsys, argv, "not JSON", "allowed: a JSON object")
    assert not (tmp_path / "run").exists()


def test_report_on_an_unfinished_run_names_its_state(capsys, tmp_path):
    for status, owner, expected in [
        ("running", owner_record(), "is still running"),
        ("interrupted", owner_record(), "is interrupted: KeyboardInterrupt"),
        ("running", owner_record() | {"pid": 2**22 + 1}, "is stale"),
    ]:
        run = tmp_path / f"run-{status}-{len(owner)}-{owner['pid']}"
        run.mkdir()
        summary = {"status": status, "owner": owner, "error": "KeyboardInterrupt", "request": {"problem": {}}}
        (run / "summary.json").write_text(json.dumps(summary | {"layouts": {}}))
        argv = ["report", str(run), "--out", str(tmp_path / "report"), "--no-screenshot"]
        one_line_error(capsys, argv, expected, "allowed: a finished run (passed or failed)")
    assert not (tmp_path / "report").exists()


# ---- the batch ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def batch() -> PackedBatch:
    return packed_batch(H3Config.tiny(), 24, seed=21, padding=3)


def _fields(batch: PackedBatch) -> dict:
    return {k: getattr(batch, k).clone() for k in (*ROW_FIELDS, "temb")}


def test_a_batch_without_grad_out_says_what_to_pass(batch):
    fields = _fields(batch)
    del fields["grad_out"]
    with pytest.raises(ValueError, match=r"grad_out: missing \(NoneType\); allowed: a \[S, D\] tensor"):
        PackedBatch(**fields)
    forward_only = torch.zeros((), dtype=batch.hidden_states.dtype).expand(batch.hidden_states.shape)
    assert PackedBatch(**fields, grad_out=forward_only).grad_out.stride() == (0, 0)


@pytest.mark.parametrize(
    ("field", "index", "value", "match"),
    [
        ("position_ids", (5, 1), math.nan, r"position_ids: 1 values hold NaN or Inf; allowed: finite values"),
        ("position_ids", (25, 0), math.inf, r"position_ids: 1 values hold NaN or Inf"),  # a padding row too
        ("hidden_states", (3, 7), math.nan, r"hidden_states: 1 active rows hold NaN or Inf; allowed: finite"),
        ("grad_out", (0, 0), -math.inf, r"grad_out: 1 active rows hold NaN or Inf"),
        ("temb", (1, 2), math.nan, r"temb: 1 values hold NaN or Inf"),
    ],
)
def test_non_finite_inputs_are_refused(batch, field, index, value, match):
    fields = _fields(batch)
    if field == "position_ids":
        fields[field] = fields[field].double()
    fields[field][index] = value
    with pytest.raises(ValueError, match=match):
        PackedBatch(**fields)


def test_padding_rows_may_hold_anything(batch):
    fields = _fields(batch)
    fields["hidden_states"][-1] = math.nan  # padding: dropped by every reduction
    fields["grad_out"][-2, :4] = math.inf
    assert PackedBatch(**fields).num_rows == batch.num_rows


def test_a_nan_is_never_a_silent_bitwise_pass():
    x = torch.randn(64, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    x[[3, 9]] = torch.tensor([math.nan, math.inf], dtype=torch.bfloat16)
    c = compare(x, x.clone(), name="out")
    assert c.bitwise_equal and (c.nonfinite_a, c.nonfinite_b) == (2, 2)  # equal bits, and counted
    summary = {"status": "passed", "layouts": {}, "canonical": {"status": "done", "nonfinite": {"out": 2}}}
    assert "WARNING: the canonical result holds NaN or Inf in out (2)" in format_summary(summary)


def test_a_checkpoint_with_non_finite_weights_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from h3lab.io.checkpoint import load_block, synthesize_checkpoint

    path = Path(synthesize_checkpoint(tmp_path / "ckpt", H3Config.tiny(), num_blocks=1, seed=23, single_file=True))
    (path / "manifest.json").unlink()  # a manifest would refuse the edited file first
    shard = path / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(shard))
    key = "transformer_blocks.0.attn.norm_q.weight"
    tensors[key][0] = math.nan
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=r"attn.norm_q.weight: 1 values in .* are NaN or Inf; allowed: finite"):
        load_block(path, 0)
