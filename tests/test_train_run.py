"""`h3lab run --train-steps N`: training steps under layouts on real processes (gloo), compared after each
step with the single process byte for byte (loss, every gradient, every updated weight); a bit planted in
one gradient, named by the first-divergence finder; the names the comparison reads; the workbench's
per-step table; bad values.

Each layout run costs seconds of process start-up and comparison on 2 cores: the main claim's two layouts
share one runner call, untraced; the finder's test is one traced layout of 4 processes."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from h3lab.config import model_param_shapes
from h3lab.metrics import bitwise_equal
from h3lab.parallel.layout import Layout, parse_layouts
from h3lab.parallel.seqshard import SeqShard
from h3lab.run.problem import Problem
from h3lab.run.runner import RunRequest, run, slug
from h3lab.run.steps import KINDS, step_kind, step_verdicts
from h3lab.run.tasks import assemble_units, expected_shard
from h3lab.run.trace import load_trace, timeline
from h3lab.run.workers import faults
from h3lab.triton.configs import interpreting
from h3lab.units import REPLICATED, UNIT_GRAD_FIELDS, unit_slice, unit_weights
from h3lab.weights import synthetic_block
from h3lab.workbench.tables import train_step_table
from tests.conftest import RUN, one_line_error

# Every axis at its smallest (tp2xcp2+sp: TP, CP and SP, 4 row shards), and TP at its widest with every
# row on every rank, two emulated nodes and hierarchical collectives (tp8:2x4, one agent of 8)
LAYOUTS = "tp2xcp2+sp tp8:2x4"
# 4 blocks, 2 steps; 7 text rows pack 91 rows, which the 4 row shards of tp2xcp2+sp pad to 92; the rows
# out of key order; lr and weight decay other than the defaults, and a global norm above the clip's 1
TRAIN = Problem(
    task="train", block=0, last_block=3, steps=2, text_rows=7, row_order="shuffled", seed=23, lr=3e-4, weight_decay=0.05
)


def _names(problem: Problem, step: int) -> set[str]:
    """Every tensor a training step reports, under its canonical (assembled) name."""
    names = {f"step{step}.{s}" for s in ("loss", "loss.video", "loss.audio", "grad_norm", "clip_coef")}
    for name in model_param_shapes(problem.config()):
        if name.startswith("transformer_blocks."):
            i, param = name.removeprefix("transformer_blocks.").split(".", 1)
            names |= {f"step{step}.block{i}.{kind}.{param}" for kind in ("dw", "w")}
        else:
            names |= {f"step{step}.{kind}.{name}" for kind in ("dw", "w")}
    return names


def test_two_training_steps_are_bitwise_under_layouts_with_padding_and_rows_out_of_key_order(tmp_path):
    inputs = TRAIN.model_inputs()
    keys = inputs.logical_keys[:, 1]
    assert inputs.num_rows == 91 and not bool((keys[1:] > keys[:-1]).all())
    assert SeqShard(Layout.parse("tp2xcp2+sp"), 91).padded_rows == 92
    out = tmp_path / "run"
    summary = run(RunRequest(layouts=tuple(parse_layouts(LAYOUTS)), problem=TRAIN, out=out, timeout_s=600))
    assert summary["status"] == "passed", {k: v.get("failure") for k, v in summary["layouts"].items()}
    canon = load_file(str(out / "canonical.safetensors"))
    assert set(canon) == _names(TRAIN, 1) | _names(TRAIN, 2)  # every parameter's gradient and weight, per step
    assert not bitwise_equal(canon["step1.block3.w.attn.to_q.weight"], canon["step2.block3.w.attn.to_q.weight"])
    values = summary["canonical"]["steps"]
    assert list(values) == ["1", "2"] and all(v["clip_coef"] < 1 for v in values.values())  # the clip ran
    for layout in parse_layouts(LAYOUTS):
        rec = summary["layouts"][layout.name]
        assert rec["ranks_all_equal"] and rec["replicas_consistent"] and rec["tensors"].keys() == canon.keys()
        assert all(t["bitwise_equal"] for t in rec["tensors"].values())
        full = load_file(str(out / "layouts" / f"{slug(layout)}.safetensors"))
        assert all(bitwise_equal(full[k], canon[k]) for k in canon)  # re-checked from the files
        for k in ("1", "2"):
            assert rec["steps"][k]["bitwise_equal"] and list(rec["steps"][k]) == ["bitwise_equal", *KINDS]
        assert all(r["timings"]["update_s"] > 0 and r["timings"]["backward_s"] > 0 for r in rec["ranks"])
    table = train_step_table(summary)  # the workbench's per-step view of the same summary
    assert list(table["step"]) == [1, 2] * 2 and set(table["verdict"]) == {"passed"}
    padded = [r["local_rows"] for r in summary["layouts"]["tp2xcp2+sp"]["ranks"]]
    assert padded[-1] == [69, 92]  # the last rank holds rows 69-90 and 1 padding row


def test_a_bit_flipped_in_one_gradient_of_step_1_on_one_rank_is_named_by_op_and_step(tmp_path, monkeypatch):
    """Under tp2xcp2 (91 rows out of key order, padded to 92), rank 1 (CP group 0, units 4-7) flips one bit
    of block 1's ff.net.2 weight gradient in step 1, and its optimizer goes on with it; rank 3 holds the
    same units clean. A digests run: the digests name that unit's gradient as the only one of step 1 that
    differs and the replicas as inconsistent; the finder names the op and the step, and every op traced
    before it (step 1's forward and backward in every trace space, the gradients before it) is equal."""
    config = Problem().config()
    per_unit = config.hidden_size * (config.ffn_dim // 8)  # ff.net.2's unit slice: [D, F/8]
    index = per_unit + 1000  # the rank's second unit (unit 5), element 1000
    op = "step1.block1.dw.ff.net.2.weight"
    monkeypatch.setenv("H3LAB_FAULT", f"flip:1:{op}:{index}")
    p = Problem(task="train", block=0, last_block=1, text_rows=7, row_order="shuffled", seed=24, digests=True)
    layouts = tuple(parse_layouts("tp2xcp2"))
    assert SeqShard(layouts[0], p.model_inputs().num_rows).padded_rows == 92
    rec = run(RunRequest(layouts=layouts, problem=p, out=tmp_path / "run", timeout_s=600, trace=True))["layouts"]
    rec = rec["tp2xcp2"]
    assert rec["status"] == "mismatch" and not rec["ranks_all_equal"] and not rec["replicas_consistent"]
    differ = [k for k, v in rec["tensors"].items() if step_kind(k) == (1, "gradients") and not v["bitwise_equal"]]
    assert differ == ["step1.block1.dw.ff.net.2.weight@u5"]
    assert rec["steps"]["1"]["loss"]["bitwise_equal"] and not rec["steps"]["1"]["gradients"]["bitwise_equal"]
    hit = rec["first_divergence"]
    assert (hit["name"], hit["step"], hit["block"], hit["op"]) == (op, 1, 1, "dw.ff.net.2.weight")
    assert hit["num_differing"] == 1 and hit["max_ulp"] == 1  # the lowest mantissa bit of one element
    F8 = config.ffn_dim // 8
    assert hit["first_diff_index"] == [5, 1000 // F8, 1000 % F8]  # the units stacked: [8, D, F/8]
    canon, order = load_trace(tmp_path / "run" / "canonical.trace")
    rows = timeline(canon, order, load_trace(tmp_path / "run" / "layouts" / "tp2xcp2.trace")[0])
    assert all(r["bitwise_equal"] for r in rows[: hit["index"]]) and rows[hit["index"]]["name"] == op
    assert {r["space"] for r in rows[: hit["index"]]} == {"local", "tp_units", "units", "replicated"}
    names = [name for name, _ in order]  # the steps in order: the model's ops, then every gradient
    first2 = names.index("step2.embed.temb")
    assert names[0] == "step1.embed.temb" and all(n.startswith("step1.") for n in names[:first2])
    assert names[first2 - 1] == "step1.dw.audio_proj_out.bias" and names[-1] == "step2.dw.audio_proj_out.bias"


def test_unit_names_of_steps_and_weights_assemble_and_slice_without_taking_non_block_names(tiny):
    """`step{k}.block{i}.{dw,w}.<grad>@u{u}` assemble to `step{k}.block{i}.{dw,w}.<param>`; non-block names
    (`step{k}.dw.token_refiner...`, which holds a block's parameter names too) stay as they are."""
    block = synthetic_block(tiny, 0, seed=3)
    uw = unit_weights(block)
    g = torch.Generator().manual_seed(4)
    non_block = {
        "step2.dw.token_refiner.refiner_blocks.0.norm1.weight": torch.randn(8, generator=g),
        "step2.w.proj_in.bias": torch.randn(4, generator=g),
    }
    parts = dict(non_block)
    for kind in ("dw", "w"):
        parts |= {f"step2.block5.{kind}.{g}@u{u}": unit_slice(uw, g, u) for g in UNIT_GRAD_FIELDS for u in range(8)}
        parts |= {f"step2.block5.{kind}.{r}": block[r] for r in REPLICATED}
    full = assemble_units(parts, tiny, units=range(8))
    for kind in ("dw", "w"):
        for param in ("attn.to_out.0.weight", "ff.net.0.proj.weight", "adaln_proj.linear.bias", "norm1.weight"):
            assert bitwise_equal(full[f"step2.block5.{kind}.{param}"], block[param]), (kind, param)
        got = expected_shard(f"step2.block5.{kind}.ff.gate@u6", full, tiny, slice(0))
        assert bitwise_equal(got, unit_slice(uw, "ff.gate", 6))
    for name, t in non_block.items():
        assert full[name] is t and expected_shard(name, full, tiny, slice(0)) is t
    assembled = {"attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight", "attn.to_out.0.weight"}
    assembled |= {"ff.net.0.proj.weight", "ff.net.2.weight", "adaln_proj.linear.weight", "adaln_proj.linear.bias"}
    block_names = {f"step2.block5.{kind}.{p}" for kind in ("dw", "w") for p in assembled | set(REPLICATED)}
    assert set(full) == block_names | set(non_block)
    assert step_kind("step2.block5.w.ff.gate@u6") == (2, "weights")
    assert step_kind("step12.dw.token_refiner.refiner_blocks.0.norm1.weight") == (12, "gradients")
    assert step_kind("step1.grad_norm") == (1, "clip") and step_kind("step1.loss.audio") == (1, "loss")
    assert step_kind("step1.video") is None and step_kind("dw.proj_in.weight") is None


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--train-steps", "0"], ("--train-steps 0", "allowed: a number of training steps >= 1")),
        (["--train-steps", "2", "--trajectory", "2"], ("--trajectory and --train-steps", "allowed: one of them")),
        (["--lr", "1e-4"], ("--lr without --train-steps", "allowed: training options with --train-steps N")),
        (["--row-order", "shuffled"], ("--row-order without --train-steps", "allowed")),
        (["--text-rows", "7"], ("--text-rows 7 without --trajectory or --train-steps", "allowed: one of them")),
        (["--train-steps", "1", "--text-rows", "0"], ("text_rows=0 must be >= 1",)),
        (["--train-steps", "1", "--lr", "-1"], ("lr -1.0 not allowed", "allowed: a finite number >= 0")),
        (["--train-steps", "1", "--lr", "inf"], ("lr inf not allowed", "allowed: a finite number >= 0")),
        (["--train-steps", "1", "--betas", "1", "0.9"], ("betas[0] 1.0 not allowed", "allowed: a number in [0, 1)")),
        (["--train-steps", "1", "--eps", "0"], ("eps 0.0 not allowed", "allowed: a finite number > 0")),
        (["--train-steps", "1", "--weight-decay", "nan"], ("weight_decay nan not allowed", "allowed")),
        (["--train-steps", "1", "--max-grad-norm", "0"], ("max_grad_norm 0.0 not allowed", "allowed: a number in")),
        (["--train-steps", "1", "--blocks", "3-1"], ("blocks 3-1", "allowed: A-B with A <= B")),
        (["--train-steps", "1", "--rows", "64"], ("--rows with --trajectory or --train-steps", "allowed: --text-rows")),
        (["--trajectory", "1", "--padding", "2"], ("--padding with --trajectory", "allowed: --text-rows")),
    ],
)
def test_a_bad_training_value_is_one_line_and_writes_nothing(capsys, tmp_path, extra, expected):
    run = [a for a in RUN if a not in ("--rows", "8")]  # a request packed from its streams has no --rows
    one_line_error(capsys, [*run, *extra, "--out", str(tmp_path / "run")], *expected)
    assert not (tmp_path / "run").exists()


def test_a_shuffled_request_is_for_training_only():
    with pytest.raises(
        ValueError, match=r"row_order 'shuffled' is for task 'train'; allowed for 'chain': \['packed'\]"
    ):
        Problem(task="chain", block=0, last_block=1, row_order="shuffled")
    with pytest.raises(ValueError, match=r"unknown row_order 'sorted'; allowed: \['packed', 'shuffled'\]"):
        Problem(task="train", row_order="sorted")
    assert Problem.from_dict(json.loads(json.dumps(TRAIN.to_dict()))) == TRAIN  # betas: a JSON list, then a tuple


def test_a_flip_fault_names_its_rank_op_and_index(monkeypatch):
    monkeypatch.setenv("H3LAB_FAULT", "flip:1:step1.block1.dw.ff.gate:17")
    assert faults.planted_flip("1") == ("step1.block1.dw.ff.gate", 17) and faults.planted_flip("0") is None
    assert faults.inject("1") is None  # the trace plants it, not inject
    for bad in ("flip:1:op", "flip:1::3", "flip:1:op:-3", "flip:1:op:3:4", "flip:one:op:3"):
        monkeypatch.setenv("H3LAB_FAULT", bad)
        with pytest.raises(ValueError, match=r"allowed: flip:<rank>:<traced op>:<flat index>"):
            faults.planted_flip("1")
    monkeypatch.setenv("H3LAB_FAULT", "raise:1")
    assert faults.planted_flip("1") is None


def test_the_workbench_table_shows_each_steps_verdict_per_kind():
    """A mismatch in one gradient of step 1 (and everything of step 2 after it), and a layout that failed."""
    verdicts = {f"step{k}.{n}": {"bitwise_equal": True} for k in (1, 2) for n in ("loss", "grad_norm", "w.x", "dw.x")}
    verdicts |= {"step1.block0.dw.ff.gate@u3": {"bitwise_equal": False}, "step2.w.x": {"bitwise_equal": False}}
    summary = {
        "layouts": {
            "tp2": {"status": "mismatch", "steps": step_verdicts(verdicts)},
            "tp8": {"status": "failed", "failure": {"rank": 3}},
        }
    }
    table = train_step_table(summary)
    assert list(table.columns) == ["layout", "step", "verdict", "loss", "clip", "gradients", "weights"]
    rows = table.to_dict("records")
    assert rows[0] == {
        "layout": "tp2",
        "step": 1,
        "verdict": "mismatch",
        "loss": "passed 1/1",
        "clip": "passed 1/1",
        "gradients": "mismatch: 1 of 2 differ",
        "weights": "passed 1/1",
    }
    assert (rows[1]["step"], rows[1]["verdict"], rows[1]["weights"]) == (2, "mismatch", "mismatch: 1 of 1 differ")
    assert rows[2]["layout"] == "tp8" and rows[2]["verdict"] == "failed" and pd.isna(rows[2]["step"])


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or interpreting(),
    reason="needs a CUDA device and compiled kernels (TRITON_INTERPRET unset): pytest -m gpu tests/test_train_run.py",
)
def test_gpu_the_training_command_with_triton_and_digests_at_tiny_shapes(tmp_path):
    """The H200 command (`h3lab run --synthetic real --blocks 0-3 --train-steps 2 --device cuda --backend
    triton --layout tp1 tp2 --digests`) at the tiny config with rows out of key order: every step's loss,
    gradient digests and weight digests equal the canonical process's."""
    p = Problem(
        task="train", block=0, last_block=1, device="cuda", backend="triton", digests=True, row_order="shuffled"
    )
    summary = run(RunRequest(layouts=tuple(parse_layouts("tp1 tp2")), problem=p, out=tmp_path / "run", timeout_s=600))
    assert summary["status"] == "passed", {k: v.get("failure") for k, v in summary["layouts"].items()}
    for rec in summary["layouts"].values():
        assert [k for k, v in rec["steps"].items() if v["bitwise_equal"]] == ["1", "2"]
        assert any(name.startswith("step2.block1.w.") for name in rec["tensors"])  # weights compared by digest
