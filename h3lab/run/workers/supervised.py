"""What every rank process of a run does around its work: where its output goes, its status file,
its heartbeat, and how it ends (h3lab.run.workers.rank for `h3lab run`, .script for `h3lab compare`).

A rank writes into its folder rank{r}.log (stdout and stderr), rank{r}.status.json (running with the
progress' last site and call count, then done, error with the traceback, or terminated naming the
signal or the launcher that is gone) and rank{r}.heartbeat (the time, every HEARTBEAT_S from a
thread), so h3lab.run.diagnose names a failing or hung rank the same way for both.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from h3lab.io.jsonfile import write_json
from h3lab.launch.lifeline import watch
from h3lab.run.progress import Progress

HEARTBEAT_S = 0.2
Work = Callable[[int, int, Progress], dict[str, Any]]  # (rank, world, progress) -> the done record's fields


def supervised_rank(out_dir: Path, work: Work) -> int:
    """Run `work` as this torchrun rank (RANK, WORLD_SIZE) writing into `out_dir`; the exit status:
    0 with the status "done" and `work`'s fields, 1 with "error" and the traceback."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    status = out_dir / f"rank{rank}.status.json"
    _redirect_output(out_dir / f"rank{rank}.log")
    progress = Progress(status)

    def on_term(signum: int, _frame: object) -> None:  # the agent or the runner stops us
        record = {"state": "terminated", "signal": signum, "time": time.time(), "calls": progress.calls}
        write_json(status, record | {"site": progress.site})
        os._exit(128 + signum)

    def on_launcher_gone(pid: int) -> None:  # a thread: also ends a rank blocked in a collective
        record = {"state": "terminated", "reason": f"its launcher (pid {pid}) is gone", "time": time.time()}
        write_json(status, record | {"calls": progress.calls, "site": progress.site})
        os._exit(1)

    _take_sigterm_in_a_thread(on_term)
    watch(on_launcher_gone, parent_signal=signal.SIGKILL)  # SIGKILL: also ends a rank stuck in C++
    progress.tick("start")
    _start_heartbeat(out_dir / f"rank{rank}.heartbeat")
    try:
        done = work(rank, world, progress)
    except BaseException as err:
        error = f"{type(err).__name__}: {err}"
        write_json(status, {"state": "error", "error": error, "time": time.time(), "traceback": traceback.format_exc()})
        traceback.print_exc()
        return 1
    write_json(status, {"state": "done", "time": time.time()} | done)
    return 0


def _redirect_output(log: Path) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1), os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)


def _start_heartbeat(path: Path) -> None:
    """Write the time every HEARTBEAT_S from a thread; it keeps beating while the main thread waits in
    a collective (torch releases the GIL there), so the rank whose beat stopped first died first."""

    def beat() -> None:
        while True:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(repr(time.time()))
            tmp.replace(path)
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, daemon=True, name="h3lab-heartbeat").start()


def _take_sigterm_in_a_thread(on_term: Callable[[int, object], None]) -> None:
    """SIGTERM (torchrun stopping its ranks after one failed, or the runner's sweep) runs `on_term` at
    once, also while the main thread is blocked in a collective. Python runs a handler in the main
    thread between bytecodes only, so a rank waiting in gloo's C++ took SIGTERM when the collective
    returned, or never: torchrun waited its grace period and sent SIGKILL. Python's C-level handler
    also writes the signal's number to the wakeup fd, whichever thread the signal lands on; a thread
    reading that fd runs `on_term`. No signal mask changes, so processes the rank starts (a compiler)
    take SIGTERM as usual."""
    signal.signal(signal.SIGTERM, on_term)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def wait() -> None:
        while True:
            if signal.SIGTERM in os.read(read_fd, 64):
                on_term(signal.SIGTERM, None)

    threading.Thread(target=wait, daemon=True, name="h3lab-sigterm").start()
