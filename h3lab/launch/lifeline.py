"""A launched process exits when the processes that launched it are gone.

The runner launches torchrun agents, an agent launches the ranks, and each of them would live on as
an orphan if its launcher died without cleaning up (SIGKILL, SIGHUP of a terminal, a crash). Every
launched process therefore watches its lifeline: the launcher chain, listed in `H3LAB_LIFELINE` as
`pid:start_time` entries (the runner's, then the agent's), each appended by the process that
launches the next. Two watches, because neither alone is enough:

- Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`): the kernel signals the process the
  moment its direct parent exits: SIGTERM to an agent (torchrun then stops its ranks), SIGKILL to a
  rank or the canonical process, which also ends one stuck in C++ with the GIL held (joining a
  process group), where no Python handler or thread can run;
- a watchdog thread polling every entry of the lifeline: it also sees a launcher further up the
  chain and works where prctl does not exist.

A stopped process (SIGSTOP) runs neither; the launcher's own kill sweep ends it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import psutil

LIFELINE_VAR = "H3LAB_LIFELINE"
POLL_S = 0.25
_PR_SET_PDEATHSIG = 1
_START_TIME_SLACK_S = 0.01


def entry(pid: int | None = None) -> str:
    """`pid:start_time` of a process (this one by default), as the lifeline lists it."""
    p = psutil.Process(pid)
    return f"{p.pid}:{p.create_time()!r}"


def extended(environ: dict[str, str] | os._Environ) -> str:
    """The lifeline of a process this one launches: the current one plus this process."""
    current = environ.get(LIFELINE_VAR, "")
    return ",".join(e for e in (current, entry()) if e)


def _parse(value: str) -> list[tuple[int, float]]:
    out = []
    for item in value.split(","):
        pid, _, started = item.partition(":")
        if pid.isdigit():
            out.append((int(pid), float(started or "nan")))
    return out


def _gone(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) > _START_TIME_SLACK_S
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return True
    except psutil.AccessDenied:
        return False


def _set_parent_death_signal(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def watch(on_gone: Callable[[int], None], *, parent_signal: int = signal.SIGTERM) -> None:
    """Watch this process's lifeline (no-op without one): `on_gone(pid)` runs in a thread when a
    launcher is gone, and must end the process; the direct parent's exit also sends `parent_signal`."""
    lifeline = _parse(os.environ.get(LIFELINE_VAR, ""))
    if not lifeline:
        return
    _set_parent_death_signal(parent_signal)

    def poll() -> None:  # the first pass also covers a launcher that died before prctl took effect
        while True:
            for pid, started in lifeline:
                if _gone(pid, started):
                    on_gone(pid)
                    return
            time.sleep(POLL_S)

    threading.Thread(target=poll, daemon=True, name="h3lab-lifeline").start()


def exit_now(code: int = 1) -> Callable[[int], None]:
    """An `on_gone` that ends the process at once (no cleanup: its launcher is gone)."""

    def gone(pid: int) -> None:
        print(f"h3lab lifeline: launcher pid {pid} is gone; exiting", file=sys.stderr, flush=True)
        os._exit(code)

    return gone


def terminate_then_exit(grace_s: float = 10.0, code: int = 1) -> Callable[[int], None]:
    """An `on_gone` that sends this process SIGTERM (its handlers stop its children), then exits
    after `grace_s` if it is still alive."""

    def gone(pid: int) -> None:
        print(f"h3lab lifeline: launcher pid {pid} is gone; stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(code)

    return gone
