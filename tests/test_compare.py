"""`h3lab compare`: a user's own training script (diffusers' model, a loss of its own, h3lab.optim) under
layouts on real processes (gloo), its records compared byte for byte with one process; a planted
rank-dependent epsilon named as the first differing record; the refusals.

Each launch costs seconds of process start-up on 2 cores (every rank imports torch and diffusers): the
main claim's two layouts share one run, the refusals share another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from h3lab.cli import main
from h3lab.metrics import bitwise_equal
from h3lab.parallel.layout import Layout
from h3lab.parallel.seqshard import SeqShard
from h3lab.run.steps import KINDS
from tests.conftest import leftovers, one_line_error

# The script the tests write. A loss that is not h3lab's objective (an advantage-weighted, clamped MSE of
# the video head plus a cosine term on the audio head), 2 steps of h3lab.optim.AdamW with a clip that
# bites, 91 packed rows out of order (the 4 row shards of tp2xcp2+sp pad them to 92); it records the
# loss, the norm, every gradient and every weight (its shards, under TP) after each step, then every
# weight whole (full_state_dict). Flags plant faults under some layouts only.
SCRIPT = """
import os
import sys

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

import h3lab
import h3lab.optim as optim
from h3lab.config import H3Config, param_dtype
from h3lab.model import model_inputs, shuffle_rows
from h3lab.nn import diffusers_kwargs

CONFIG = H3Config.tiny().replace(
    num_layers=2, attention_head_dim=16, rope_freq_dim=2, hidden_size=36, ffn_dim=72, text_dim=24,
    freq_dim=16, time_embed_hidden_dim=40, time_embed_dim=20, num_refiner_layers=1,
)


def my_loss(video, audio, target_v, target_a, advantage):
    mse = ((video - target_v) ** 2).mean(-1)
    cos = F.cosine_similarity(audio, target_a, dim=-1)
    return (advantage * mse.clamp(max=4.0)).mean() + 0.5 * (1 - cos).clamp(min=0.05).mean()


layout = h3lab.current_layout()
if "--raise" in sys.argv and layout.sp and os.environ["RANK"] == "1":
    raise RuntimeError("planted: rank 1 fails")
torch.manual_seed(0)
model = MiniMaxH3Transformer3DModel(**CONFIG.to_dict())
for name, p in model.named_parameters():
    p.data = p.data.to(param_dtype(name))  # the checkpoint's mixed precision
model = h3lab.parallelize(model, layout)
opt = optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
inputs = shuffle_rows(model_inputs(CONFIG, seed=1, num_text=7), 2)
g = torch.Generator().manual_seed(3)
target_v = torch.randn(inputs.video_rows.shape, generator=g)
target_a = torch.randn(inputs.audio_rows.shape, generator=g)
advantage = torch.randn(inputs.video_rows.shape[0], generator=g)
epsilon = "--epsilon" in sys.argv and layout.name == "tp2"
for k in (1, 2):
    out = model(**diffusers_kwargs(inputs))
    loss = my_loss(out.sample[0], out.audio_sample[0], target_v, target_a, advantage)
    h3lab.record(f"step{k}.loss", loss.detach())
    if epsilon:  # on purpose: a rank-dependent term in the gradient, not in the recorded loss
        loss = loss + 1e-3 * torch.distributed.get_rank() * out.sample.square().mean()
    loss.backward()
    h3lab.record(f"step{k}.grad_norm", optim.clip_grad_norm_(model, 0.05))
    for name, p in model.named_parameters():
        h3lab.record(f"step{k}.dw.{name}", p.grad)
    opt.step()
    opt.zero_grad()
    for name, p in model.named_parameters():
        h3lab.record(f"step{k}.w.{name}", p)
if "--extra" in sys.argv and layout.cp == 2:
    h3lab.record("extra", loss.detach())
for name, t in h3lab.full_state_dict(model).items():
    h3lab.record(f"final.{name}", t)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "my_train.py"
    path.write_text(SCRIPT)
    return path


