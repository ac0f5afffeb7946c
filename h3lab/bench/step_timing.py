"""Timing repeated steps on a device, for benchmarks: a clock that marks a step's phases (CUDA events on
a GPU, the wall clock on a CPU; a step starts after the device has drained), warm-up steps apart from
timed ones, medians and spread, and the memory the timed steps took on CUDA."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

GIB = 2**30


class StepClock:
    """One step's seconds and its phases' (`mark` as each ends): CUDA events on a GPU, the wall clock on
    a CPU. `start` waits for the device first, so a step never pays for work queued before it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, Any]] = []

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._marks = [("", self._now())]

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._now()))

    def stop(self) -> tuple[float, dict[str, float]]:
        """(seconds from `start` to now, {phase: seconds since the mark before it})."""
        self._marks.append(("", self._now()))
        if self.cuda:
            torch.cuda.synchronize()

        def span(a: Any, b: Any) -> float:
            return a.elapsed_time(b) / 1e3 if self.cuda else b - a

        (_, first), (_, last) = self._marks[0], self._marks[-1]
        pairs = zip(self._marks[:-2], self._marks[1:-1], strict=True)
        return span(first, last), {name: span(a, b) for (_, a), (name, b) in pairs}


def spread(seconds: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles (statistics.quantiles, inclusive: inside [min, max])."""
    q1, _, q3 = statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1 else seconds * 3
    return {
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "q1_s": q1,
        "q3_s": q3,
    }


StepFn = Callable[[int, StepClock], dict[str, Any]]  # (step k, clock) -> the step's record, clock started


def run_side(step: StepFn, warmup: int, steps: int, device: torch.device) -> dict[str, Any]:
    """Steps 1..warmup untimed, then `steps` timed ones: their records, spread, phase medians, memory."""
    clock = StepClock(device)
    rows = [step(k, clock) | {"warmup": True} for k in range(1, warmup + 1)]
    memory: dict[str, Any] = {"note": "CUDA only"}
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    timed = [step(k, clock) | {"warmup": False} for k in range(warmup + 1, warmup + steps + 1)]
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
        memory = {"before_timed_gib": before / GIB, "peak_gib": peak / GIB, "peak_extra_gib": (peak - before) / GIB}
    phases = {p: statistics.median(r["phases"][p] for r in timed) for p in timed[0]["phases"]}
    return {"steps": rows + timed, "timed": spread([r["seconds"] for r in timed]), "phases_median_s": phases} | {
        "memory": memory
    }
