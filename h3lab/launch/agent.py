"""torchrun, with every TCP store it hosts bound to one address, and an agent that dies with its runner.

torch's TCPStore binds the wildcard address (`::`) even when given 127.0.0.1 or one host's address,
which would expose a run's rendezvous store and its workers' bootstrap store on every interface of
the machine. The store accepts an already-bound socket (`master_listen_fd`), so this wrapper
pre-binds one to the address the store is hosted on (127.0.0.1 on one machine, the rendezvous
endpoint's address on node 0 of a multi-node job), then runs `torch.distributed.run` unchanged.

The agent watches its lifeline (h3lab.launch.lifeline): when the runner is gone it stops its ranks
and exits; the ranks it starts watch the runner and this agent.
"""

from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
from torch.distributed.run import main

from h3lab.launch.lifeline import LIFELINE_VAR, extended, terminate_then_exit, watch


def _bind(host_name: str, port: int) -> socket.socket:
    """A listening socket on `host_name`'s address (127.0.0.1 for localhost), never the wildcard."""
    host = "127.0.0.1" if host_name == "localhost" else host_name
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(1024)
    return sock


class BoundTCPStore(dist.TCPStore):
    def __init__(self, host_name: str, port: int, *args, is_master: bool = False, **kwargs) -> None:
        if is_master and kwargs.get("master_listen_fd") is None:
            sock = _bind(host_name, port)
            port = sock.getsockname()[1]  # port 0 asks the OS for a free one
            kwargs["master_listen_fd"] = sock.detach()  # the store owns the descriptor from here
        super().__init__(host_name, port, *args, is_master=is_master, **kwargs)


if __name__ == "__main__":
    # SIGTERM makes torchrun stop its ranks (its own handler); the watchdog also ends a stuck agent
    watch(terminate_then_exit())
    os.environ[LIFELINE_VAR] = extended(os.environ)  # the ranks watch this agent too
    dist.TCPStore = BoundTCPStore  # the workers' bootstrap store (dynamic rendezvous)
    c10d_rendezvous_backend.TCPStore = BoundTCPStore  # the rendezvous store
    sys.exit(main())
