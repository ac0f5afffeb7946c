"""The one launch path: `python -m torch.distributed.run` as a subprocess, for tests, runner and notebooks.

Workers are modules inside h3lab (never notebook cells). Every launched process carries a run
token in its environment; whatever happens (success, a raising rank, a hang past the timeout, a
killed rank, Ctrl-C), `launch` ends by killing every process that carries the token, so no orphan
outlives it and the next launch is unaffected. torchrun starts each worker in its own session,
which is why a process-group kill alone would not reach them. Where the launcher itself dies
without that sweep (SIGKILL), every launched process follows it through its lifeline
(h3lab.launch.lifeline).

Every agent runs through h3lab's wrapper (h3lab.launch.agent), which binds each TCP store it
hosts to one address, never the wildcard: 127.0.0.1 on one machine; across machines
(`rdzv_endpoint`, `nnodes`, `node_rank`) the endpoint's address, hosted by node 0.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from h3lab.launch.lifeline import LIFELINE_VAR, extended

TOKEN_VAR = "H3LAB_RUN_TOKEN"
# Keep NVLink multicast off wherever workers start: a program using it can take a shared host's
# GPUs out of service (device notes); harmless on CPU.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
}
# Processes one machine starts for one launch: 8 GPUs x 8 processes; past that a layout belongs on
# several machines (`:NxL` with --nnodes), and every CPU rank holds its own copy of torch.
MAX_LOCAL_PROCESSES = 64


@dataclass(frozen=True)
class LaunchResult:
    """How one launch ended."""

    returncode: int  # torchrun's exit status (non-zero if any rank failed); -1 when killed on timeout
    timed_out: bool
    elapsed_s: float
    commands: list[list[str]]
    agent_logs: list[Path]
    token: str  # the value of H3LAB_RUN_TOKEN every process of this launch carried
    killed_leftovers: list[int] = field(default_factory=list)  # pids still alive at the end, killed
    # each agent's exit status (negative: killed by that signal); None: still running at the end,
    # stopped by the launcher (a timeout, or another agent failed first)
    agent_codes: list[int | None] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def new_token() -> str:
    """A run token: every process of a run carries it in H3LAB_RUN_TOKEN."""
    return uuid.uuid4().hex


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback."""
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    return False


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (or [v6]:PORT) -> (host, port).

    Raises:
        ValueError: not HOST:PORT with a port in 1..65535.
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rendezvous endpoint {endpoint!r}; allowed: HOST:PORT with a port in 1..65535")
    return host.strip("[]"), int(port)


def worker_env(
    base: Mapping[str, str], token: str, *, endpoint_host: str | None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of every launched process: `base`, the safety settings, the run token and
    the lifeline. One machine (`endpoint_host` None, or a loopback endpoint the user gave no
    interface for) keeps gloo on the loopback interface; across machines the user's
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are left as they are."""
    env = {**base, **SAFE_ENV, **(extra or {}), TOKEN_VAR: token, LIFELINE_VAR: extended(base)}
    if endpoint_host is None:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    elif is_loopback(endpoint_host):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")  # N ranks share the cores; torchrun would set 1 and warn
    return env


def torchrun_command(
    module: str,
    args: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str,
    rdzv_id: str,
    local_addr: str | None,
    is_host: bool,
) -> list[str]:
    """The torchrun command line, through h3lab's agent wrapper (stores bound to one address).

    `local_addr`: the address this agent advertises and hosts the workers' store on (None:
    torchrun's default, the machine's name); `is_host`: whether this agent hosts the rendezvous
    store (node 0)."""
    return [
        sys.executable,
        "-m",
        "h3lab.launch.agent",
        *([f"--local-addr={local_addr}"] if local_addr else []),
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        "--rdzv-conf",
        f"is_host={str(is_host).lower()}",
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
    token: str | None = None,
    rdzv_id: str | None = None,
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
        token: the run token to tag every process with (default: a new one).
        rdzv_id: the rendezvous id: the same on every node of a multi-node job (required there)
            and new for each launch; one machine's launches default to the token.

    Raises:
        ValueError: bad process counts, more than MAX_LOCAL_PROCESSES here, a bad endpoint.
    """
    if nproc_per_node < 1 or agents < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node}, agents={agents}; allowed: both >= 1")
    local = rdzv_endpoint is None
    check_local_processes(nproc_per_node * (agents if local else 1))
    log_dir.mkdir(parents=True, exist_ok=True)
    token = token or new_token()
    nnodes, node_ranks, endpoint, host = _rendezvous(agents, nnodes, node_rank, rdzv_endpoint, rdzv_id)
    full_env = worker_env(os.environ, token, endpoint_host=host, extra=env)
    commands = _agent_commands(module, args, nproc_per_node, nnodes, node_ranks, endpoint, rdzv_id or token, host)
    logs = [log_dir / f"agent{nr}.log" for nr in node_ranks]
    return _run(commands, logs, full_env, token, timeout_s)


