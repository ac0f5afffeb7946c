"""One rank of `h3lab compare`: the user's own script, run in this process under a recording session.

Launched only by h3lab.run.compare through h3lab.launch.launcher: `python -m h3lab.run.workers.script SPEC.json`.
SPEC names the layout (also in H3LAB_LAYOUT, which `h3lab.current_layout()` reads), the command
(`python SCRIPT ARGS` or `python -m MODULE ARGS`, run here with `runpy` as `__main__`, sys.argv as the
script would see it) and the folder. The rank writes there, as a rank of `h3lab run` does (so
h3lab.run.diagnose names a failing rank the same way): rank{r}.log (stdout and stderr),
rank{r}.status.json (running / done / error / terminated; the parallelized model's collectives and
every `h3lab.record` tick it), rank{r}.heartbeat, and after the script returns rank{r}.records.safetensors
with rank{r}.records.json (h3lab.nn.recording: what it recorded, in call order). A script that exits
with a non-zero status fails the rank; a process group it left open is destroyed. A rank exits when
its agent or its runner is gone (h3lab.launch.lifeline), saying so in its status.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from h3lab.io.jsonfile import write_json
from h3lab.launch.lifeline import watch
from h3lab.nn.recording import end_session, start_session
from h3lab.parallel.layout import Layout
from h3lab.run.progress import Progress
from h3lab.run.workers.rank import _redirect_output, _start_heartbeat, _take_sigterm_in_a_thread


def run_rank(spec: dict) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_dir = Path(spec["dir"])
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
    watch(on_launcher_gone, parent_signal=signal.SIGKILL)
    progress.tick("start")
    _start_heartbeat(out_dir / f"rank{rank}.heartbeat")
    try:
        layout = Layout.parse(spec["layout"])
        if layout.world != world:
            raise ValueError(f"layout {layout.name} needs {layout.world} ranks, torchrun started {world}")
        session = start_session(progress.tick)
        _run_command(spec["command"])
        session.recorder.save(out_dir / f"rank{rank}.records")
        end_session()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as err:
        error = f"{type(err).__name__}: {err}"
        write_json(status, {"state": "error", "error": error, "time": time.time(), "traceback": traceback.format_exc()})
        traceback.print_exc()
        return 1
    write_json(status, {"state": "done", "time": time.time(), "records": len(session.recorder.entries)})
    return 0


def _run_command(command: list[str]) -> None:
    """`python SCRIPT ARGS` or `python -m MODULE ARGS` in this process, as `__main__`.

    Raises:
        ValueError: the script exited with a non-zero status (or a message).
    """
    args = command[1:]
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path.insert(0, str(Path(args[0]).parent))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise ValueError(f"the script exited with status {stop.code!r}") from None
    finally:
        sys.argv, sys.path = saved_argv, saved_path


def main(argv: list[str]) -> int:
    return run_rank(json.loads(Path(argv[0]).read_text()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
