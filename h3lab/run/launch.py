"""The one launch path: `python -m torch.distributed.run` as a subprocess, for tests, runner and notebooks.

Workers are modules inside h3lab (never notebook cells). Every launched process carries a run
token in its environment; whatever happens (success, a raising rank, a hang past the timeout, a
killed rank, Ctrl-C), `launch` ends by killing every process that carries the token, so no orphan
outlives it and the next launch is unaffected. torchrun starts each worker in its own session,
which is why a process-group kill alone would not reach them.

On one machine the rendezvous store listens on 127.0.0.1 only (h3lab.run.workers.agent pre-binds it);
across machines `rdzv_endpoint`, `nnodes` and `node_rank` are passed through to torchrun.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

TOKEN_VAR = "H3LAB_RUN_TOKEN"
# Keep NVLink multicast off wherever workers start: a program using it can take a shared host's
# GPUs out of service (device notes); harmless on CPU.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "PYTHONUNBUFFERED": "1",
}


@dataclass(frozen=True)
class LaunchResult:
    """How one torchrun launch ended."""

    returncode: int  # torchrun's exit status (non-zero if any rank failed); -1 when killed on timeout
    timed_out: bool
    elapsed_s: float
    commands: list[list[str]]
    agent_logs: list[Path]
    token: str  # the value of H3LAB_RUN_TOKEN every process of this launch carried
    killed_leftovers: list[int] = field(default_factory=list)  # pids still alive at the end, killed

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(
    module: str,
    args: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str,
    rdzv_id: str,
    local: bool,
    is_host: bool | None = None,
) -> list[str]:
    """The torchrun command line (through h3lab's agent wrapper when `local`)."""
    launcher = ["-m", "h3lab.run.workers.agent", "--local-addr=127.0.0.1"] if local else ["-m", "torch.distributed.run"]
    conf = [] if is_host is None else ["--rdzv-conf", f"is_host={str(is_host).lower()}"]
    return [
        sys.executable,
        *launcher,
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        *conf,
        "--max-restarts=0",
        "--monitor-interval=0.1",
        "-m",
        module,
        *args,
    ]


def launch(
    module: str,
    args: Sequence[str],
    *,
    nproc_per_node: int,
    log_dir: Path,
    timeout_s: float,
    agents: int = 1,
    nnodes: int | None = None,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    """Run `module` on `agents * nproc_per_node` local processes (or this node's share of a multi-node job).

    Args:
        module: worker module inside h3lab, e.g. "h3lab.run.workers.rank".
        args: its command-line arguments.
        nproc_per_node: processes per torchrun agent.
        log_dir: agent logs go to `log_dir/agent<node>.log`; workers write their own rank logs.
        timeout_s: wall-clock limit for the whole launch; past it every process is killed.
        agents: torchrun agents started here, each one "node" of the rendezvous (2 emulates two
            nodes on 127.0.0.1). Ignored when `rdzv_endpoint` is given.
        nnodes, node_rank, rdzv_endpoint: a real multi-machine job (this machine runs one agent).
        env: extra environment for the workers.

    Raises:
        ValueError: bad process counts.
    """
    if nproc_per_node < 1 or agents < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node}, agents={agents}: both must be >= 1")
    log_dir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    full_env = {**os.environ, **SAFE_ENV, **(env or {}), TOKEN_VAR: token}
    full_env.setdefault("OMP_NUM_THREADS", "1")  # N ranks share the cores; torchrun would set 1 and warn
    local = rdzv_endpoint is None
    if local:
        nnodes, node_ranks, endpoint = agents, list(range(agents)), f"127.0.0.1:{free_port()}"
    else:
        nnodes, node_ranks, endpoint = nnodes or 1, [node_rank], rdzv_endpoint
    commands, procs, logs = [], [], []
    start = time.monotonic()
    try:
        for nr in node_ranks:
            cmd = torchrun_command(
                module,
                args,
                nproc_per_node=nproc_per_node,
                nnodes=nnodes,
                node_rank=nr,
                rdzv_endpoint=endpoint,
                rdzv_id=token,
                local=local,
                is_host=(nr == 0) if local else None,
            )
            log = log_dir / f"agent{nr}.log"
            with open(log, "wb") as fh:
                procs.append(
                    subprocess.Popen(cmd, env=full_env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
                )
            commands.append(cmd)
            logs.append(log)
        timed_out, codes = _wait(procs, start + timeout_s)
    finally:
        leftovers = kill_token(token)
    rc = -1 if timed_out else next((c for c in codes if c != 0), 0)
    return LaunchResult(rc, timed_out, time.monotonic() - start, commands, logs, token, leftovers)


def _wait(procs: list[subprocess.Popen], deadline: float) -> tuple[bool, list[int]]:
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return False, codes  # type: ignore[return-value]
        if any(c not in (None, 0) for c in codes):  # one agent failed: the others cannot finish
            time.sleep(2.0)  # let torchrun report its root cause before the sweep below
            return False, [p.poll() if p.poll() is not None else -1 for p in procs]
        if time.monotonic() > deadline:
            return True, [-1] * len(procs)
        time.sleep(0.05)


def processes_with_token(token: str) -> list[psutil.Process]:
    """Every live process (but this one) whose environment carries `token`."""
    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(TOKEN_VAR) == token and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_token(token: str, grace_s: float = 3.0) -> list[int]:
    """SIGTERM then SIGKILL every process whose environment carries `token`; returns their pids."""
    found = processes_with_token(token)
    for p in found:
        _signal(p, signal.SIGTERM)
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    for p in alive:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in found]


def _signal(p: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        p.send_signal(sig)
