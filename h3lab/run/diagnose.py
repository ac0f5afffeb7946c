"""Who failed: the rank (or the torchrun agent) a failed launch is blamed on, from the files it left.

Every rank writes a status (running / done / error / terminated, with its count of collective
calls and the site of the last one) and a heartbeat (the time, every 0.2 s from a thread that keeps
beating while the main thread waits inside a collective). The rules, in order:

1. An agent killed by a signal, or one that failed before any rank started (its port taken, a bad
   endpoint), is blamed itself, with its own log `agent<N>.log`.
2. A launch that timed out with no rank reporting an error: a rank whose heartbeat stopped well
   before the others' is the one that stopped (SIGSTOP, a frozen process: the others kept beating
   while they waited for it); else the rank with the fewest collective calls (the others wait for
   it inside one).
3. Otherwise every failed rank gets an event time (when it raised; for a rank that died without a
   word, its last heartbeat) and the earliest event is the root cause; the others are collateral.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

from h3lab.launch.launcher import LaunchResult

# A heartbeat this much older than the freshest one stopped while the others still ran: far above
# the beat period and a loaded machine's scheduling delays, far below any useful --timeout.
STALE_BEAT_S = 5.0
_ERROR_LINE = re.compile(r"(Error|Exception|error:|failed)")


def diagnose(d: Path, world: int, res: LaunchResult) -> dict[str, Any]:
    """The failure record of a launch that did not succeed: who, why, which log, every rank's state."""
    status = {r: _read(d / f"rank{r}.status.json", json.loads, {"state": "never started"}) for r in range(world)}
    beat = {r: _read(d / f"rank{r}.heartbeat", float, float("-inf")) for r in range(world)}
    states = {r: s["state"] for r, s in status.items()}
    raised = any(s == "error" for s in states.values())  # an error explains a timeout better than a beat
    blame = _blame_agent(res, states) or (_blame_timeout(status, beat, res) if res.timed_out and not raised else None)
    blame = blame or _blame_earliest(status, beat, res)
    return blame | {"states": states}


def _blame_agent(res: LaunchResult, states: dict[int, str]) -> dict[str, Any] | None:
    none_started = all(s == "never started" for s in states.values())
    for log, code in zip(res.agent_logs, res.agent_codes, strict=False):
        agent = _agent_index(log)
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            reason = f"agent {agent} was killed by {name}; its ranks stopped with it"
            return {"rank": None, "agent": agent, "reason": reason, "log": str(log)}
        if code not in (None, 0) and none_started:
            reason = f"agent {agent} exited with code {code} before starting any rank: {_last_error(log)}"
            return {"rank": None, "agent": agent, "reason": reason, "log": str(log)}
    if res.timed_out and none_started and res.agent_logs:
        log = res.agent_logs[0]
        reason = f"no rank started within {res.elapsed_s:.0f} s (rendezvous never completed?): {_last_error(log)}"
        return {"rank": None, "agent": _agent_index(log), "reason": reason, "log": str(log)}
    return None


def _blame_timeout(status: dict[int, dict], beat: dict[int, float], res: LaunchResult) -> dict[str, Any] | None:
    log = lambda r: str(res.agent_logs[0].parent / f"rank{r}.log")  # noqa: E731
    # ranks that were still running when the time ran out (the runner's kill marks them "terminated")
    started = {r: t for r, t in beat.items() if t > float("-inf") and status[r]["state"] in ("running", "terminated")}
    if started:
        freshest = max(started.values())
        stopped = [r for r, t in started.items() if freshest - t > STALE_BEAT_S]
        if stopped:
            r = min(stopped, key=started.__getitem__)
            calls, site = status[r].get("calls", 0), status[r].get("site", "")
            reason = (
                f"stopped: its heartbeat stopped {freshest - started[r]:.0f} s before the others' while they "
                f"waited for it, after step {calls} ({site!r}): a stopped (SIGSTOP) or frozen process"
            )
            return {"rank": r, "reason": reason, "log": log(r)}
    # the runner's kill after the timeout marks ranks "terminated"; their progress is what counts
    running = [r for r, s in status.items() if s["state"] in ("running", "never started", "terminated")]
    if not running:
        return None
    r = min(running, key=lambda r: status[r].get("calls", -1))
    calls, site = status[r].get("calls", 0), status[r].get("site", "")
    reason = f"hung: still running after {res.elapsed_s:.0f} s, stuck after step {calls} ({site!r})"
    return {"rank": r, "reason": reason, "log": log(r)}


def _blame_earliest(status: dict[int, dict], beat: dict[int, float], res: LaunchResult) -> dict[str, Any]:
    log = lambda r: str(res.agent_logs[0].parent / f"rank{r}.log")  # noqa: E731
    events = []
    for r, s in status.items():
        if s["state"] == "error":
            events.append((s["time"], r, f"raised {s['error']}"))
        elif s["state"] == "terminated" and s.get("reason"):
            events.append((s["time"], r, f"terminated: {s['reason']}"))
        elif s["state"] == "running":  # started (a status exists); no heartbeat yet: died at once
            reason = (
                "killed: the process died without reporting (a signal such as SIGKILL, a crash, or the "
                "agent stopping a rank blocked in a collective)"
            )
            events.append((beat[r], r, reason))
    if events:
        _, r, reason = min(events)
        return {"rank": r, "reason": reason, "log": log(r)}
    agent_log = res.agent_logs[0]
    reason = f"torchrun exited with {res.returncode} and no rank reported a failure: {_last_error(agent_log)}"
    return {"rank": None, "agent": _agent_index(agent_log), "reason": reason, "log": str(agent_log)}


def _agent_index(log: Path) -> int:
    digits = Path(log).stem.removeprefix("agent")
    return int(digits) if digits.isdigit() else 0


def _last_error(log: Path) -> str:
    """The last line of a log that reads like an error (else its last line), shortened."""
    lines = [line.strip() for line in _read(Path(log), str, "").splitlines() if line.strip()]
    found = next((line for line in reversed(lines) if _ERROR_LINE.search(line)), lines[-1] if lines else "")
    return (found[:300] + " ...") if len(found) > 300 else (found or "its log is empty")


def _read(path: Path, parse, default):
    """A status, heartbeat or log file; a missing or half-written one (the writer died mid-write) is `default`."""
    try:
        return parse(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return default
