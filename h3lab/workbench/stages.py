"""Resumable stages in one work folder: what `h3lab publish` has done so far, and each stage's output.

WORK/stages.json holds the owner (one publish per work folder at a time; a record whose owner is
gone reads as stale and is taken over) and, per stage, its state: done, failed, skipped (with the
reason), interrupted or running, the seconds it took and where its output is. A done stage is kept
by the next call; any other is run again. Every attempt writes a new path (WORK/<stage>-<k>, then
the caller's suffix), so a rerun never overwrites what an earlier attempt left.

Commands run in a session of their own: on a timeout, Ctrl-C or any error the whole process group
is killed before the stage's state is written, so no process outlives its stage.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from h3lab.io.jsonfile import write_json
from h3lab.io.rundir import check_unpublished, describe_end, owner_gone, owner_record, read_record

BOOK = "stages.json"
STATES = ("done", "failed", "skipped", "interrupted", "running")


class StageBook:
    """The stages of one work folder; `claim` it before running any."""

    def __init__(self, work: str | Path) -> None:
        self.work = Path(work).resolve()
        self.path = self.work / BOOK
        self.record: dict[str, Any] = {}

    def claim(self, plan: dict[str, Any]) -> None:
        """Take the work folder for this process (`plan`: what is published, recorded beside the stages).

        Raises:
            ValueError: another live process holds it, it holds a publish of another plan, it holds
                files but no stages.json (not a work folder: nothing is mixed into it), or it lies
                inside the published reports.
        """
        check_unpublished(self.work, "--work")
        if self.work.exists() and not self.path.is_file() and (not self.work.is_dir() or any(self.work.iterdir())):
            what = f"holds {sorted(p.name for p in self.work.iterdir())[:5]}" if self.work.is_dir() else "is a file"
            raise ValueError(
                f"--work {str(self.work)!r} {what} and no {BOOK}: not a publish work folder; allowed: a new or "
                "empty folder, or one an earlier publish made"
            )
        self.work.mkdir(parents=True, exist_ok=True)
        old = read_record(self.path) or {}
        owner = old.get("owner")
        if owner and not old.get("released") and not owner_gone(owner):
            raise ValueError(
                f"work folder {str(self.work)!r} is in use by pid {owner.get('pid')} on {owner.get('host')}; "
                "allowed: another --work folder, or wait for it"
            )
        if old.get("plan") and old["plan"] != plan:
            raise ValueError(
                f"work folder {str(self.work)!r} holds a publish of {old['plan']}, not {plan}; allowed: a new --work"
            )
        stages = old.get("stages", {})
        for rec in stages.values():  # its owner is gone: a stage it left running was cut short
            if rec.get("state") == "running":
                rec.update(state="interrupted", error="its publish stopped without a final state")
        self.record = {"plan": plan, "owner": owner_record(), "released": False, "stages": stages}
        self._save()

    def release(self) -> None:
        self.record["released"] = True
        self._save()

    def state(self, name: str) -> dict[str, Any]:
        return self.record["stages"].get(name, {})

    def done(self, name: str) -> bool:
        return self.state(name).get("state") == "done"

    def attempt(self, name: str, suffix: str = "") -> Path:
        """A path no earlier attempt of `name` used: WORK/<name>-<k><suffix>."""
        k = self.state(name).get("attempts") or 1  # `run` counts this attempt before calling its stage
        while (self.work / f"{name}-{k}{suffix}").exists():
            k += 1
        return self.work / f"{name}-{k}{suffix}"

    def run(self, name: str, fn: Callable[[], dict[str, Any]], *, redo: bool = False) -> dict[str, Any]:
        """Run stage `name` unless done (or `redo`); `fn` returns its record, whose "state" is final.

        An exception marks the stage failed (interrupted for Ctrl-C and signals) and is raised again.
        """
        if self.done(name) and not redo:
            return self.state(name) | {"kept": True}
        attempts = self.state(name).get("attempts", 0) + 1
        self._set(name, {"state": "running", "started": time.time(), "attempts": attempts})
        start = time.monotonic()
        try:
            rec = fn()
        except (KeyboardInterrupt, SystemExit) as err:
            self._set(name, {"state": "interrupted", "error": describe_end(err), "attempts": attempts})
            raise
        except BaseException as err:
            self._set(name, {"state": "failed", "error": describe_end(err), "attempts": attempts})
            raise
        assert rec.get("state") in ("done", "failed", "skipped"), rec
        rec = rec | {"attempts": attempts, "seconds": round(time.monotonic() - start, 1), "finished": time.time()}
        self._set(name, rec)
        return rec

    def _set(self, name: str, rec: dict[str, Any]) -> None:
        self.record["stages"][name] = rec
        self._save()

    def _save(self) -> None:
        write_json(self.path, self.record)


def run_command(argv: list[str], log: Path, *, timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """Run `argv` in its own session, stdout and stderr to `log`; end its whole process group before
    returning or raising: on a timeout or any exception here (Ctrl-C, a signal) SIGTERM, then SIGKILL;
    after a normal exit SIGKILL to whatever the command left running (a stage's processes end with it).

    Returns:
        {"returncode": int, "timed_out": bool, "log": str}
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, timed_out = proc.returncode, True
        except BaseException:
            _kill_group(proc)
            raise
        _end_group(proc)  # the group outlives its leader where a member is still running
    return {"returncode": rc, "timed_out": timed_out, "log": str(log)}


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the group, 10 s for the leader to end, then SIGKILL to every member still there."""
    _signal_group(proc, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)
    _end_group(proc)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)


def _end_group(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILL to the group, then wait until none of its members runs: a killed process is gone only
    once the kernel has torn it down, which a busy machine can take a moment to do (a zombie left for
    its new parent to reap runs nothing and is not waited for)."""
    _signal_group(proc, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while _live_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _live_members(pgid: int) -> list[int]:
    live = []
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ProcessLookupError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                live.append(p.pid)
    return live


def log_tail(path: str | Path, lines: int = 5) -> str:
    """The last lines of a log, for a failed stage's one-line record."""
    try:
        return " | ".join(Path(path).read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""