def _summary(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    assert leftovers(summary["owner"]["token"]) == []  # no process outlives the run
    return summary


def test_a_users_training_under_two_layouts_gives_every_byte_of_one_process(script, tmp_path, capsys):
    """tp2xcp2+sp: every axis (TP, CP, SP) at its smallest, the rows padded; tp8:2x4: TP at its widest
    (a unit per rank) with every row on every rank, two emulated nodes, hierarchical collectives. tp2
    passes under h3lab compare in tests/test_notebooks.py (your_code: the example script), and
    parallelize's tp2 equals tp1 in tests/test_bench_parallelize_step.py."""
    from h3lab.model import model_inputs, shuffle_rows
    from tests.train_ranks import NARROW

    inputs = shuffle_rows(model_inputs(NARROW.replace(num_layers=2), seed=1, num_text=7), 2)  # the script's
    keys = inputs.logical_keys[:, 1]
    assert inputs.num_rows == 91 and not bool((keys[1:] > keys[:-1]).all())
    assert SeqShard(Layout.parse("tp2xcp2+sp"), 91).padded_rows == 92
    out = tmp_path / "run"
    layouts = ["tp2xcp2+sp", "tp8:2x4"]
    assert main(["compare", "--layout", *layouts, "--out", str(out), "--", "python", str(script)]) == 0
    printed = capsys.readouterr().out
    assert "tp8:2x4: passed: 264 records bit-identical" in printed and "overall: passed" in printed
    summary = _summary(out)
    assert summary["status"] == "passed" and list(summary["layouts"]) == layouts
    canon = load_file(str(out / "canonical.safetensors"))
    names = [n for n, _ in summary["canonical"]["order"]]
    assert names[:3] == ["step1.loss", "step1.grad_norm", "step1.dw.proj_in.weight"] and len(names) == 264
    assert float(canon["step1.grad_norm"]) > 0.05 and float(canon["step2.grad_norm"]) > 0.05  # the clip bit
    assert not bitwise_equal(canon["step1.w.proj_in.weight"], canon["step2.w.proj_in.weight"])  # it trained
    for name, rec in summary["layouts"].items():
        assert rec["status"] == "passed" and rec["replicas_consistent"] and rec["first_divergence"] is None
        assert list(rec["tensors"]) == names and all(t["bitwise_equal"] for t in rec["tensors"].values())
        assert list(rec["steps"]) == ["1", "2"] and all(
            list(v) == ["bitwise_equal", *KINDS] for v in rec["steps"].values()
        )
        full = load_file(str(out / "layouts" / f"{name.replace(':', '_').replace('+', '_')}.safetensors"))
        assert all(bitwise_equal(full[k], canon[k]) for k in names)  # re-checked from the files
    tp8 = json.loads((out / "layouts" / "tp8_2x4" / "rank5.records.json").read_text())
    shards = {e["name"] for e in tp8 if e["space"] == "shard"}  # rank 5 held units 5 of the sharded weights
    assert "step2.w.transformer_blocks.1.ff.net.0.proj.weight" in shards and "step1.loss" not in shards
    held = load_file(str(out / "layouts" / "tp8_2x4" / "rank5.records.safetensors"))
    config = NARROW.replace(num_layers=2)  # each rank keeps 1/8 of a unit-sharded weight, the rest whole
    assert held["step2.w.transformer_blocks.1.attn.to_q.weight"].shape == (config.inner_dim // 8, config.hidden_size)
    assert held["step2.w.transformer_blocks.1.ff.net.0.proj.weight"].shape == (2 * config.ffn_dim // 8, 36)
    assert held["step2.w.transformer_blocks.1.norm1.weight"].shape == (config.hidden_size,)
    assert (out / "heatmap.png").stat().st_size > 10_000


def test_a_rank_dependent_epsilon_is_named_and_a_bad_layout_fails_naming_why(script, tmp_path, capsys):
    """tp2: the gradient gets a rank-dependent term (the loss it records does not): a mismatch whose first
    differing record, in the script's order, is step 1's norm. cp2: a name recorded there only. tp2+sp:
    rank 1 raises: the layout fails naming the rank and its log."""
    out = tmp_path / "run"
    argv = ["compare", "--layout", "tp2", "cp2", "tp2+sp", "--out", str(out), "--"]
    assert main([*argv, "python", str(script), "--epsilon", "--extra", "--raise"]) == 1
    printed = capsys.readouterr().out
    summary = _summary(out)
    assert summary["status"] == "failed"
    tp2 = summary["layouts"]["tp2"]
    assert tp2["status"] == "mismatch" and not tp2["replicas_consistent"]
    canon, full = load_file(str(out / "canonical.safetensors")), load_file(str(out / "layouts" / "tp2.safetensors"))
    names = [n for n, _ in summary["canonical"]["order"]]
    first = next(n for n in names if not bitwise_equal(full[n], canon[n]))
    assert first == tp2["first_divergence"]["name"] == "step1.grad_norm"
    assert tp2["tensors"]["step1.loss"]["bitwise_equal"]
    assert tp2["first_divergence"]["index"] == 1 and tp2["first_divergence"]["max_ulp"] > 0
    assert "tp2: MISMATCH in" in printed and "the first: step1.grad_norm" in printed
    cp2 = summary["layouts"]["cp2"]
    assert cp2["status"] == "failed" and cp2["failure"]["reason"] == (
        "records ['extra'] under cp2 only; allowed: the same names under every layout"
    )
    sp = summary["layouts"]["tp2+sp"]["failure"]
    assert sp["rank"] == 1 and "RuntimeError: planted: rank 1 fails" in sp["reason"]
    assert sp["log"].endswith("tp2_sp/rank1.log")


def test_a_script_that_records_nothing_fails_the_run_saying_so(tmp_path, capsys):
    script = tmp_path / "quiet.py"
    script.write_text("import h3lab\nprint('training, recording nothing:', h3lab.current_layout())\n")
    out = tmp_path / "run"
    assert main(["compare", "--layout", "tp2", "--out", str(out), "--", "python", str(script)]) == 1
    summary = _summary(out)
    assert summary["status"] == "failed" and summary["layouts"] == {}
    assert summary["error"] == "the script recorded nothing; allowed: a script that calls h3lab.record(name, tensor)"
    assert "training, recording nothing: tp1" in (out / "canonical" / "rank0.log").read_text()
    assert "tp1 (the reference): FAILED: the script recorded nothing" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["ls", "-l"], "command 'ls -l'; allowed: python SCRIPT [ARGS], or python -m MODULE [ARGS] after --"),
        ([], "command '(none)'; allowed: python SCRIPT"),
        (["python", "missing.py"], "script 'missing.py' is not a file; allowed: python SCRIPT"),
        (["python", "-c", "print(1)"], "command \"python -c 'print(1)'\"; allowed: python SCRIPT"),
    ],
)
def test_a_bad_command_is_one_line_and_writes_nothing(capsys, tmp_path, command, expected):
    one_line_error(capsys, ["compare", "--layout", "tp2", "--out", str(tmp_path / "run"), "--", *command], expected)
    assert not (tmp_path / "run").exists()
