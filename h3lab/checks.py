"""Argument checks in program order whose device-side conditions are read back with one host sync.

A check of a device tensor's values (finite, in range, unique) reads a result back to the host: a
sync that drains the GPU's queue. `Checks` queues those conditions as 0-d bool tensors and reads
them all at `read()`; a host condition (a shape, a dtype) refuses at once, after reading what was
queued before it, so the first failing check in program order raises, as when each read at once.
A queued condition's message is made only when it fails (it may read values back to name them).

A check may be made once per tensor (`device_once`): where these very tensors, unwritten since
(torch's version counters), passed it before, it is not queued again. A request copied with some
fields replaced (a training step's noised sample) then checks only what changed: the unchanged
keys' uniqueness and the indices' partition are sorts on the device, ~100 launches a step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

# device checks passed, by (check key, extra, the tensors' ids): (weak references, version counters)
_PASSED: dict[tuple, tuple[tuple[weakref.ref, ...], tuple[int, ...]]] = {}


def _passed_before(key: tuple, tensors: tuple[Tensor, ...]) -> bool:
    hit = _PASSED.get(key)
    if hit is None or any(r() is not t for r, t in zip(hit[0], tensors, strict=True)):
        return False
    return hit[1] == tuple(t._version for t in tensors)


def _remember(key: tuple, tensors: tuple[Tensor, ...]) -> None:
    def gone(ref: weakref.ref) -> None:
        if any(r is ref for r in _PASSED.get(key, ((),))[0]):
            del _PASSED[key]

    _PASSED[key] = (tuple(weakref.ref(t, gone) for t in tensors), tuple(t._version for t in tensors))


class Checks:
    """ValueError("{name}: {message}") for the first failing check, in the order the checks were made."""

    def __init__(self) -> None:
        self._queued: list[tuple[Tensor, str, Callable[[], str]]] = []
        self._once: list[tuple[tuple, tuple[Tensor, ...]]] = []

    def host(self, ok: bool, name: str, message: str) -> None:
        """Refuse now unless `ok` (after the queued checks: an earlier one that fails comes first)."""
        if not ok:
            self.read()
            raise ValueError(f"{name}: {message}")

    def device(self, ok: Tensor, name: str, message: Callable[[], str]) -> None:
        """Queue `ok` (a 0-d bool tensor) for `read()`; `message()` is called only if it is False."""
        assert ok.numel() == 1 and ok.dtype == torch.bool, (ok.shape, ok.dtype)
        self._queued.append((ok.reshape(()), name, message))

    def device_once(
        self, check: str, tensors: tuple[Tensor, ...], ok: Callable[[], Tensor], name: str, message: Callable[[], str]
    ) -> None:
        """`device(ok(), name, message)` unless `tensors` (and `check`, which names the check and any
        value it depends on) passed it before, unwritten since (module docstring)."""
        key = (check, *map(id, tensors))
        if any(t.is_inference() for t in tensors):  # no version counter: a write could not be seen
            key = None
        elif _passed_before(key, tensors):
            return
        self.device(ok(), name, message)
        if key is not None:
            self._once.append((key, tensors))

    def read(self) -> None:
        """Read every queued condition with one host sync (they live on one device); refuse at the first False."""
        queued, self._queued = self._queued, []
        once, self._once = self._once, []
        if not queued:
            return
        for ok, (_, name, message) in zip(torch.stack([q[0] for q in queued]).tolist(), queued, strict=True):
            if not ok:
                raise ValueError(f"{name}: {message()}")
        for key, tensors in once:  # every queued check passed
            _remember(key, tensors)
