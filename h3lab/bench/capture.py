"""Every backend call of a reference block, recorded in call order: what the CPU emulator is debugged on.

`RecordingBackend(inner, recorder)` wraps any Backend (h3lab.backend's protocol): each method call
goes to `inner` unchanged and its arguments and results are recorded, with the method's name, in
call order (the callable `plan_rows` returns is recorded when the block calls it, as `plan_rows()`).
Tensors go to a `TensorStore`: each distinct tensor once (by content), and a view of one of the
block's weights by reference (weight name, offset, shape, strides): any CPU regenerates the
synthetic weights of the problem, so they are not copied.

Two recorders:
- `FullRecorder` (golden.REFERENCE, the tiny block, forward and backward): every tensor whole.
- `SpotRecorder` (h3lab.bench.spot_samples; golden.REAL, the real shapes): per call a sample a CPU
  can recompute from its own inputs alone.
`replay` runs a full capture's calls again through any backend from the recorded inputs and says,
per call, whether it gives the recorded bits: the first call that does not is where an emulator's
arithmetic leaves the GPU's. h3lab.bench.sm90_capture runs both captures on the reference problems.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from h3lab.metrics import sha256_tensor


class TensorStore:
    """Tensors by key, each distinct one once (CPU copies); views of known weights by reference."""

    def __init__(self, weights: dict[str, Tensor]) -> None:
        self.tensors: dict[str, Tensor] = {}
        self._by_hash: dict[str, str] = {}
        self._weights = {w.untyped_storage().data_ptr(): (name, w) for name, w in weights.items()}

    def put(self, t: Tensor) -> dict[str, Any]:
        """A JSON reference to t: {"weight": name, "offset", "shape", "stride", "dtype"} or {"tensor": key}."""
        found = self._weights.get(t.untyped_storage().data_ptr())
        if found is not None:
            name, w = found
            view = {
                "offset": t.storage_offset() - w.storage_offset(),
                "shape": list(t.shape),
                "stride": list(t.stride()),
            }
            return {"weight": name, "dtype": str(t.dtype).removeprefix("torch.")} | view
        data = t.detach().to("cpu").contiguous()
        digest = hashlib.sha256(
            sha256_tensor(data).encode() + str((data.dtype, tuple(data.shape))).encode()
        ).hexdigest()
        if digest not in self._by_hash:
            key = f"t{len(self.tensors):05d}"
            self.tensors[key] = data.clone() if data.data_ptr() == t.data_ptr() else data
            self._by_hash[digest] = key
        return {"tensor": self._by_hash[digest]}

    def is_weight(self, t: Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._weights

    def sliced(self, t: Tensor, dim: int, idx: Tensor) -> dict[str, Any]:
        """t.index_select(dim, idx) as a reference: of the weight view itself (with the indices) when t
        is one, else of the selected slice."""
        if self.is_weight(t):
            return {"of": self.put(t), "dim": dim, "index": idx.tolist()}
        return {"slice": self.put(t.index_select(dim, idx.to(t.device))), "dim": dim}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def encode(value: Any, put: Callable[[Tensor], dict]) -> Any:
    """A JSON form of an argument or result: tensors through `put`, containers element by element."""
    if isinstance(value, Tensor):
        return put(value)
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [encode(v, put) for v in value]}
    if isinstance(value, dict):
        return {"dict": {str(k): encode(v, put) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if callable(value):
        return {"callable": getattr(value, "__name__", type(value).__name__)}
    return {"repr": repr(value)}


class FullRecorder:
    """Every call's arguments (taken before the call) and results, whole."""

    def __init__(self, store: TensorStore) -> None:
        self.store, self.calls = store, []

    def begin(self, method: str, args: tuple, kwargs: dict) -> int:
        self.calls.append({"index": len(self.calls), "method": method})
        self.calls[-1] |= {"args": encode(list(args), self.store.put), "kwargs": encode(dict(kwargs), self.store.put)}
        return len(self.calls) - 1

    def end(self, index: int, args: tuple, kwargs: dict, out: Any) -> None:
        self.calls[index]["out"] = encode(out, self.store.put)


class RecordingBackend:
    """`inner`'s methods, each call recorded by `recorder` (begin before, end after); attributes pass."""

    def __init__(self, inner: Any, recorder: Any) -> None:
        self._inner, self._recorder = inner, recorder
        self.name = inner.name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._inner, attr)
        if attr.startswith("_") or not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            index = self._recorder.begin(attr, args, kwargs)
            out = value(*args, **kwargs)
            self._recorder.end(index, args, kwargs, out)
            return self._plan(out) if attr == "plan_rows" else out

        return call

    def _plan(self, plan: Callable[[], Tensor]) -> Callable[[], Tensor]:
        def order() -> Tensor:
            index = self._recorder.begin("plan_rows()", (), {})
            out = plan()
            self._recorder.end(index, (), {}, out)
            return out

        return order


# ---- reading a full capture back ---------------------------------------------------------------


def resolve(value: Any, tensors: dict[str, Tensor], weights: dict[str, Tensor]) -> Any:
    """An `encode`d argument or result back as Python values: tensors from the capture's files, weight
    views from `weights` (the problem's synthetic weights, regenerated), dtypes as torch dtypes."""
    ((kind, v),) = value.items() if len(value) == 1 else (("weight", value),)
    if kind == "weight":
        w = weights[value["weight"]]
        return torch.as_strided(w, value["shape"], value["stride"], w.storage_offset() + value["offset"])
    if kind == "tensor":
        return tensors[v]
    if kind in ("list", "tuple"):
        items = [resolve(x, tensors, weights) for x in v]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: resolve(x, tensors, weights) for k, x in v.items()}
    if kind == "dtype":
        return getattr(torch, v)
    if kind == "float":
        return float(v)
    return v  # "value", and the names of callables and reprs


def same_bits(a: Any, b: Any) -> bool:
    """Tensors (nested in lists and tuples) equal byte for byte, dtype and shape included; other values equal."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a.cpu()), _bits(b.cpu()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _bits(t: Tensor) -> Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def replay(calls: list[dict], tensors: dict[str, Tensor], weights: dict[str, Tensor], backend: Any) -> list[dict]:
    """Every recorded call again through `backend`, in order, from its recorded inputs alone: per call,
    whether `backend` gives the recorded outputs' bits (the first False is where the arithmetic moved)."""
    rows, plan = [], None
    for call in calls:
        if call["method"] == "plan_rows()":
            out = plan()
        else:
            args, kwargs = resolve(call["args"], tensors, weights), resolve(call["kwargs"], tensors, weights)
            out = getattr(backend, call["method"])(*args, **kwargs)
            plan = out if call["method"] == "plan_rows" else plan
        same = True if call["method"] == "plan_rows" else same_bits(out, resolve(call["out"], tensors, weights))
        rows.append({"index": call["index"], "method": call["method"], "same": same})
    return rows
