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

A full disk must not cost a run its final state: a writer takes `RESERVE_BYTES` in `.reserve`
(`reserve_space`) once its first record is written, and `write_final` gives that space back when
the final record does not fit; failing that, a compact final record overwrites the existing record
in place, which needs no new blocks.
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

from h3lab.io.env import REPO
from h3lab.io.jsonfile import write_json

OWNER_NAME = "owner.json"
FINAL_STATES = ("passed", "failed", "interrupted")
_START_TIME_SLACK_S = 0.01  # psutil's start time is a float from clock ticks: equal for one process
RESERVE_NAME = ".reserve"
# Kept free on a run folder's disk until the final record is written; a final record that does
# not fit even then is replaced by its COMPACT_KEYS
RESERVE_BYTES = 1 << 20
# what a final record keeps when even the reserve cannot hold it (written over the old record)
COMPACT_KEYS = ("format", "status", "error", "owner", "started", "finished")


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


def published_root(path: str | Path) -> Path | None:
    """The published reports folder `path` is in or is, or None: an h3lab checkout's `reports/` (this
    checkout's, or a `reports` folder beside a pyproject.toml and an h3lab/ package). Only `h3lab
    publish` writes there, by swapping in a folder it built whole."""
    here = Path(path).expanduser().resolve()  # through links: a link into reports/ is inside it
    for d in (here, *here.parents):
        checkout = (d.parent / "pyproject.toml").is_file() and (d.parent / "h3lab").is_dir()
        if d.name == "reports" and (d == REPO / "reports" or checkout):
            return d
    return None


def check_unpublished(path: str | Path, flag: str) -> None:
    """Refuse `path` inside a published reports folder (`published_root`).

    Raises:
        ValueError: naming the path, the folder and what is allowed.
    """
    root = published_root(path)
    if root is not None:
        raise ValueError(
            f"{flag} {str(path)!r} is inside {str(root)!r}, the published reports, which only `h3lab publish` "
            "writes (a folder built whole, then swapped in); allowed: a folder outside it, e.g. under runs/"
        )


def check_target(out: Path, flag: str = "--out") -> None:
    """Refuse a path that cannot become a run folder: a file, a dangling link, an unwritable place, a
    place inside the published reports.

    Raises:
        ValueError: naming the path and what is allowed.
    """
    check_unpublished(out, flag)
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


def reserve_space(folder: Path) -> Path:
    """Take RESERVE_BYTES in `folder/.reserve` for the final record (`write_final` gives it back)."""
    path = Path(folder) / RESERVE_NAME
    with open(path, "wb") as fh:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fh.fileno(), 0, RESERVE_BYTES)
        else:
            fh.write(b"\0" * RESERVE_BYTES)
    return path


def write_final(path: Path, record: dict[str, Any]) -> Path:
    """Write a run's final record to `path` (atomically), even on a full disk; `.reserve` beside it
    is given back in any case.

    On a full disk the reserve is given back first and the write retried; failing that, the
    COMPACT_KEYS of `record` overwrite the existing record in place (padded with spaces).

    Raises:
        OSError: not even the compact record fits over the existing one (or there is none).
    """
    path = Path(path)
    reserve = path.parent / RESERVE_NAME
    try:
        write_json(path, record)
    except OSError:  # a full disk: the reserve makes room; failing that, the record shrinks into place
        reserve.unlink(missing_ok=True)
        try:
            write_json(path, record)
        except OSError:
            _overwrite_in_place(path, {k: record[k] for k in COMPACT_KEYS if k in record})
    reserve.unlink(missing_ok=True)
    return path


def describe_end(err: BaseException) -> str:
    """What ended a run, for its record's `error`: the exception, or the signal behind a SystemExit
    (the CLI turns SIGTERM and SIGHUP into SystemExit(128 + signal))."""
    if isinstance(err, SystemExit):
        return f"stopped by a signal (exit status {err.code})"
    if isinstance(err, KeyboardInterrupt):
        return "KeyboardInterrupt (Ctrl-C)"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _overwrite_in_place(path: Path, record: dict[str, Any]) -> None:
    """`record` over the bytes of the existing file at `path`, padded with spaces: no new blocks."""
    data = json.dumps(record, default=str).encode()
    size = path.stat().st_size
    if len(data) > size:
        raise OSError(f"{path}: the final record ({len(data)} bytes) does not fit the {size} bytes on disk")
    with open(path, "r+b") as fh:
        fh.write(data + b" " * (size - len(data)))


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
    if OWNER_NAME in entries:  # claimed, no record yet: a moment ago, or its runner died at once
        owner = read_record(out / OWNER_NAME)  # None while the claimer is still writing it
        gone = ", now gone" if owner_gone(owner) else ""
        who = f" (pid {owner.get('pid')} on {owner.get('host')}{gone})" if owner else ""
        return f"{flag} {str(out)!r} is claimed by another run{who}; choose a new folder"
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    return f"{flag} {str(out)!r} is not empty (holds {shown}); allowed: a new or empty folder"
