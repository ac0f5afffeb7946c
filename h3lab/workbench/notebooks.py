"""The notebooks: jupytext py:percent sources -> ipynb -> papermill execution into a run directory.

The sources in notebooks/ carry no outputs; an executed copy is a run artefact (runs/<id>/<name>.ipynb).
A bad parameter stops the notebook in its first cell after `parameters` (a ValueError naming the
value and the allowed set); `execute` turns papermill's error into a `NotebookError` that says the
cell, the message and where the executed notebook is. While the reproduce notebook runs, the parent
shows a tqdm bar over the sweep's (mode, seed, layout) runs, read from the runner's summary.json
files, and prints each failure's layout, rank and log as it happens. Ctrl-C, SIGTERM or SIGHUP
during an execution kills its kernel before they unwind (the launched workers follow their kernel),
so a stopped notebook leaves no process behind and its caller can mark the run interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nbformat
from tqdm import tqdm

from h3lab.io.env import REPO
from h3lab.io.jsonfile import write_json
from h3lab.run.summary import failure_line

NOTEBOOKS_DIR = REPO / "notebooks"
NOTEBOOKS = ("reproduce", "explore", "report", "your_code")
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
START_TIMEOUT_S = 120  # a kernel on a loaded 2-core machine took up to ~20 s to start; 60 s (papermill's) is tight
KILL_WAIT_S = 30.0  # after killing the kernel: nbclient notices a dead kernel within a few seconds


def _ipc_kernel_manager() -> type:
    """A KernelManager on IPC sockets: no TCP ports to race for when tests start kernels back to back
    (papermill#511: "Address already in use"), and no unencrypted-TCP warning from ipykernel 7. The
    sockets live in a folder of their own per kernel: by default they are kernel-ipc-<n> in the working
    directory, where two executions picking <n> at once talk to each other's kernel ("Invalid
    Signature"), and where a killed kernel leaves them behind."""
    from jupyter_client.manager import KernelManager
    from traitlets import default

    class IPCKernelManager(KernelManager):
        @default("transport")
        def _default_transport(self) -> str:
            return "ipc"

        @default("ip")
        def _default_ip(self) -> str:
            return os.path.join(tempfile.mkdtemp(prefix="h3lab-kernel-"), "ipc")

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            _KERNELS.add(self)

    return IPCKernelManager


_KERNELS: weakref.WeakSet = weakref.WeakSet()  # the kernel managers papermill made in this process


def _remove_socket_folders() -> None:
    """The socket folders of kernels that are gone (a live one keeps its own)."""
    for km in list(_KERNELS):
        if km.transport == "ipc" and not km.is_alive():
            shutil.rmtree(os.path.dirname(km.ip), ignore_errors=True)


def _kill_kernels() -> None:
    """SIGKILL every kernel this process started; the runner's workers follow theirs (h3lab.launch.lifeline)."""
    for km in list(_KERNELS):
        pid = getattr(getattr(km, "provisioner", None), "pid", None)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class NotebookError(RuntimeError):
    """A notebook stopped: `cell` (index), `ename`, `evalue` and the executed notebook's `path`."""

    def __init__(self, name: str, cell: int, ename: str, evalue: str, path: Path) -> None:
        short = evalue if len(evalue) <= 400 else evalue[:400] + " ..."  # the whole message is in the notebook
        super().__init__(f"{name} stopped in cell {cell}: {ename}: {short} (executed notebook: {path})")
        self.cell, self.ename, self.evalue, self.path = cell, ename, evalue, path


def source(name: str) -> Path:
    """notebooks/<name>.py; ValueError for an unknown name."""
    if name not in NOTEBOOKS:
        raise ValueError(f"unknown notebook {name!r}; allowed: {list(NOTEBOOKS)}")
    return NOTEBOOKS_DIR / f"{name}.py"


def to_notebook(name: str) -> nbformat.NotebookNode:
    """The jupytext source as an ipynb node with the native `python3` kernelspec (no outputs)."""
    import jupytext

    nb = jupytext.read(source(name), fmt="py:percent")
    nb.metadata["kernelspec"] = dict(KERNELSPEC)  # a custom name fails with NoSuchKernel on fresh machines
    return nb


def parameters_cell(nb: nbformat.NotebookNode) -> int:
    """Index of the one cell tagged `parameters`; ValueError unless there is exactly one."""
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise ValueError(f"notebook has {len(tagged)} cells tagged 'parameters'; allowed: exactly 1")
    return tagged[0]


def execute(
    name: str, output: str | Path, parameters: dict[str, Any], *, timeout_s: float | None = None, progress: bool = False
) -> nbformat.NotebookNode:
    """Execute notebooks/<name>.py with papermill, writing the executed notebook to `output`.

    The kernel starts in the caller's working directory, so relative paths in `parameters` mean
    what they mean to the caller.

    Args:
        name: reproduce, explore, report or your_code.
        output: the executed notebook's path (saved after every cell, so a crash leaves a partial record).
        parameters: values injected after the `parameters` cell.
        timeout_s: per-cell limit (None: none; the runner has its own per-layout timeout).
        progress: papermill's per-cell bar (off when the caller draws a sweep bar).

    Raises:
        NotebookError: a cell raised; the executed notebook at `output` shows where.
    """
    import papermill as pm

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    nb = to_notebook(name)
    parameters_cell(nb)
    # the kernel inherits this: it silences a "frozen modules" debugger warning that ipykernel prints on 3.11
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    done: dict[str, Any] = {}

    def work() -> None:
        try:
            done["nb"] = pm.execute_notebook(
                nb,
                str(output),
                parameters=parameters,
                kernel_name="python3",
                progress_bar=progress,
                start_timeout=START_TIMEOUT_S,
                execution_timeout=timeout_s,
                kernel_manager_class=_ipc_kernel_manager(),
            )
        except BaseException as err:  # handed to the caller's thread below
            done["error"] = err

    _run_killing_kernels_on_signal(work, name)
    err = done.get("error")
    if isinstance(err, pm.PapermillExecutionError):
        raise NotebookError(name, err.cell_index, err.ename, err.evalue, output) from None
    if err is not None:
        raise err
    return done["nb"]


def _run_killing_kernels_on_signal(work: Callable[[], None], name: str) -> None:
    """Run `work` in a thread and wait for it; an exception in this thread (Ctrl-C, SIGTERM, SIGHUP) kills
    this process's kernels before it unwinds. The socket folders of gone kernels are removed either way."""
    # papermill waits on the kernel in a blocking poll that no signal interrupts: it runs in a thread,
    # so that Ctrl-C, SIGTERM or SIGHUP reach this one at once; the kernel is killed before they unwind
    thread = threading.Thread(target=work, name=f"papermill-{name}", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(timeout=0.2)
    except BaseException:
        _kill_kernels()
        thread.join(timeout=KILL_WAIT_S)
        raise
    finally:
        _remove_socket_folders()


def run_reproduce(run_dir: Path, params: dict[str, Any]) -> Any:
    """The reproduce notebook into `run_dir` (new or empty, claimed by the caller) with the progress bar;
    sweep.json ends failed or interrupted when the notebook stops short. Returns the `Sweep`.

    Raises:
        NotebookError: a cell raised (a bad parameter: ValueError, before any work).
    """
    from h3lab.io.rundir import describe_end
    from h3lab.workbench.rundata import load_sweep
    from h3lab.workbench.sweep import mark_ended

    params = dict(params) | {"run_dir": str(run_dir)}
    try:
        with sweep_progress(run_dir):
            execute("reproduce", run_dir / "reproduce.ipynb", params)
    except (KeyboardInterrupt, SystemExit) as err:  # the kernel is shut down with the notebook
        mark_ended(run_dir, "interrupted", describe_end(err))
        raise
    except NotebookError as err:
        mark_ended(run_dir, "failed", str(err))
        raise
    return load_sweep(run_dir)


@contextmanager
def sweep_progress(run_dir: Path, poll_s: float = 0.5) -> Iterator[tqdm]:
    """A tqdm bar in the parent over a sweep running in a kernel: it reads params.json for the plan and
    each <mode>/seed<s>/summary.json for finished layouts; failures are printed as they appear.
    Off a terminal (CI logs) the bar is off and each finished layout prints one line instead."""
    from h3lab.workbench.sweep import planned

    bar = tqdm(desc="starting kernel", unit="layout", file=sys.stderr, dynamic_ncols=True, disable=None)
    stop, seen, phase = threading.Event(), set(), ["starting kernel"]

    def describe(text: str) -> None:
        if phase[0] != text:  # setting it again would redraw the bar at every poll
            phase[0] = text
            bar.set_description(text)

    def poll() -> None:
        if bar.total is None and (run_dir / "params.json").is_file():
            try:
                bar.reset(total=len(planned(json.loads((run_dir / "params.json").read_text()))))
            except (json.JSONDecodeError, KeyError):  # half-written: the next poll reads it
                return
            describe("sweep")
        for path in sorted(run_dir.glob("*/seed*/summary.json")):
            try:
                summary = json.loads(path.read_text())
            except json.JSONDecodeError:
                continue
            mode, seed = summary["request"]["problem"]["mode"], summary["request"]["problem"]["seed"]
            for layout, rec in summary["layouts"].items():
                if (mode, seed, layout) in seen:
                    continue
                seen.add((mode, seed, layout))
                bar.update(1)
                bar.set_postfix_str(f"{mode} s{seed} {layout}: {rec['status']}")
                expected = mode == "baseline" and rec["status"] == "mismatch"  # the baseline's bits move
                line = None if expected else failure_line(layout, rec, f"{mode}, seed {seed}")
                if bar.disable:
                    print(f"[{len(seen)}/{bar.total}] {mode} seed {seed} {layout}: {rec['status']}", file=sys.stderr)
                if line:
                    tqdm.write(line, file=sys.stderr)
        if bar.total and len(seen) == bar.total:
            describe("accuracy, tables, figures")

    def loop() -> None:
        while not stop.wait(poll_s):
            poll()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()
        poll()
        bar.close()


def lab_settings() -> Path:
    """Make JupyterLab open notebooks/*.py as notebooks (jupytext): a settings override in the venv."""
    path = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    current = json.loads(path.read_text()) if path.is_file() else {}
    current["@jupyterlab/docmanager-extension:plugin"] = {"defaultViewers": {"python": "Jupytext Notebook"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, current)
    return path
