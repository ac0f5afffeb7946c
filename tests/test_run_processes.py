"""No process outlives the runner, whatever ends it, and a failure blames the right process.

The runner runs as a subprocess; its processes are found in the process table by the run's token
(h3lab.launch.launcher.processes_with_token), which every launched process carries.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import h3lab.launch.launcher as launch_module
from h3lab.cli import main
from h3lab.parallel.layout import parse_layouts
from h3lab.run.problem import Problem
from h3lab.run.runner import RunRequest, run
from h3lab.workbench.rundata import load_sweep
from tests.conftest import leftovers

RUN = [sys.executable, "-m", "h3lab", "run", "--layout", "tp2", "--synthetic", "tiny", "--rows", "8"]


def _wait_for(predicate, timeout_s: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _ranks_running(layout_dir: Path, world: int) -> bool:
    return all((layout_dir / f"rank{r}.status.json").exists() for r in range(world))


def _token(out: Path) -> str:
    return json.loads((out / "owner.json").read_text())["token"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_no_process_outlives_a_runner_killed_or_hung_up(tmp_path, capsys, sig):
    out = tmp_path / "run"
    env = {**os.environ, "H3LAB_FAULT": "hang:1"}  # the ranks would live for an hour
    proc = subprocess.Popen([*RUN, "--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(lambda: _ranks_running(out / "layouts" / "tp2", 2), what="the ranks")
    token = _token(out)
    assert len(leftovers(token)) >= 3  # the agent and its two ranks
    proc.send_signal(sig)
    proc.wait(timeout=60)
    _wait_for(lambda: not leftovers(token), timeout_s=20, what=f"every process of the run to exit after {sig.name}")
    summary = json.loads((out / "summary.json").read_text())
    if sig == signal.SIGHUP:  # a closed terminal unwinds like SIGTERM
        assert summary["status"] == "interrupted"
        return
    # SIGKILL: the runner wrote nothing more; the folder says running, its owner is gone: "stale"
    assert summary["status"] == "running" and summary["owner"]["pid"] == proc.pid
    assert load_sweep(out).status == "stale"  # what the workbench shows
    assert main(["report", str(out), "--out", str(tmp_path / "report")]) == 2
    assert "is stale: it says 'running' but its runner" in capsys.readouterr().err
    assert main([*RUN[3:], "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is stale" in err and "never overwritten: choose a new folder" in err


def test_a_rank_stopped_inside_a_collective_is_named_by_its_heartbeat(tmp_path, monkeypatch):
    # rank 1 announces its first collective, then stops: rank 0 waits in the same collective with
    # the same number of calls, so only the heartbeat tells the two apart
    monkeypatch.setenv("H3LAB_FAULT", "stop:1")
    req = RunRequest(layouts=tuple(parse_layouts("tp2")), problem=Problem(rows=8), out=tmp_path / "run", timeout_s=18)
    summary = run(req)
    failure = summary["layouts"]["tp2"]["failure"]
    assert failure["rank"] == 1 and failure["reason"].startswith("stopped: its heartbeat stopped"), failure
    assert failure["log"].endswith("layouts/tp2/rank1.log")
    status = [json.loads((tmp_path / "run" / "layouts" / "tp2" / f"rank{r}.status.json").read_text()) for r in (0, 1)]
    assert status[0]["calls"] == status[1]["calls"]  # what the fewest-calls rule alone could not separate
    assert not leftovers(summary["owner"]["token"])


def test_an_agent_that_cannot_bind_its_port_is_named_with_its_log(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(launch_module, "free_port", lambda: taken.getsockname()[1])
        req = RunRequest(layouts=tuple(parse_layouts("tp2")), problem=Problem(rows=8), out=tmp_path / "run")
        summary = run(req)
    failure = summary["layouts"]["tp2"]["failure"]
    assert failure["rank"] is None and failure["agent"] == 0, failure
    assert failure["reason"].startswith("agent 0 exited with code 1 before starting any rank")
    assert failure["log"].endswith("layouts/tp2/agent0.log") and Path(failure["log"]).is_file()


def test_a_killed_agent_is_named_not_a_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("H3LAB_FAULT", "hang:1")
    out = tmp_path / "run"

    def kill_the_agent() -> None:
        _wait_for(lambda: _ranks_running(out / "layouts" / "tp2", 2), what="the ranks")
        (agent,) = [p for p in _processes(_token(out)) if "h3lab.launch.agent" in p.cmdline()]
        agent.kill()

    killer = threading.Thread(target=kill_the_agent)
    killer.start()
    summary = run(RunRequest(layouts=tuple(parse_layouts("tp2")), problem=Problem(rows=8), out=out, timeout_s=120))
    killer.join()
    failure = summary["layouts"]["tp2"]["failure"]
    assert failure == failure | {
        "rank": None,
        "agent": 0,
        "reason": "agent 0 was killed by SIGKILL; its ranks stopped with it",
    }
    assert failure["log"].endswith("agent0.log")
    assert summary["layouts"]["tp2"]["launch"]["killed_leftovers"] == []  # the ranks left with their agent
    assert not leftovers(summary["owner"]["token"])


def _processes(token: str) -> list[psutil.Process]:
    from h3lab.launch.launcher import processes_with_token

    return processes_with_token(token)


# ---- the rules, on the files a launch leaves (no processes) ------------------------------------------
def _files(d: Path, status: dict[int, dict], beats: dict[int, float]) -> None:
    for r, s in status.items():
        (d / f"rank{r}.status.json").write_text(json.dumps(s))
    for r, t in beats.items():
        (d / f"rank{r}.heartbeat").write_text(repr(t))


@pytest.mark.parametrize(
    ("status", "beats", "timed_out", "codes", "who", "reason"),
    [
        # a rank that finished early is not "stopped"; the one that makes no progress is named
        (
            {
                0: {"state": "done", "time": 1.0},
                1: {"state": "terminated", "calls": 3},
                2: {"state": "terminated", "calls": 9},
            },
            {0: 100.0, 1: 160.0, 2: 160.0},
            True,
            [None],
            1,
            "hung: still running",
        ),
        # the stale heartbeat wins over the fewest calls
        (
            {0: {"state": "terminated", "calls": 5}, 1: {"state": "running", "calls": 7}},
            {0: 160.0, 1: 120.0},
            True,
            [None],
            1,
            "stopped: its heartbeat stopped 40 s",
        ),
        # an error explains a timeout better than a heartbeat
        (
            {0: {"state": "terminated", "calls": 5}, 1: {"state": "error", "error": "RuntimeError: x", "time": 110.0}},
            {0: 160.0, 1: 110.0},
            True,
            [None],
            1,
            "raised RuntimeError: x",
        ),
        # an agent killed by a signal is named itself
        (
            {0: {"state": "terminated", "reason": "its launcher (pid 9) is gone", "time": 5.0}},
            {0: 4.0},
            False,
            [-9],
            "agent 0",
            "killed by SIGKILL",
        ),
        # nothing started and the agent failed: the agent, not a rank0.log that does not exist
        ({}, {}, False, [1], "agent 0", "exited with code 1 before starting any rank"),
    ],
)
def test_the_blame_rules_on_recorded_files(tmp_path, status, beats, timed_out, codes, who, reason):
    from h3lab.launch.launcher import LaunchResult
    from h3lab.run.diagnose import diagnose

    _files(tmp_path, status, beats)
    (tmp_path / "agent0.log").write_text("OSError: [Errno 98] Address already in use\n")
    world = max(len(status), 2)
    res = LaunchResult(-1 if timed_out else 1, timed_out, 60.0, [], [tmp_path / "agent0.log"], "tok", [], codes)
    failure = diagnose(tmp_path, world, res)
    named = f"agent {failure['agent']}" if failure["rank"] is None else failure["rank"]
    assert named == who and reason in failure["reason"], failure
    assert Path(failure["log"]).name == ("agent0.log" if failure["rank"] is None else f"rank{who}.log")
