"""Every layout on real processes (gloo on CPU), compared byte for byte with the canonical block."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from h3lab.metrics import bitwise_equal
from h3lab.parallel.layout import ALL_LAYOUTS, parse_layouts
from h3lab.run.problem import Problem
from h3lab.run.runner import RunRequest, run, slug
from tests.conftest import leftovers


def _workers_of(out: Path) -> list[int]:
    """Live processes whose command line names this run directory (an interrupted run records no token)."""
    alive = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(str(out) in part for part in p.info["cmdline"] or []) and p.pid != os.getpid():
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
    return alive


def _run(tmp_path: Path, layouts, **problem) -> dict:
    return run(
        RunRequest(
            layouts=tuple(parse_layouts(layouts)), problem=Problem(**problem), out=tmp_path / "run", timeout_s=240
        )
    )


def _assert_all_bitwise(summary: dict, out: Path, layouts) -> None:
    assert summary["status"] == "passed", json.dumps({k: v.get("failure") for k, v in summary["layouts"].items()})
    canon = load_file(str(out / "canonical.safetensors"))
    assert set(canon) >= {"out", "dx", "dtemb", "dw.attn.to_q.weight", "dw.adaln_proj.linear.bias"}
    env = json.loads((out / "env.json").read_text())
    assert env["node_type"] == "CPU" and env["torch"] == torch.__version__ and env["git"]["commit"]
    for layout in parse_layouts(layouts):
        rec = summary["layouts"][layout.name]
        assert rec["ranks_all_equal"] and rec["replicas_consistent"]
        assert all(t["bitwise_equal"] and t["num_differing"] == 0 for t in rec["tensors"].values())
        full = load_file(str(out / "layouts" / f"{slug(layout)}.safetensors"))
        assert full.keys() == canon.keys()
        assert all(bitwise_equal(full[k], canon[k]) for k in canon)  # re-checked from the files
        assert len(rec["ranks"]) == layout.world and all(r["timings"]["backward_s"] > 0 for r in rec["ranks"])


@pytest.fixture(scope="module")
def seven(tmp_path_factory) -> tuple[dict, Path]:
    """The seven layouts in one run, each layout node its own torchrun agent on 127.0.0.1 (tp8:2x4 as
    two agents of 4; every other layout is one node, one agent): (summary, run folder). tp8:2x4 under
    one agent of 8 runs in tests/test_train_run.py and tests/test_compare.py."""
    # 263 active + 4 padding rows = 267: not divisible by the 2 CP or 8 SP shards, so SeqShard pads too
    tmp = tmp_path_factory.mktemp("seven")
    summary = run(
        RunRequest(
            layouts=tuple(parse_layouts(["all"])),
            problem=Problem(rows=263, padding=4, seed=4),
            out=tmp / "run",
            timeout_s=240,
            agents="per-node",
        )
    )
    return summary, tmp / "run"


def test_the_seven_layouts_are_bitwise_equal_to_the_canonical_block_with_padding(seven):
    summary, out = seven
    _assert_all_bitwise(summary, out, ALL_LAYOUTS)
    decisions = summary["layouts"]["tp8:2x4"]["decisions"]
    assert any(d["algorithm"] == "hierarchical" and d["group"]["local_size"] == 4 for d in decisions)
    assert all(d["bytes_received_total"] >= 0 for d in decisions)


def test_tp8_2x4_runs_as_two_torchrun_agents(seven):
    summary, _ = seven
    commands = summary["layouts"]["tp8:2x4"]["launch"]["commands"]
    assert len(commands) == 2 and all("--nproc-per-node=4" in c for c in commands)
    assert "--node-rank=0" in commands[0] and "--node-rank=1" in commands[1]
    (tp8,) = summary["layouts"]["tp8"]["launch"]["commands"]  # one node: one agent of 8
    assert "--nproc-per-node=8" in tp8 and "--nnodes=1" in tp8


def test_baseline_mode_diverges_where_expected(tmp_path):
    """Under TP, CP and SP (tp2xcp2+sp). Under TP alone, tests/test_chain.py's baseline tp2 run names the
    block's first op whose bits move."""
    summary = _run(tmp_path, ["tp2xcp2+sp"], rows=264, seed=6, mode="baseline")
    rec = summary["layouts"]["tp2xcp2+sp"]
    assert summary["status"] == "failed" and rec["status"] == "mismatch"
    out = rec["tensors"]["out"]  # to_out and ff.net.2 are row-parallel: all_reduce(SUM) reorders them
    assert not out["bitwise_equal"] and out["max_ulp"] > 0 and out["num_differing"] > 0


