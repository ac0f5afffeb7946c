"""The safetensors writer of run records: a tensor file reaches its path whole or not at all.

Like `write_json`: the bytes go to a uniquely named sibling temp file, then `os.replace` swaps it
in. A write that fails (a full disk) leaves no partial file behind and frees what it had taken.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import Tensor


def write_tensors(path: str | Path, tensors: dict[str, Tensor]) -> Path:
    """Write `tensors` (contiguous CPU copies are made) to `path` atomically; returns the path.

    Raises:
        OSError: the write failed (a full disk: errno ENOSPC), naming the path; safetensors' own
            error (SafetensorError, which is no OSError) carries the errno in its text only.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)
    except SafetensorError as err:
        found = re.search(r"os error (\d+)", str(err))
        code = int(found[1]) if found else errno.EIO
        raise OSError(code, os.strerror(code) if found else str(err), str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path
