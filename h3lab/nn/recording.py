"""`record(name, tensor)` and `current_layout()`: what a script run by `h3lab compare` reports, and the
layout it runs under.

`h3lab compare --layout L1 L2 ... -- python my_train.py ARGS` runs the script once per layout under
torchrun (h3lab.run.compare); each rank's process holds a recording session (`start_session`, opened
by h3lab.run.workers.script before the script runs). In a session `record` keeps a CPU copy of the
tensor under its name, in call order; outside one (the script run by hand) it does nothing, so the
same script runs anywhere. A rank records either
- a tensor every rank holds whole (a loss, a norm, `h3lab.full_state_dict(model)`'s tensors): every
  rank's copy must have the same bytes; or
- a parallelized model's parameter, or its `.grad`, as this rank holds it (a shard of a unit-sharded
  weight under TP: h3lab.nn.state): recognised as that parameter's by its storage, put back whole
  from the ranks' shards when the layout is compared. A copy of a shard is not recognised: record
  the parameter or its gradient itself.
Names are unique per run of the script; the tensors must be floating point (they are compared bit
for bit and in ULPs). `current_layout()` is the layout `h3lab compare` runs (the H3LAB_LAYOUT
variable it sets), or tp1 in a process outside any torch.distributed world.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

from h3lab.nn.state import is_sharded, parallelized
from h3lab.parallel.layout import Layout

LAYOUT_VAR = "H3LAB_LAYOUT"
SPACES = ("replicated", "shard")  # the whole tensor on every rank; a parameter's shard (or its gradient's)


@dataclass
class Recorder:
    """One rank's records: CPU copies by name, and (name, space, parameter) in call order."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    entries: list[dict[str, str | None]] = field(default_factory=list)

    def add(self, name: str, tensor: Tensor) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"record name {name!r}; allowed: a non-empty string")
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            what = tensor.dtype if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(f"record {name!r}: {what}; allowed: a floating-point tensor")
        if name in self.tensors:
            raise ValueError(f"record {name!r} recorded twice; allowed: each name once per run")
        space, param = _space_of(tensor)
        self.tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self.entries.append({"name": name, "space": space, "param": param})

    def save(self, prefix: Path) -> None:
        """`prefix.safetensors` (the tensors) and `prefix.json` (the entries in call order)."""
        save_file(self.tensors, str(prefix) + ".safetensors")
        Path(str(prefix) + ".json").write_text(json.dumps(self.entries))


@dataclass
class Session:
    recorder: Recorder
    tick: Callable[[str], None]  # the rank's status (its worker's Progress.tick): each collective and record calls it


_SESSION: Session | None = None


def start_session(tick: Callable[[str], None]) -> Session:
    """Open this process's recording session (h3lab.run.workers.script, before the script runs)."""
    global _SESSION
    if _SESSION is not None:
        raise ValueError("a recording session is open already; allowed: one per process")
    _SESSION = Session(Recorder(), tick)
    return _SESSION


def end_session() -> Session | None:
    """Close the session (returning it); None when none was open."""
    global _SESSION
    ended, _SESSION = _SESSION, None
    return ended


def session() -> Session | None:
    return _SESSION


def record(name: str, tensor: Tensor) -> None:
    """Record `tensor` under `name` for `h3lab compare` (module docstring); outside a session, nothing.

    Raises:
        ValueError: in a session, a name recorded before, an empty name, a tensor not floating point.
    """
    s = _SESSION
    if s is None:
        return
    s.tick(f"record {name}"[:160])
    s.recorder.add(name, tensor)


def current_layout() -> Layout:
    """The layout this process runs under (module docstring).

    Raises:
        ValueError: H3LAB_LAYOUT is not a layout, or is unset in a world of several ranks.
    """
    name = os.environ.get(LAYOUT_VAR)
    if name:
        return Layout.parse(name)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise ValueError(
            f"{LAYOUT_VAR} is not set in a world of {world} ranks; allowed: a script run by h3lab compare, or "
            "a layout passed to h3lab.parallelize"
        )
    return Layout.parse("tp1")


def _space_of(t: Tensor) -> tuple[str, str | None]:
    """("shard", parameter name) for a parallelized model's sharded parameter or its gradient, else
    ("replicated", None)."""
    for model, state in parallelized():
        for name, p in model.named_parameters():
            if is_sharded(name, state) and any(c is not None and _same(t, c) for c in (p, p.grad)):
                return "shard", name
    return "replicated", None


def _same(a: Tensor, b: Tensor) -> bool:
    """The same elements of the same storage (a detached view of `b` whole counts)."""
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


__all__ = ["LAYOUT_VAR", "SPACES", "Recorder", "Session", "current_layout", "record", "session"]
