"""Facts about index tensors (bounds, identity, segment layout) reused inside one block step.

The block passes one `order` to ~20 row reductions, and every check of it is a host
synchronisation that drains the GPU's queue (37 per block before this cache, 5 after, on the H200:
reports/h200/README.md). Facts are cached only inside `index_cache()`, which `block_step` enters:
there the index tensors are the block's own, made inside it and never written again. Outside,
every call computes afresh, so a caller that writes an index tensor behind torch's back (`.data`,
a numpy alias), which keeps its version counter, can never be served stale facts. Inside, keys
still hold weak references and version counters: an in-place write or a new tensor at a reused
address is computed afresh. Imports no Triton, so the block can enter it on any install.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor

_SCOPE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("h3lab_index_cache", default=None)


@contextlib.contextmanager
def index_cache() -> Iterator[None]:
    """Reuse index facts until the block exits (nested scopes share the outer one)."""
    if _SCOPE.get() is not None:
        yield
        return
    token = _SCOPE.set({})
    try:
        yield
    finally:
        _SCOPE.reset(token)  # the dict, its weak references and cached tensors go with it


def cached(kind: str, tensors: tuple[Tensor, ...], extra: tuple, compute: Callable[[], Any]) -> Any:
    """compute(), or its value from earlier in this scope for the same unmodified tensors and `extra`."""
    cache = _SCOPE.get()
    if cache is None or any(t.is_inference() for t in tensors):  # inference tensors keep no version counter
        return compute()
    key = (kind, *map(id, tensors), *extra)
    hit = cache.get(key)
    if hit is not None and all(r() is t for r, t in zip(hit[0], tensors, strict=True)) and hit[1] == versions(tensors):
        return hit[2]
    value = compute()
    seed(kind, tensors, extra, value)
    return value


def seed(kind: str, tensors: tuple[Tensor, ...], extra: tuple, value: Any) -> None:
    """Record `value` as what `cached` would compute for these tensors, in this scope (none: dropped).

    For facts computed elsewhere: from the host copy a device index tensor was made from.
    """
    cache = _SCOPE.get()
    if cache is not None and not any(t.is_inference() for t in tensors):
        cache[(kind, *map(id, tensors), *extra)] = (tuple(weakref.ref(t) for t in tensors), versions(tensors), value)


def versions(tensors: tuple[Tensor, ...]) -> tuple[int, ...]:
    """torch's in-place write counters of `tensors`: a fact holds while they are unchanged."""
    return tuple(t._version for t in tensors)
