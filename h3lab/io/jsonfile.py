"""The one JSON writer: a record reaches its path whole or not at all.

Every record h3lab writes (run summaries, rank records, manifests, benchmark results) goes through
`write_json`: the bytes go to a uniquely named sibling temp file, then `os.replace` swaps it in, so
a reader (a runner polling a status file, a notebook, a second process) never sees half a record,
and two writers of the same path never interleave.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def write_json(path: str | Path, record: Any, *, indent: int | None = 1, sort_keys: bool = False) -> Path:
    """Write `record` as JSON to `path` atomically (a sibling temp file, then os.replace).

    Values JSON cannot hold (paths, numpy scalars) are written as their `str`. Returns the path.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=indent, sort_keys=sort_keys, default=str) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
