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
from h3lab.run.limits import check_request
from h3lab.run.problem import Problem
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
        (["--backend", "triton"], ("backend 'triton' runs on CUDA only", "allowed here: ['torch', 'emulate-sm90']")),
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


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda f: {"hidden_states": f["hidden_states"][0]},
            r"hidden_states: shape \[\d+\]; allowed: 2-D \[S, hidden\]",
        ),
        (lambda f: {"temb": f["temb"].double()}, r"temb: dtype torch.float64; allowed: torch.float32"),
        (lambda f: {"grad_out": f["grad_out"][:-1]}, r"grad_out: shape \[26, \d+\]; allowed: \[27, \d+\]"),
        (lambda f: {"grad_out": f["grad_out"].float()}, r"grad_out: dtype torch.float32; allowed: torch.bfloat16"),
        (lambda f: {"adaln_indices": f["adaln_indices"][:-1]}, r"adaln_indices: shape \[26\]; allowed: \[27\]"),
        (lambda f: {"logical_keys": f["logical_keys"] * 0}, r"logical_keys: duplicate active key \[0, 0\]; allowed"),
    ],
)
def test_a_malformed_batch_is_refused_naming_what_is_allowed(batch, change, match):
    fields = _fields(batch)
    with pytest.raises(ValueError, match=match) as err:
        PackedBatch(**(fields | change(fields)))
    assert "; allowed:" in str(err.value) and "\n" not in str(err.value)


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


# ---- bounded requests -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--rows", "1000000000"], ("rows + padding=1000000000", "GiB of host memory", "allowed: rows + padding <=")),
        (
            ["--train-steps", "1", "--blocks", "0-0", "--text-rows", "100000000"],
            ("text_rows=100000000", "train task", "allowed: text_rows <="),
        ),
        (["--block", "1000000"], ("block 1000000: a synthetic config has as many blocks", "allowed: 0..49")),
        (["--blocks", "0-1000000"], ("block 1000000", "allowed: 0..49")),
        (["--repeats", "1000000000"], ("repeats=1000000000", "allowed: 1..1000")),
    ],
)
def test_a_request_past_its_bounds_is_refused_before_any_process(capsys, tmp_path, extra, expected):
    """Before the bound a billion rows were packed as Python lists in the canonical process until the
    machine ran out of memory (--timeout 5 keeps that short, should the bound ever go)."""
    argv = ["run", "--layout", "tp2", "--synthetic", "tiny", *extra, "--timeout", "5"]
    one_line_error(capsys, [*argv, "--out", str(tmp_path / "run")], *expected)
    assert not (tmp_path / "run").exists()


def test_the_bound_is_the_largest_request_that_fits_and_says_the_estimate():
    from h3lab.run import limits

    host = 8 << 30  # this machine may hold more, or less: the memory is given
    with pytest.raises(ValueError) as err:
        check_request(Problem(rows=100_000, padding=8), host_bytes=host)
    message = str(err.value)
    bound = int(message.rsplit("<= ", 1)[1])
    tiny = H3Config.tiny()
    assert limits.estimate(tiny, "block", "torch", False, blocks=1, rows=bound).host("cpu") <= host
    assert limits.estimate(tiny, "block", "torch", False, blocks=1, rows=bound + 1).host("cpu") > host
    need = limits.estimate(tiny, "block", "torch", False, blocks=1, rows=100_008).host("cpu")
    assert f"rows + padding=100008, blocks=1: the canonical process would need ~{need / 2**30:.3g} GiB" in message
    assert "of host memory (block task, tiny config, backend torch); this machine has 8 GiB" in message
    check_request(Problem(rows=bound - 8, padding=8), host_bytes=host)  # the bound itself fits
    # a training run keeps every step's gradients and weights: its steps are bounded by the same memory
    train = Problem(task="train", block=0, last_block=3, steps=100_000)
    with pytest.raises(ValueError, match=r"steps=100000, blocks=4: .* allowed: steps <= \d+$"):
        check_request(train, host_bytes=host)
    check_request(Problem(task="train", block=0, last_block=3, steps=10_000, digests=True), host_bytes=host)


