"""torchrun, with every TCP store of a single-machine run listening on 127.0.0.1 only.

torch's TCPStore binds the wildcard address (`::`) even when given 127.0.0.1, which would expose a
local run's rendezvous store and its workers' bootstrap store to the network. The store accepts an
already-bound socket (`master_listen_fd`), so this wrapper pre-binds one to 127.0.0.1 whenever a
store is hosted on a loopback address, then runs `torch.distributed.run` unchanged (launched with
`--local-addr=127.0.0.1`, so the workers' store is hosted on loopback too).
"""

from __future__ import annotations

import socket
import sys

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
from torch.distributed.run import main

_LOOPBACK = ("127.0.0.1", "localhost")


class LoopbackTCPStore(dist.TCPStore):
    def __init__(self, host_name: str, port: int, *args, is_master: bool = False, **kwargs) -> None:
        if is_master and host_name in _LOOPBACK and kwargs.get("master_listen_fd") is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(1024)
            port = sock.getsockname()[1]  # port 0 asks the OS for a free one
            kwargs["master_listen_fd"] = sock.detach()  # the store owns the descriptor from here
        super().__init__(host_name, port, *args, is_master=is_master, **kwargs)


if __name__ == "__main__":
    dist.TCPStore = LoopbackTCPStore  # the workers' bootstrap store (dynamic rendezvous)
    c10d_rendezvous_backend.TCPStore = LoopbackTCPStore  # the rendezvous store
    sys.exit(main())
