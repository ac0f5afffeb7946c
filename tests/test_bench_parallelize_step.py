"""`python -m h3lab.bench.parallelize_step` at the tiny config on the CPU (gloo): the record the H200 run
writes, its bitwise verdicts (tp2 against tp1 on a custom loss; the parallelized model on h3lab's
objective against Trainer), the report's table, bad arguments, and the host synchronisations of one
step: the parallelized model's make none where Trainer's make none, and none more often but for one
finiteness read-back per model call (counted calls, under our control, unlike a clock). No speed is
asserted (a benchmark's figures are its record's)."""

from __future__ import annotations

import json

import pytest

from h3lab.bench.host_syncs import host_syncs
from h3lab.bench.parallelize_sides import context, flow_step, trainer_step
from h3lab.bench.parallelize_step import BENCH_FORMAT, main
from h3lab.workbench.benchmarks import table
from tests.conftest import REQUEST_CHECKS

SIDES = ["parallelize_flow", "trainer", "eager", "parallelize_custom"]
# The two sites where a flow step syncs more than Trainer's. The finiteness checks' read-back
# (h3lab.finite.deferred_checks), once per model call: Trainer's step is one call (model_grads: forward
# and backward in one scope); through parallelize it is two, the user's loss between them, and the
# forward's refusal must come before its output reaches the user's code. The clip's refusal of a
# non-finite norm: h3lab.optim.clip_grad_norm_ raises when called (the user's code goes on from it),
# where Trainer's AdamW.step reads the norm's finiteness after its updates, with their flags.
FINITE = "h3lab/finite.py:_first_refusal"
ONE_READ_BACK_PER_CALL = {"parallelize_flow": 2, "trainer": 1}
CLIP = "h3lab/train/adamw.py:clipped_norm"
BEYOND_TRAINER = {FINITE: ONE_READ_BACK_PER_CALL, CLIP: {"parallelize_flow": 1, "trainer": 0}}


def test_the_record_holds_bitwise_verdicts_and_every_sides_timed_steps(tmp_path, capsys):
    out = tmp_path / "p.json"
    argv = ["--out", str(out), "--config", "tiny", "--layers", "1", "--rows", "96", "--steps", "1", "--device", "cpu"]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["status"] == "complete" and r["format"] == BENCH_FORMAT and r["config"]["num_layers"] == 1
    assert r["bitwise"] == {"tp2 = tp1 (parallelize_custom, every rank)": True, "parallelize_flow = trainer": True}
    (one,) = r["layouts"]["tp1"]
    assert list(one["sides"]) == SIDES and one["transport"] is None
    for side in one["sides"].values():
        assert side["timed"]["median_s"] > 0 and sum(not s["warmup"] for s in side["steps"]) == 1  # --steps 1
    flow, custom = one["sides"]["parallelize_flow"], one["sides"]["parallelize_custom"]
    assert len(flow["losses"]) == 2 and flow["weights"] and flow["losses"] != custom["losses"]  # two losses
    assert [x["transport"] for x in r["layouts"]["tp2"]] == ["gloo", "gloo"]
    assert set(r["ratios"]) == {
        f"{a} / {b}"
        for a, b in [
            ("parallelize_flow", "trainer"),
            ("parallelize_custom", "trainer"),
            ("parallelize_flow", "eager"),
            ("trainer", "eager"),
        ]
    }
    t = table("parallelize_step", r)
    assert (
        len(t) == 6
        and t.loc[("tp1", 0, "parallelize_flow"), "bitwise"]
        and t.loc[("tp2", 1, "parallelize_custom"), "bitwise"]
    )
    assert r["host_syncs"]["parallelize_flow beyond trainer"] == BEYOND_TRAINER
    assert r["host_syncs"]["total"]["trainer"] > 0
    calls = {"sample", "forward", "loss", "backward", "clip", "update", "model_forward", "model_backward"}
    assert set(r["phases_median_s"]["parallelize_flow"]) == calls
    assert set(r["phases_median_s"]["trainer"]) == {"model_forward", "model_backward", "clip", "update"}
    assert "parallelize_flow / trainer" in capsys.readouterr().out


def test_a_flow_step_syncs_the_host_only_where_a_trainer_step_does():
    """Step 3 of each (the optimizer's state made at step 1): every site of the parallelized model's host
    syncs is one of Trainer's, at most as often, but for the finiteness read-back and the clip's refusal
    (BEYOND_TRAINER). A second check of the request inside the forward, or a row name copied from the
    host, adds sites or counts."""
    spec = {"layout": "tp1", "device": "cpu", "config": "tiny", "layers": "1", "rows": "96", "seed": "0"}
    ctx = context(spec | {"backend": "torch", "steps": "1"})
    counts = {}
    for name, make in (("flow", flow_step), ("trainer", trainer_step)):
        step, _ = make(ctx)
        step(1, lambda phase: None), step(2, lambda phase: None)
        counts[name] = host_syncs(lambda: step(3, lambda phase: None), ctx.device)["sites"]  # noqa: B023
    flow, trainer = counts["flow"], counts["trainer"]
    assert trainer.keys() >= REQUEST_CHECKS  # the counter sees the request's checks
    beyond = {s: (n, trainer.get(s, 0)) for s, n in flow.items() if n > trainer.get(s, 0)}
    assert beyond == {site: tuple(n.values()) for site, n in BEYOND_TRAINER.items()}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--layers", "9"], "--layers 9; allowed: 1..4"),
        (["--rows", "8"], "--rows 8; allowed: >= "),
        (["--steps", "0"], "--steps 0; allowed: >= 1"),
        (["--backend", "triton"], "--backend triton runs on --device cuda only"),
        (["--order", "trainer,eager"], "--order trainer,eager; allowed: parallelize_flow,trainer,eager,"),
    ],
)
def test_a_bad_argument_is_one_line_and_writes_nothing(tmp_path, capsys, extra, expected):
    out = tmp_path / "p.json"
    assert main(["--out", str(out), "--config", "tiny", "--device", "cpu", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err and not out.exists()
