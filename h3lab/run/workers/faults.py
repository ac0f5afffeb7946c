"""Faults a test injects into a worker: `H3LAB_FAULT=<kind>:<who>` (never set by h3lab itself).

`who` is a rank number, or `canonical` for the canonical process. Kinds:
  raise  raise a RuntimeError
  hang   sleep (the heartbeat keeps beating: a live process that makes no progress)
  kill   SIGKILL itself (dies without a word)
  stop   SIGSTOP itself inside its next collective, after announcing it (the whole process stops,
         heartbeat included: what a GPU hang or a stopped process looks like from outside)
  flip   `flip:<rank>:<op>:<flat index>`: one bit of a traced op's output on one rank (the lowest
         mantissa bit, one ULP), which the rank goes on with: a silent corruption for the
         first-divergence finder to name (`planted_flip`; a traced run only)
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

FAULT_VAR = "H3LAB_FAULT"
KINDS = ("raise", "hang", "kill", "stop", "flip")


def inject(who: str, on_call: Callable[[str], None] | None = None) -> Callable[[str], None] | None:
    """Inject the fault aimed at `who`, if any. Returns the collective hook (`DistComm.on_call`) to use
    from here on: for `stop`, `on_call` then a SIGSTOP (the process stops right after announcing the
    next site); otherwise `on_call` itself."""
    kind, _, target = os.environ.get(FAULT_VAR, "").partition(":")
    if not kind or kind == "flip" or target != who:  # a flip is planted by the trace (planted_flip)
        return on_call
    if kind not in KINDS:
        raise ValueError(f"{FAULT_VAR} kind {kind!r}; allowed: {list(KINDS)}")
    print(f"{FAULT_VAR}: injecting {kind!r} on {who}", flush=True)
    if kind == "raise":
        raise RuntimeError(f"injected fault on {who}")
    if kind == "hang":
        time.sleep(3600)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if on_call is None:
        return None

    def call_then_stop(site: str) -> None:
        on_call(site)
        os.kill(os.getpid(), signal.SIGSTOP)

    return call_then_stop


def planted_flip(who: str) -> tuple[str, int] | None:
    """(traced op name, flat index) of a `flip:<who>:<op>:<index>` fault aimed at `who`, else None.

    Raises:
        ValueError: a flip fault that does not have that form.
    """
    kind, _, rest = os.environ.get(FAULT_VAR, "").partition(":")
    if kind != "flip":
        return None
    parts = rest.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1] or not parts[2].isdigit():
        raise ValueError(f"{FAULT_VAR}=flip:{rest}; allowed: flip:<rank>:<traced op>:<flat index>")
    target, op, index = parts
    return (op, int(index)) if target == who else None
