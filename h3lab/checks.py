"""Argument checks in program order whose device-side conditions are read back with one host sync.

A check of a device tensor's values (finite, in range, unique) reads a result back to the host: a
sync that drains the GPU's queue. `Checks` queues those conditions as 0-d bool tensors and reads
them all at `read()`; a host condition (a shape, a dtype) refuses at once, after reading what was
queued before it, so the first failing check in program order raises, as when each read at once.
A queued condition's message is made only when it fails (it may read values back to name them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class Checks:
    """ValueError("{name}: {message}") for the first failing check, in the order the checks were made."""

    def __init__(self) -> None:
        self._queued: list[tuple[Tensor, str, Callable[[], str]]] = []

    def host(self, ok: bool, name: str, message: str) -> None:
        """Refuse now unless `ok` (after the queued checks: an earlier one that fails comes first)."""
        if not ok:
            self.read()
            raise ValueError(f"{name}: {message}")

    def device(self, ok: Tensor, name: str, message: Callable[[], str]) -> None:
        """Queue `ok` (a 0-d bool tensor) for `read()`; `message()` is called only if it is False."""
        assert ok.numel() == 1 and ok.dtype == torch.bool, (ok.shape, ok.dtype)
        self._queued.append((ok.reshape(()), name, message))

    def read(self) -> None:
        """Read every queued condition with one host sync (they live on one device); refuse at the first False."""
        queued, self._queued = self._queued, []
        if not queued:
            return
        for ok, (_, name, message) in zip(torch.stack([q[0] for q in queued]).tolist(), queued, strict=True):
            if not ok:
                raise ValueError(f"{name}: {message()}")
