"""A rank's status file while it runs: its collective calls counted, so a hang can name the straggler.

The run owns its status files (rank{r}.status.json, h3lab.run.workers.rank); the layout package
only calls a hook before each collective (`DistComm.on_call`), which a rank points at `Progress.tick`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class Progress:
    """Counts this rank's collective calls into a status file, so a hang can name the straggler.

    A tick runs inside the block step, at every collective: it overwrites one fixed-size record of
    a file it keeps open (os.pwrite, no open, truncate or rename per call, which cost milliseconds
    of host time per call on some filesystems). The record is JSON padded with spaces, so each
    write covers the last one whole. A writer that replaces the file (the rank's final status,
    written atomically) gives the path a new file; later ticks go to the old one and never
    overwrite that status.
    """

    RECORD_BYTES = 256

    def __init__(self, path: Path | None) -> None:
        self.path, self.calls, self.site = path, 0, ""
        self._fd: int | None = None

    def tick(self, site: str) -> None:
        self.calls, self.site = self.calls + 1, site
        if self.path is None:
            return
        record = json.dumps({"state": "running", "calls": self.calls, "site": site[:160]}).encode()
        if len(record) > self.RECORD_BYTES:  # a site of escaped characters: its start is enough
            record = json.dumps({"state": "running", "calls": self.calls, "site": site[:16]}).encode()
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, record.ljust(self.RECORD_BYTES), 0)

    def close(self) -> None:
        """Close the status file (the record written last stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
