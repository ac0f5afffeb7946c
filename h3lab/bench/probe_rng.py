"""Random bits that are the same on every device and torch version: a counter hash in int64 torch ops.

The GPU probes (mma_probe, sfu_probe, tree_probe) draw their cases with it on the GPU, and the
offline checker draws the same cases again on a CPU from the seeds the summary records: nothing
but seeds and outputs needs to be saved. torch's own generators are not the same across devices
(and need not stay the same across versions). Each draw is murmur3's fmix32 of a counter mixed with
the seed; every multiply is split into 16-bit halves, so no int64 product overflows.

Dimension legend: any shape (draws are elementwise, in row-major order of the requested shape).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

M32 = 0xFFFFFFFF


def _mul32(h: Tensor, c: int) -> Tensor:
    """(h * c) mod 2^32 for h, c < 2^32, exactly in int64."""
    lo, hi = h & 0xFFFF, h >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & M32


def _fmix32(h: Tensor) -> Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _seed_words(seed: int) -> tuple[int, int]:
    s = torch.tensor([seed & M32, ((seed >> 32) & M32) ^ 0x9E3779B9], dtype=torch.int64)
    w = _fmix32(s)
    return int(w[0]), int(w[1])


class Stream:
    """Consecutive draws from one seed: `bits(shape)` returns the next prod(shape) 32-bit values."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.seed, self.device, self.count = seed, torch.device(device), 0
        self._w0, self._w1 = _seed_words(seed)

    def bits(self, shape: tuple[int, ...]) -> Tensor:
        """int64 values in [0, 2^32), the next draws of this stream in row-major order."""
        n = math.prod(shape)
        i = torch.arange(self.count, self.count + n, dtype=torch.int64, device=self.device)
        self.count += n
        h = _fmix32((i & M32) ^ self._w0)
        return _fmix32(h ^ self._w1 ^ (i >> 32)).reshape(shape)

    def ints(self, shape: tuple[int, ...], lo: int, hi: int) -> Tensor:
        """int64 values in [lo, hi] (the modulo's bias is below 2^-20 for ranges under 2^12)."""
        return lo + self.bits(shape) % (hi - lo + 1)