@pytest.mark.parametrize(("kind", "expect"), [("raise", "raised RuntimeError"), ("kill", "killed"), ("hang", "hung")])
def test_a_failing_rank_is_named_and_nothing_is_left_behind(tmp_path, monkeypatch, kind, expect):
    monkeypatch.setenv("H3LAB_FAULT", f"{kind}:3")
    req = RunRequest(
        layouts=tuple(parse_layouts("tp4")),
        problem=Problem(rows=64, seed=7),
        out=tmp_path / "run",
        # a hang is waited out: the limit covers the four ranks' start-up to their process group (rank
        # 3 hangs right after it, the others wait for it in a collective), and no more
        timeout_s=20 if kind == "hang" else 240,
    )
    summary = run(req)
    rec = summary["layouts"]["tp4"]
    assert summary["status"] == "failed" and rec["status"] == "failed"
    assert rec["failure"]["rank"] == 3 and expect in rec["failure"]["reason"], rec["failure"]
    assert rec["failure"]["log"].endswith("layouts/tp4/rank3.log")
    assert rec["launch"]["timed_out"] == (kind == "hang")
    assert not leftovers(rec["launch"]["token"])
    if kind != "hang":  # the other ranks, waiting in a collective for rank 3, took torchrun's SIGTERM at once
        for r in range(3):
            status = json.loads((tmp_path / "run" / "layouts" / "tp4" / f"rank{r}.status.json").read_text())
            assert status["state"] == "terminated" and status["signal"] == signal.SIGTERM, (r, status)
        return
    monkeypatch.delenv("H3LAB_FAULT")  # the next run is unaffected, after the fault that outlives its phase longest
    again = run(
        RunRequest(
            layouts=tuple(parse_layouts("tp2")), problem=Problem(rows=64, seed=7), out=tmp_path / "again", timeout_s=240
        )
    )
    assert again["status"] == "passed"


def test_bad_requests_fail_before_any_process_starts(tmp_path):
    with pytest.raises(ValueError, match="unknown layout 'tp3x'"):
        parse_layouts("tp2 tp3x")
    with pytest.raises(ValueError, match="rows=0 must be >= 1"):
        Problem(rows=0)
    with pytest.raises(ValueError, match="unknown synthetic config 'huge'; allowed: \\['tiny', 'real'\\]"):
        Problem(synthetic="huge")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    with pytest.raises(ValueError, match="is not empty"):
        run(RunRequest(layouts=tuple(parse_layouts("tp2")), problem=Problem(rows=8), out=tmp_path / "busy"))
    assert (tmp_path / "busy" / "x").read_text() == "keep me"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "h3lab",
            "run",
            "--layout",
            "tp3",
            "--synthetic",
            "tiny",
            "--out",
            str(tmp_path / "cli"),
        ],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 2 and "tp=3 not allowed; allowed: [1, 2, 4, 8]" in cli.stderr
    assert not (tmp_path / "cli").exists()


def test_an_interrupted_run_is_never_mistaken_for_a_complete_one(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "h3lab",
        "run",
        "--layout",
        "tp4",
        "tp8",
        "--synthetic",
        "tiny",
        "--rows",
        "64",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out / "layouts" / "tp4" / "rank0.status.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "tp4" not in summary["layouts"]
    assert not _workers_of(out)
