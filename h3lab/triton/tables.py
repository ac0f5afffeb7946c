"""Device tables of the multi-tensor kernels (h3lab.triton.squares, h3lab.triton.adamw): int64 rows of
addresses, sizes and strides that one launch reads to reach many tensors, tensor t's programs being
[starts[t], starts[t + 1]) of the grid."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program_tensor(starts_ptr, T, SEARCH: tl.constexpr):
    """(t, this program's index among tensor t's): the last t with starts[t] <= the program id, by
    a binary search of SEARCH steps (2^SEARCH >= T)."""
    p = tl.program_id(0)
    lo, hi = 0, T
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        below = tl.load(starts_ptr + mid) <= p
        lo, hi = tl.where(below, mid, lo), tl.where(below, hi, mid)
    return lo, (p - tl.load(starts_ptr + lo)).to(tl.int64)


def search_steps(num_tensors: int) -> int:
    """The SEARCH of a launch over `num_tensors` tensors (at least 1)."""
    return max(1, (num_tensors - 1).bit_length())
