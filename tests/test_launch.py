"""The launch path: torchrun through h3lab's agent, loopback-only stores, no orphans."""

from __future__ import annotations

import json
import re

import pytest

from h3lab.launch.launcher import launch
from tests.conftest import leftovers


@pytest.mark.parametrize("agents", [1, 2])
def test_every_store_listens_on_loopback_only(tmp_path, agents):
    res = launch(
        "tests.hello",
        [str(tmp_path)],
        nproc_per_node=4 // agents,
        log_dir=tmp_path,
        timeout_s=120,
        agents=agents,
    )
    assert res.ok, (tmp_path / "agent0.log").read_text()[-2000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["gathered"] == [0.0, 1.0, 2.0, 3.0] for r in records)
    listening = {addr for r in records for addr in r["listening"]}
    assert listening, "expected the agents and gloo to listen somewhere"
    assert all(addr.startswith("127.0.0.1:") for addr in listening), listening
    assert len(res.commands) == agents and not leftovers(res.token)


def test_a_timeout_kills_every_process(tmp_path):
    res = launch(
        "tests.hello",
        [str(tmp_path)],
        nproc_per_node=2,
        log_dir=tmp_path,
        timeout_s=15,
        env={"H3LAB_HELLO_SLEEP": "600"},
    )
    assert res.timed_out and not res.ok and res.killed_leftovers and not leftovers(res.token)


def test_a_failing_worker_fails_the_launch(tmp_path):
    # the workers cannot write into a missing directory: torchrun reports the failure, nobody is left
    res = launch("tests.hello", [str(tmp_path / "missing")], nproc_per_node=2, log_dir=tmp_path, timeout_s=120)
    assert not res.ok and not res.timed_out and res.returncode != 0 and not leftovers(res.token)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"nproc_per_node": 0}, "nproc_per_node=0, agents=1; allowed: both >= 1"),
        ({"nproc_per_node": 1, "agents": 0}, "nproc_per_node=1, agents=0; allowed: both >= 1"),
        (
            {"nproc_per_node": 1, "nnodes": 2, "rdzv_endpoint": "127.0.0.1:29500"},
            "rdzv_id=None for a multi-node launch; allowed: one string shared by every node",
        ),
        (
            {"nproc_per_node": 1, "nnodes": 2, "node_rank": 2, "rdzv_endpoint": "127.0.0.1:29500"},
            "node_rank=2; allowed: 0..1 for nnodes=2",
        ),
    ],
)
def test_a_bad_launch_is_refused_naming_the_value_before_any_process(tmp_path, kwargs, expected):
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        launch("tests.hello", [], log_dir=tmp_path / "logs", timeout_s=10, **kwargs)
