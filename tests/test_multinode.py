"""The multi-node path as documented, on one machine: two `h3lab run --nnodes 2 --node-rank R
--rdzv-endpoint 127.0.0.1:PORT` sharing one --out, the stores bound to the endpoint's address only,
and the user's socket interfaces left alone across machines."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

from h3lab import H3Config
from h3lab.io.checkpoint import synthesize_checkpoint
from h3lab.launch.launcher import free_port, launch, worker_env
from tests.conftest import leftovers


def test_two_nodes_on_one_machine_share_one_run_folder(tmp_path):
    ckpt = synthesize_checkpoint(tmp_path / "ckpt", H3Config.tiny(), num_blocks=1, seed=41)  # with a manifest
    out, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "h3lab", "run", "--layout", "tp2:2x1", "--checkpoint", str(ckpt), "--rows", "16"]
    cmd += ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--out", str(out), "--timeout", "240"]
    # node 1 first: it waits for node 0 to claim the folder, then joins it
    procs = [subprocess.Popen([*cmd, "--node-rank", r], stdout=subprocess.PIPE, text=True) for r in ("1", "0")]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    node0 = json.loads((out / "summary.json").read_text())
    node1 = json.loads((out / "nodes" / "node1" / "summary.json").read_text())
    assert node0["status"] == node1["status"] == "passed"
    record = node0["layouts"]["tp2:2x1"]
    assert len(record["tensors"]) == 15 and all(t["bitwise_equal"] for t in record["tensors"].values())
    assert node1["layouts"]["tp2:2x1"]["note"] == "ranks of this node finished; node 0 assembles"
    for summary in (node0, node1):  # each machine says whether what it loaded was verified
        assert summary["checkpoint"] == {"path": str(Path(ckpt).resolve()), "manifest_verified": True}
    agents = sorted(p.name for p in (out / "layouts" / "tp2_2x1").glob("agent*.log"))
    assert agents == ["agent0.log", "agent1.log"]
    assert not leftovers(node0["owner"]["token"]) and not leftovers(node1["owner"]["token"])


def test_every_store_of_a_two_node_job_binds_the_endpoint_address_only(tmp_path):
    endpoint, results = f"127.0.0.1:{free_port()}", {}

    def node(rank: int) -> None:
        results[rank] = launch(
            "tests.hello",
            [str(tmp_path)],
            nproc_per_node=1,
            log_dir=tmp_path / f"node{rank}",
            timeout_s=180,
            nnodes=2,
            node_rank=rank,
            rdzv_endpoint=endpoint,
            rdzv_id="one-job",
        )

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(res.ok for res in results.values()), [
        (tmp_path / f"node{r}" / f"agent{r}.log").read_text()[-2000:] for r in (0, 1)
    ]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["gathered"] == [0.0, 1.0] for r in records)
    listening = {addr for r in records for addr in r["listening"]}
    assert endpoint in listening  # node 0's agent hosts the rendezvous store there
    assert all(addr.startswith("127.0.0.1:") for addr in listening), listening


def test_a_users_socket_interface_is_respected_across_machines():
    user = {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "ib3", "PATH": "/bin"}
    across = worker_env(user, "tok", endpoint_host="10.1.2.3")
    assert across["GLOO_SOCKET_IFNAME"] == "eth7" and across["NCCL_SOCKET_IFNAME"] == "ib3"
    assert "GLOO_SOCKET_IFNAME" not in worker_env({"PATH": "/bin"}, "tok", endpoint_host="10.1.2.3")
    assert worker_env({"PATH": "/bin"}, "tok", endpoint_host="127.0.0.1")["GLOO_SOCKET_IFNAME"] == "lo"
    assert worker_env(user, "tok", endpoint_host=None)["GLOO_SOCKET_IFNAME"] == "lo"  # one machine: loopback only
