"""The host synchronisations one step makes, counted by site on any device: what a GPU would wait for
(h3lab.bench.parallelize_step counts one step of each side; tests count a request's checks)."""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # h3lab/
_HOST_READS = ("_local_scalar_dense", "nonzero", "_unique", "unique", "equal", "masked_select")  # aten op names
_SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s


def host_syncs(run: Callable[[], object], device: torch.device) -> dict[str, Any]:
    """The host synchronisations `run()` makes: "sites" counts them by the innermost h3lab function on the
    stack ("h3lab/model/inputs.py:__post_init__"; h3lab.checks' reads count at their caller), "total"
    sums them; on CUDA "cuda_reported" is what torch itself reports (`torch.cuda.set_sync_debug_mode`,
    no sites: an autograd backward's reports reach the host at its end).

    Counted on every device alike, as calls that are a host sync on a GPU (a CPU never waits): an op that
    reads a tensor on the host (item, bool, int, float, nonzero, unique, equal, a boolean-mask index:
    torch's dispatcher sees them, in an autograd backward's thread too; tolist), and a blocking copy
    naming a device (`Tensor.cpu`, `Tensor.to`, `torch.tensor`, `torch.as_tensor`: a sync when one end
    is the host; named, not seen, so counted wherever the tensor is).
    """
    sites: dict[str, int] = {}

    def note() -> None:
        site = _site(sys._getframe(1))
        sites[site] = sites.get(site, 0) + 1

    reported = _cuda_reported(lambda: _noted(run, note)) if device.type == "cuda" else None
    if reported is None:
        _noted(run, note)
    out: dict[str, Any] = {"sites": dict(sorted(sites.items())), "total": sum(sites.values())}
    return out | ({"cuda_reported": reported} if device.type == "cuda" else {})


# a reader on its caller's behalf (h3lab.checks reads the caller's queued checks): its caller is the site
_PASS_THROUGH = frozenset({os.path.join(_PACKAGE, "checks.py")})


def _site(frame: Any) -> str:
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_PACKAGE + os.sep) and frame.f_code not in _COUNTER_CODE and path not in _PASS_THROUGH:
            return f"h3lab/{os.path.relpath(path, _PACKAGE)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside h3lab"


def _cuda_reported(run: Callable[[], object]) -> int:
    """`run()` under torch's sync debug mode: the synchronisations it reports."""
    from h3lab.bench.sync_sites import under_sync_warnings

    count = 0

    def seen(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        nonlocal count
        count += _SYNC_WARNING in str(message)

    under_sync_warnings(run, seen)
    return count


class _HostReads(TorchDispatchMode):
    """Notes every op that reads a tensor on the host."""

    def __init__(self, note: Callable[[], None]) -> None:
        super().__init__()
        self.note = note

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")  # "" for a higher-order op
        indices = args[1] if name == "index" and isinstance(args[1], list | tuple) else ()
        masked = any(isinstance(i, Tensor) and i.dtype == torch.bool for i in indices)
        if name.startswith(_HOST_READS) or masked:
            self.note()
        return func(*args, **(kwargs or {}))


def _noted(run: Callable[[], object], note: Callable[[], None]) -> None:
    """`run()` with `_HostReads` on, and `Tensor.tolist`, `Tensor.cpu` and the blocking copies naming a
    device noted."""

    def read(name: str) -> Callable[..., Any]:
        def reads(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            note()
            return originals[name](self, *args, **kwargs)

        return reads

    def to(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        named = kwargs.get("device") is not None or any(isinstance(a, str | torch.device) for a in args)
        if named and not kwargs.get("non_blocking", False):
            note()
        return originals["to"](self, *args, **kwargs)

    def factory(name: str) -> Callable[..., Tensor]:
        def made(*args: Any, **kwargs: Any) -> Tensor:
            if kwargs.get("device") is not None:
                note()
            return originals[name](*args, **kwargs)

        return made

    owners = {"tolist": torch.Tensor, "cpu": torch.Tensor, "to": torch.Tensor, "tensor": torch, "as_tensor": torch}
    originals = {n: getattr(o, n) for n, o in owners.items()}
    own = {n: n in vars(o) for n, o in owners.items()}  # Tensor's methods live on its C base class
    patches = {"tolist": read("tolist"), "cpu": read("cpu"), "to": to} | {
        n: factory(n) for n in ("tensor", "as_tensor")
    }
    _COUNTER_CODE.update(f.__code__ for f in patches.values())
    try:
        for n, f in patches.items():
            setattr(owners[n], n, f)
        with _HostReads(note):
            run()
    finally:
        for n, o in owners.items():
            if own[n]:
                setattr(o, n, originals[n])
            else:
                delattr(o, n)


# the counter's own frames, never a site (torch wraps a mode's __torch_dispatch__)
_COUNTER_CODE = {
    inspect.unwrap(f).__code__ for f in (host_syncs, _site, _cuda_reported, _noted, _HostReads.__torch_dispatch__)
}
