"""Run folders: one writer per folder, a final state in every record, and "stale" for an orphaned one.

A run claims its folder by creating `owner.json` with O_CREAT | O_EXCL: of two runs given the same
folder at the same moment exactly one creates the file, and the other is refused before it writes
anything. The folder may be new or an empty existing one; anything else in it is refused (nothing a
user wrote is overwritten or mixed with another run's files).

`owner.json` (and the `owner` entry of a run's status record) names the process that writes the
folder: host, pid and the process's start time (a reused pid has another start time), the run
token its child processes carry. A record that still says "running" while that process is gone
reads as "stale": its runner was killed without a chance to write its final state (SIGKILL, a
machine that went down). Only a reader on the same host can tell; elsewhere it reads "running".
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import psutil

OWNER_NAME = "owner.json"
FINAL_STATES = ("passed", "failed", "interrupted")
_START_TIME_SLACK_S = 0.01  # psutil's start time is a float from clock ticks: equal for one process


def owner_record(**extra: Any) -> dict[str, Any]:
    """This process as the owner of a run folder: host, pid, start time, command, plus `extra`."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "create_time": psutil.Process().create_time(),
        "started": time.time(),
        "argv": list(sys.argv),
        **extra,
    }


def owner_gone(owner: dict[str, Any] | None) -> bool:
    """Whether the owner process of a record is gone; False when that cannot be told from here
    (another host, or no owner recorded)."""
    if not owner or owner.get("host") != socket.gethostname() or "pid" not in owner:
        return False
    try:
        started = psutil.Process(int(owner["pid"])).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return True
    except psutil.AccessDenied:
        return False
    return abs(started - float(owner.get("create_time", started))) > _START_TIME_SLACK_S


def effective_status(record: dict[str, Any]) -> str:
    """The record's `status`; "stale" when it says "running" and its owner is gone."""
    status = str(record.get("status", "incomplete"))
    if status == "running" and owner_gone(record.get("owner")):
        return "stale"
    return status


def describe_status(record: dict[str, Any], where: Path) -> str:
    """One line on a run folder that is not finished, for refusals: what it says and why."""
    status = effective_status(record)
    owner = record.get("owner") or {}
    who = f"pid {owner.get('pid')} on {owner.get('host')}" if owner else "an unrecorded process"
    if status == "stale":
        return (
            f"{str(where)!r} is stale: it says 'running' but its runner ({who}) is gone without "
            "writing a final state (killed by SIGKILL, or its machine went down)"
        )
    if status == "running":
        return f"{str(where)!r} is still running ({who})"
    error = f": {record['error']}" if record.get("error") else ""
    return f"{str(where)!r} is {status}{error}"


def check_target(out: Path, flag: str = "--out") -> None:
    """Refuse a path that cannot become a run folder: a file, a dangling link, an unwritable place.

    Raises:
        ValueError: naming the path and what is allowed.
    """
    allowed = "allowed: a new folder, or an empty one, in a writable place"
    if out.is_symlink() and not out.exists():
        raise ValueError(f"{flag} {str(out)!r} is a dangling link (to {os.readlink(out)!r}); {allowed}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {str(out)!r} is a file, not a folder; {allowed}")


def claim(out: Path, *, flag: str = "--out", **extra: Any) -> dict[str, Any]:
    """Create `out` (or take an empty existing folder) for one run; returns the owner record written.

    Raises:
        ValueError: `out` is a file, a dangling link, unwritable or not empty, or another run
            claimed it first; nothing in `out` is changed then.
    """
    out = Path(out)
    check_target(out, flag)
    try:
        out.mkdir(parents=True, exist_ok=True)
        entries = sorted(p.name for p in out.iterdir())
    except OSError as err:
        raise ValueError(f"{flag} {str(out)!r}: cannot create it ({err.strerror}); allowed: a writable place") from None
    if entries:
        raise ValueError(_busy(out, entries, flag))
    record = owner_record(**extra)
    try:
        fd = os.open(out / OWNER_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ValueError(
            f"{flag} {str(out)!r} was claimed by another run at the same moment; choose a new folder"
        ) from None
    except OSError as err:
        raise ValueError(
            f"{flag} {str(out)!r}: cannot write in it ({err.strerror}); allowed: a writable folder"
        ) from None
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(record, indent=1, default=str) + "\n")
    return record


def read_record(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`; None when it is missing, half-written or not an object."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(Path(path).read_text())
        return record if isinstance(record, dict) else None
    return None


def _busy(out: Path, entries: list[str], flag: str) -> str:
    for name in ("summary.json", "sweep.json"):  # a run folder: say what state it is in
        record = read_record(out / name)
        if record is not None:
            return f"{flag} {describe_status(record, out)}; it is never overwritten: choose a new folder"
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    return f"{flag} {str(out)!r} is not empty (holds {shown}); allowed: a new or empty folder"