def _rendezvous(
    agents: int, nnodes: int | None, node_rank: int, rdzv_endpoint: str | None, rdzv_id: str | None
) -> tuple[int, list[int], str, str | None]:
    """(nnodes, the node ranks this machine runs, endpoint, endpoint host). One machine (no endpoint):
    every agent is a node, on a free 127.0.0.1 port, host None. Across machines this one runs node
    `node_rank` of `nnodes`, and every node must name the same `rdzv_id`."""
    if rdzv_endpoint is None:
        return agents, list(range(agents)), f"127.0.0.1:{free_port()}", None
    nnodes = nnodes or 1
    host = split_endpoint(rdzv_endpoint)[0]
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank}; allowed: 0..{nnodes - 1} for nnodes={nnodes}")
    if rdzv_id is None:  # a token of this machine's own would never meet the other nodes'
        raise ValueError("rdzv_id=None for a multi-node launch; allowed: one string shared by every node")
    return nnodes, [node_rank], rdzv_endpoint, host


def _agent_commands(
    module: str,
    args: Sequence[str],
    nproc_per_node: int,
    nnodes: int,
    node_ranks: list[int],
    endpoint: str,
    rdzv_id: str,
    host: str | None,
) -> list[list[str]]:
    """One torchrun command per node rank; node 0 hosts the stores on the endpoint's address, and on
    one machine (host None) or a loopback endpoint every agent is on 127.0.0.1."""
    commands = []
    for nr in node_ranks:
        local_addr = "127.0.0.1" if host is None or is_loopback(host) else (host if nr == 0 else None)
        commands.append(
            torchrun_command(
                module,
                args,
                nproc_per_node=nproc_per_node,
                nnodes=nnodes,
                node_rank=nr,
                rdzv_endpoint=endpoint,
                rdzv_id=rdzv_id,
                local_addr=local_addr,
                is_host=nr == 0,
            )
        )
    return commands


def launch_process(
    module: str,
    args: Sequence[str],
    *,
    log: Path,
    timeout_s: float,
    token: str | None = None,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    """Run `python -m module args` as one process of this machine, tagged, bounded and swept like
    `launch`'s agents (its output goes to `log`)."""
    token = token or new_token()
    full_env = worker_env(os.environ, token, endpoint_host=None, extra=env)
    return _run([[sys.executable, "-m", module, *args]], [log], full_env, token, timeout_s)


def check_local_processes(count: int) -> None:
    """Refuse launching more than MAX_LOCAL_PROCESSES processes on this machine."""
    if count > MAX_LOCAL_PROCESSES:
        raise ValueError(
            f"{count} processes on this machine; allowed: at most {MAX_LOCAL_PROCESSES} per machine "
            "(a larger layout runs on several machines: :NxL with --nnodes N)"
        )


def _run(
    commands: list[list[str]], logs: list[Path], env: dict[str, str], token: str, timeout_s: float
) -> LaunchResult:
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    timed_out, codes = False, []
    try:
        for cmd, log in zip(commands, logs, strict=True):
            with open(log, "wb") as fh:
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
                )
        timed_out, codes = _wait(procs, start + timeout_s)
    finally:
        leftovers = kill_token(token)
    rc = -1 if timed_out else next((c for c in codes if c not in (None, 0)), 0)
    return LaunchResult(rc, timed_out, time.monotonic() - start, commands, logs, token, leftovers, codes)


def _wait(procs: list[subprocess.Popen], deadline: float) -> tuple[bool, list[int | None]]:
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return False, codes
        if any(c not in (None, 0) for c in codes):  # one agent failed: the others cannot finish
            time.sleep(2.0)  # let torchrun report its root cause before the sweep below
            return False, [p.poll() for p in procs]
        if time.monotonic() > deadline:
            return True, [p.poll() for p in procs]
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
