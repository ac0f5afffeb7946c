"""The training-step benchmark (h3lab.bench.train_step) end to end on the CPU: tiny config, one block,
62 packed rows (the fewest), 1 warm-up and 2 timed steps per side; the requests it builds, the eager
baseline's FP32 masters, its bad arguments and the status of a run that stops short. The `gpu` test
runs the same on CUDA with the Triton backend: pytest -m gpu tests/test_bench_train_step.py

The two losses of one step (same weights, same sample) agree to LOSS_RTOL. Both models are bf16 with
FP32 heads and compute the same math in different reduction orders (BLAS, SDPA and autograd against
fixed-order chains): each side's output is ~4e-3 (relative L2) from FP64 (README's accuracy table),
and the relative gap of two mean squared errors is at most ~2 |d output| / |output - target| ~ 1e-2
if every rounding pushed the same way. Measured on the first step: tiny, block 0, 62 rows, seeds
0-5 (this test's seed 0 the largest): <= 1.2e-3; blocks 0, 0-1 and 2 at 72 and 96 rows, 3 seeds
each: <= 6.3e-4. 5e-3 leaves 4x headroom and stays under the bound. A missing modality halves the
loss; another step's sample moves it by ~10% (6.1-8.3 over those seeds at 62 rows).
"""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch

from h3lab.bench import train_step
from h3lab.config import H3Config
from h3lab.model import SyntheticWeights, model_inputs
from h3lab.model.packing import request_of_rows
from h3lab.reference.eager_train import EagerTrainer, depth_state
from h3lab.train.objective import FlowObjective
from tests.conftest import assert_bitwise