def test_a_weights_generator_outside_the_allowed_set_is_refused():
    with pytest.raises(ValueError, match=r"unknown weights_generator 'gpu'; allowed: \['device', 'cpu'\]"):
        Problem(task="trajectory", last_block=3, weights_generator="gpu")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rows": True}, r"rows=True; allowed: an int"),
        ({"rows": 2.5}, r"rows=2.5; allowed: an int"),
        ({"repeats": 1001}, r"repeats=1001; allowed: 1..1000"),
        ({"synthetic": "real", "block": 50}, r"block 50: .* allowed: 0..49"),
    ],
)
def test_problem_fields_are_ints_within_their_bounds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_request(Problem(**kwargs))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rows": True}, r"rows=True; allowed: an int >= 1 \(a count, not a bool\)"),
        ({"padding": True}, r"padding=True; allowed: an int >= 0"),
        ({"num_timesteps": True}, r"num_timesteps=True; allowed: an int >= 2"),
        ({"rows": 0}, r"rows=0; allowed: an int >= 1"),
    ],
)
def test_a_bool_is_not_a_row_count(kwargs, match):
    args = {"rows": 24} | kwargs
    with pytest.raises(ValueError, match=match):
        packed_batch(H3Config.tiny(), args.pop("rows"), seed=0, **args)


def test_the_row_packing_is_tensors_linear_in_the_rows():
    """No Python object per row (the lists before held ~100 bytes a row: 20 MB at 200000 rows); torch's
    own allocations are not traced by tracemalloc."""
    import tracemalloc

    from h3lab.batch import MODALITY_AUDIO, MODALITY_TEXT, MODALITY_VIDEO, _pack_layout

    tracemalloc.start()
    try:
        modality, timestep, pos = _pack_layout(200_000, 3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert modality.shape == timestep.shape == (200_000,) and pos.shape == (200_000, 3)
    modality, timestep, pos = _pack_layout(40, 3)  # 5 text rows, frame 0 (24 video, 3 audio), 8 rows of frame 1
    text, video, audio = MODALITY_TEXT, MODALITY_VIDEO, MODALITY_AUDIO
    assert modality.tolist() == [text] * 5 + [video] * 24 + [audio] * 3 + [video] * 8
    assert timestep.tolist() == [0] * 5 + [0] * 24 + [2] * 3 + [1] * 8
    frame0 = [[0, h, w] for h in range(4) for w in range(6)] + [[0, 0, a] for a in range(3)]
    frame1 = [[1, h, w] for h in range(4) for w in range(6)][:8]
    assert pos.tolist() == [[i, 0, 0] for i in range(5)] + frame0 + frame1


def test_the_bound_counts_the_rows_model_inputs_packs():
    from h3lab.model.packing import model_inputs, model_inputs_rows

    tiny = H3Config.tiny()
    for kwargs in ({"num_text": 12}, {"num_text": 7, "num_frames": 3}, {"num_text": 5, "keyframe": False}):
        assert model_inputs_rows(tiny, **kwargs) == model_inputs(tiny, seed=0, **kwargs).num_rows


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--device", "gpu"], ("--device 'gpu'; allowed: cpu, cuda or cuda:<index>",)),
        (["--device", "cuda:99"], ("--device 'cuda:99'; allowed here: cpu",)),
        (["--rows", "1000000000"], ("rows + padding=1000000000", "allowed: rows + padding <=")),
        (["--block", "1000000"], ("block 1000000: a synthetic config has as many blocks", "allowed: 0..49")),
        (
            ["--block", "3", "--free-disk", "1000"],
            ("the synthesized tiny checkpoint of 4 blocks takes", "--checkpoint"),
        ),
    ],
)
def test_an_accuracy_request_that_cannot_run_writes_nothing(capsys, tmp_path, monkeypatch, extra, expected):
    """A bad device was a RuntimeError traceback after the folder and a checkpoint were written; a block
    index a million deep synthesized a million blocks."""
    if "--free-disk" in extra:  # a disk with 1000 bytes free
        import shutil

        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=int(extra[-1])))
        extra = extra[:-2]
    one_line_error(capsys, ["accuracy", *extra, "--out", str(tmp_path / "acc")], *expected)
    assert not (tmp_path / "acc").exists()
