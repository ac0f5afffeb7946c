"""The seconds of a step's phases on the device's own clock, read when someone asks, not when taken.

On CUDA a `Clock` records events on the current stream; reading their elapsed time waits for the
last one. A block step that read its own seconds as it returned waited for the GPU at every block:
the host could not queue block i+1 while the GPU ran block i, and a host-bound step lost that
overlap once per block. So `Clock.timings` returns a `Timings` mapping that reads the events the
first time a value is asked for (a caller that prints or records them, usually after the step's
results are waited for anyway). On a CPU the laps are wall-clock seconds, known at once.

A CUDA graph capture records no timing events (reading them would wait for the GPU mid-capture):
its laps read NaN, and a replay is timed from outside.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch


class Timings(Mapping[str, float]):
    """Seconds by phase name, computed by `read()` on first access and kept (a plain dict: `dict(t)`)."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self._read: Callable[[], dict[str, float]] | None = read
        self._values: dict[str, float] = {}

    def _resolved(self) -> dict[str, float]:
        if self._read is not None:
            self._values, self._read = self._read(), None
        return self._values

    def __getitem__(self, name: str) -> float:
        return self._resolved()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._resolved())

    def __repr__(self) -> str:
        return f"Timings({self._resolved()!r})"


class Clock:
    """Laps of one step on `device`'s clock: events on CUDA (the step as the GPU ran it, so a stretch
    where the GPU waits for the host or a peer counts), wall clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        self.marks = [self._mark()]

    def _mark(self) -> torch.cuda.Event | float | None:
        if self.capturing:
            return None
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self) -> None:
        self.marks.append(self._mark())

    def seconds(self) -> list[float]:
        """Each lap's seconds; waits for the last one on CUDA (NaN for a capture)."""
        if self.capturing:
            return [float("nan")] * (len(self.marks) - 1)
        if not self.cuda:
            return [b - a for a, b in itertools.pairwise(self.marks)]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.marks)]

    def timings(self, names: Sequence[str], known: Mapping[str, float] | None = None) -> Timings:
        """{names[i]: lap i's seconds} | `known`, read on first access (module docstring)."""
        assert len(names) == len(self.marks) - 1, (names, len(self.marks))
        return Timings(lambda: dict(zip(names, self.seconds(), strict=True)) | dict(known or {}))