LOSS_RTOL = 5e-3
TINY = H3Config.tiny()
RUN = ["--config", "tiny", "--blocks", "0", "--rows", "62", "--steps", "2", "--warmup", "1"]
STEP_FIELDS = {"step", "seconds", "phases", "loss", "loss_video", "loss_audio", "grad_norm", "warmup"}
SPREAD = {"median_s", "min_s", "max_s", "q1_s", "q3_s"}
TOP = {"format", "what", "command", "args", "config", "hyper", "objective", "seeds", "clock", "order", "env"}
TOP |= {"load_average_before", "load_average_after", "status", "rows", "canonical", "eager", "ratio_median", "losses"}


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("train-step") / "record.json"
    assert train_step.main([*RUN, "--device", "cpu", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _check_side(side: dict, phases: set[str]) -> None:
    assert [s["step"] for s in side["steps"]] == [1, 2, 3]
    assert [s["warmup"] for s in side["steps"]] == [True, False, False]
    for s in side["steps"]:
        assert set(s) == STEP_FIELDS and set(s["phases"]) == phases, s
        assert s["seconds"] > 0 and all(v >= 0 for k, v in s["phases"].items() if k != "other")
    timed = [s["seconds"] for s in side["steps"][1:]]
    assert set(side["timed"]) == SPREAD and side["timed"]["min_s"] == min(timed)
    assert side["timed"]["min_s"] <= side["timed"]["q1_s"] <= side["timed"]["median_s"] <= side["timed"]["max_s"]
    assert set(side["phases_median_s"]) == phases and side["build_s"] > 0
    assert side["memory"] == {"note": "CUDA only"}  # peak memory is a CUDA figure


def test_the_record_has_every_field(record):
    assert set(record) == TOP
    assert record["format"] == train_step.BENCH_FORMAT and record["status"] == "complete"
    assert record["order"] == ["canonical", "eager"] and record["config"]["hidden_size"] == TINY.hidden_size
    assert record["objective"]["weights"] == {"video": 1.0, "audio": 1.0} and record["seeds"]["weights"] == 0
    assert record["rows"] == 62 and record["args"]["blocks"] == [0] and record["args"]["backend"] == "torch"
    assert record["hyper"]["lr"] == 1e-5 and record["clock"] == "wall clock"
    assert record["env"]["node_type"] == "CPU" and "commit" in record["env"]["git"]
    assert record["command"].endswith("--device cpu --out " + record["args"]["out"])
    _check_side(record["canonical"], {"forward", "backward", "clip", "update", "other"})
    _check_side(record["eager"], {"sample", "forward", "backward", "clip", "update"})
    ratio = record["canonical"]["timed"]["median_s"] / record["eager"]["timed"]["median_s"]
    assert record["ratio_median"] == ratio
    assert len(record["load_average_before"]) == len(record["load_average_after"]) == 3


def test_both_losses_are_finite_and_agree_at_the_first_step(record):
    losses = record["losses"]
    assert [x["step"] for x in losses] == [1, 2, 3]
    for x in losses:
        assert math.isfinite(x["canonical"]) and math.isfinite(x["eager"]), x
    first = losses[0]
    assert first["rel_gap"] == abs(first["canonical"] - first["eager"]) / abs(first["canonical"])
    assert first["rel_gap"] <= LOSS_RTOL, first
    for side in ("canonical", "eager"):  # weights 1 each: the total is their float32 sum, one rounding (6e-8)
        s = record[side]["steps"][0]
        assert math.isclose(s["loss"], s["loss_video"] + s["loss_audio"], rel_tol=1e-6), s


def test_the_canonical_first_step_is_repeatable(record):
    repeat = record["canonical"]["repeat"]
    assert repeat["step"] == 1 and len(repeat["digest"]) == 64
    assert repeat["digest_fresh_trainer"] == repeat["digest"] == repeat["digest_other_recompute"]
    assert repeat["bitwise"] is True


@pytest.mark.parametrize("rows", [62, 63, 95, 200])
def test_a_request_has_exactly_the_rows_asked_for(rows):
    r = request_of_rows(TINY, rows, seed=3)
    assert r.num_rows == rows and r.text_rows.shape[0] == 12 + rows % 2
    assert r.num_condition_video_rows == 24 and r.audio_rows.shape[0] >= 2


def test_the_request_of_96_rows_is_model_inputs_own():
    default, ours = model_inputs(TINY, seed=3), request_of_rows(TINY, 96, seed=3)
    assert ours.num_condition_video_rows == default.num_condition_video_rows
    for k, t in default.tensors().items():
        assert_bitwise(ours.tensors()[k], t, k)


def test_the_eager_baseline_keeps_fp32_masters_of_its_bf16_parameters():
    weights = SyntheticWeights(TINY, seed=4)
    state = depth_state(weights, [2])  # block 2 of the model is block 0 of the depth
    assert_bitwise(state["transformer_blocks.0.attn.to_q.weight"], weights.block(2)["attn.to_q.weight"])
    objective = FlowObjective()
    trainer = EagerTrainer(
        TINY.replace(num_layers=1),
        state,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        max_grad_norm=1.0,
        loss_weights=objective.weights,
    )
    assert trainer.optimizer.defaults["foreach"] is True  # CPU; fused on CUDA
    sample = objective.sample(request_of_rows(TINY, 62, seed=5), 6)
    before = {k: t.clone() for k, t in trainer.named_parameters().items()}
    trainer.step(sample.inputs, sample.target)
    after = trainer.named_parameters()
    assert {k: t.dtype for k, t in after.items()} == {k: t.dtype for k, t in state.items()}  # the checkpoint's
    assert not torch.equal(
        after["transformer_blocks.0.ff.net.2.weight"], before["transformer_blocks.0.ff.net.2.weight"]
    )
    masters = {id(p) for p in trainer.masters}
    for name, p in trainer.model.named_parameters():
        if p.dtype == torch.float32:
            assert id(p) in masters, name  # a float32 parameter is its own master
    assert len(trainer.low) == sum(t.dtype == torch.bfloat16 for t in state.values())
    for p, master in trainer.low:  # each bf16 parameter is its FP32 master rounded once
        assert master.dtype == torch.float32 and id(master) in masters
        assert_bitwise(p.detach(), master.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--blocks", "2-1"], "blocks [2, 1]; allowed: a non-empty contiguous ascending range A..B within 0..3"),
        (["--blocks", "0-4"], "within 0..3"),
        (["--blocks", "a"], "--blocks 'a'; allowed: A-B or A"),
        (["--rows", "61"], "--rows 61; allowed: >= 62"),
        (["--steps", "0"], "--steps 0; allowed: >= 1"),
        (["--warmup", "0"], "--warmup 0; allowed: >= 1"),
        (["--lr", "nan"], "--lr: lr nan not allowed; allowed: a finite number >= 0"),
        (["--lr", "-1"], "--lr: lr -1.0 not allowed"),
        (["--seed", "-1"], "--seed -1; allowed: 0 <= seed < 2**63"),
        (["--device", "cpu", "--backend", "triton"], "--backend triton runs on --device cuda only"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--config", "huge"], "argument --config: invalid choice: 'huge'"),
    ],
)
def test_a_bad_argument_is_one_line_and_writes_nothing(capsys, tmp_path, extra, expected):
    out = tmp_path / "record.json"
    argv = [*RUN, "--device", "cpu", *extra, "--out", str(out)]
    assert train_step.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"{train_step.PROG}: error: ") and expected in err, err
    assert not out.exists()


def test_an_existing_record_is_never_overwritten(capsys, tmp_path):
    out = tmp_path / "record.json"
    out.write_text("mine")
    assert train_step.main([*RUN, "--device", "cpu", "--out", str(out)]) == 2
    assert f"--out {out} exists; allowed: a new file" in capsys.readouterr().err
    assert out.read_text() == "mine"


def _planted_error(*args):
    raise RuntimeError("planted")


def _planted_sigterm(*args):
    os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize(
    ("plant", "raised", "status", "error"),
    [
        (_planted_error, RuntimeError, "failed", "RuntimeError: planted"),
        (_planted_sigterm, KeyboardInterrupt, "interrupted", "Terminated: SIGTERM"),
    ],
)
def test_a_run_that_stops_short_ends_failed_or_interrupted(monkeypatch, tmp_path, plant, raised, status, error):
    monkeypatch.setattr(train_step, "canonical_side", plant)
    out = tmp_path / "record.json"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(raised):
        train_step.main([*RUN, "--device", "cpu", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["status"] == status and r["error"] == error and r["format"] == train_step.BENCH_FORMAT
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are restored


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_gpu_triton_step_against_eager_records_memory_and_repeats(tmp_path):
    out = tmp_path / "record.json"
    assert train_step.main([*RUN, "--device", "cuda", "--backend", "triton", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["clock"].startswith("CUDA events") and r["canonical"]["repeat"]["bitwise"] is True
    for side in ("canonical", "eager"):
        m = r[side]["memory"]
        assert 0 < m["before_timed_gib"] <= m["peak_gib"] and m["peak_extra_gib"] >= 0, (side, m)
    assert r["losses"][0]["rel_gap"] <= LOSS_RTOL, r["losses"][0]
