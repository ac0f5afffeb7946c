"""A minimal worker: joins the process group, all-gathers its rank, reports listening sockets."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from h3lab.io.jsonfile import write_json
from h3lab.launch.lifeline import exit_now, watch


def main(argv: list[str]) -> int:
    watch(exit_now(), parent_signal=signal.SIGKILL)  # no orphan when the agent or runner is gone
    out = Path(argv[0])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    time.sleep(float(os.environ.get("H3LAB_HELLO_SLEEP", "0")))  # lets tests exercise the launcher's timeout
    got = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(got, torch.tensor([float(rank)]))
    pids = [os.getpid(), os.getppid()]
    listening = sorted(
        {
            f"{c.laddr.ip}:{c.laddr.port}"
            for pid in pids
            for c in psutil.Process(pid).net_connections("tcp")
            if c.status == "LISTEN"
        }
    )
    record = {"rank": rank, "world": world, "gathered": [float(g) for g in got], "listening": listening}
    write_json(out / f"rank{rank}.json", record, indent=None)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
