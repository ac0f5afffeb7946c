"""One rank of `h3lab compare`: the user's own script, run in this process under a recording session.

Launched only by h3lab.run.compare through h3lab.launch.launcher: `python -m h3lab.run.workers.script SPEC.json`.
SPEC names the layout (also in H3LAB_LAYOUT, which `h3lab.current_layout()` reads), the command
(`python SCRIPT ARGS` or `python -m MODULE ARGS`, run here with `runpy` as `__main__`, sys.argv as the
script would see it) and the folder. The rank writes there what every rank writes
(h3lab.run.workers.supervised: rank{r}.log, rank{r}.status.json, which the parallelized model's
collectives and every `h3lab.record` tick, rank{r}.heartbeat), and after the script returns rank{r}.records.safetensors
with rank{r}.records.json (h3lab.nn.recording: what it recorded, in call order). A script that exits
with a non-zero status fails the rank; a process group it left open is destroyed. A rank exits when
its agent or its runner is gone (h3lab.launch.lifeline), saying so in its status.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch.distributed as dist

from h3lab.nn.recording import end_session, start_session
from h3lab.parallel.layout import Layout
from h3lab.run.progress import Progress
from h3lab.run.workers.supervised import supervised_rank


def run_rank(spec: dict) -> int:
    return supervised_rank(Path(spec["dir"]), lambda rank, world, progress: _run_script(spec, world, progress))


def _run_script(spec: dict, world: int, progress: Progress) -> dict:
    layout = Layout.parse(spec["layout"])
    if layout.world != world:
        raise ValueError(f"torchrun started {world} ranks for layout {layout.name}; allowed: {layout.world}")
    session = start_session(progress.tick)
    _run_command(spec["command"])
    session.recorder.save(Path(spec["dir"]) / f"rank{int(os.environ['RANK'])}.records")
    end_session()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return {"records": len(session.recorder.entries)}


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
