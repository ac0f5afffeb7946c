"""Op-level traces and the first-divergence finder.

A run with tracing on records every op's output on every rank (`TraceRecorder`, plugged into
block_step's trace hook), reassembles the ranks' shards into the canonical view per op
(`assemble_trace`), and `first_divergence` walks two traces in execution order to name the first
op, block and tensor whose bits differ, with its ULP statistics. Traces are safetensors plus a
JSON list of (name, space) in execution order; nothing else is needed to compare two machines.

Names: `[step{k}.][block{i}.]<op>` (h3lab.tensorname). A training run's trace holds its steps in order, each the
model's forward and backward ops, then every gradient the optimizer reads (h3lab.train.step), so a
divergence is named by its step, block and op.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from h3lab.metrics import bit_pattern, bitwise_equal, compare
from h3lab.parallel.assemble import full_tensor
from h3lab.parallel.layout import Layout
from h3lab.tensorname import TensorName

# how a rank's traced tensor sits in the canonical one: its local rows; TP rows x its unit-major columns;
# a stack [U_local, ...] of its canonical units; the same on every rank
SPACES = ("local", "tp_units", "units", "replicated")


class TraceRecorder:
    """Keeps a CPU copy of every traced tensor; optionally flips one bit of one op's output.

    `flip=(name, flat_index)` plants a single-bit fault where `name` is produced (tests of the
    finder); the block then goes on with the faulty tensor, as a real silent corruption would.
    `flipped` says whether it was planted (a name never traced plants nothing).
    """

    def __init__(self, flip: tuple[str, int] | None = None) -> None:
        self.tensors: dict[str, Tensor] = {}
        self.order: list[tuple[str, str]] = []
        self.flip = flip
        self.flipped = False

    def __call__(self, name: str, t: Tensor, space: str) -> Tensor:
        if space not in SPACES:
            raise ValueError(f"trace space {space!r}; allowed: {list(SPACES)}")
        if self.flip is not None and self.flip[0] == name:
            t = t.clone()
            bits = bit_pattern(t).view(-1)
            bits[self.flip[1]] ^= 1  # the lowest mantissa bit: one ULP
            self.flipped = True
        if name in self.tensors:
            raise ValueError(f"op {name!r} traced twice; trace names must be unique in a run")
        self.tensors[name] = t.detach().contiguous().cpu().clone()
        self.order.append((name, space))
        return t

    def save(self, prefix: Path) -> None:
        save_file(self.tensors, str(prefix) + ".safetensors")
        Path(str(prefix) + ".json").write_text(json.dumps(self.order))


def load_trace(prefix: Path | str) -> tuple[dict[str, Tensor], list[tuple[str, str]]]:
    prefix = str(prefix).removesuffix(".safetensors").removesuffix(".json")
    if not Path(prefix + ".json").is_file():
        raise ValueError(f"no trace at {prefix!r} (expected {prefix}.safetensors and {prefix}.json)")
    return load_file(prefix + ".safetensors"), [tuple(x) for x in json.loads(Path(prefix + ".json").read_text())]


def assemble_trace(layout_dir: Path, layout: Layout, num_rows: int) -> tuple[dict[str, Tensor], list]:
    """The ranks' traces of one layout -> one trace in the canonical view (rows trimmed to `num_rows`;
    h3lab.parallel.assemble)."""
    parts = [load_trace(layout_dir / f"rank{r}.trace") for r in range(layout.world)]
    order = parts[0][1]
    full = {name: full_tensor([p[0][name] for p in parts], layout, space, num_rows) for name, space in order}
    return full, order


def save_trace(prefix: Path, tensors: dict[str, Tensor], order: list) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(prefix) + ".safetensors")
    Path(str(prefix) + ".json").write_text(json.dumps(order))


def timeline(a: dict[str, Tensor], order: list, b: dict[str, Tensor]) -> list[dict]:
    """Per op of `a` (execution order): whether `b` has the same bits, and the ULP statistics; `step`
    and `block` are None for an op of no training step or no block."""
    return [_row(i, name, space, a, b) for i, (name, space) in enumerate(order)]


def first_divergence(a: dict[str, Tensor], order: list, b: dict[str, Tensor]) -> dict | None:
    """The first op (execution order of `a`) whose bits differ in `b` (its `timeline` row), or None when
    every op matches. Equal ops are checked by their bits alone; only the first differing one is measured."""
    for i, (name, space) in enumerate(order):
        if name not in b or not bitwise_equal(a[name], b[name]):
            return _row(i, name, space, a, b)
    return None


def _row(i: int, name: str, space: str, a: dict[str, Tensor], b: dict[str, Tensor]) -> dict:
    n = TensorName.parse(name)
    row = {
        "index": i,
        "name": name,
        "space": space,
        "step": n.step,
        "block": n.block,
        "op": str(n.replace(step=None, block=None)),
    }
    if name not in b:
        return row | {"present": False, "bitwise_equal": False}
    c = compare(a[name], b[name], name=name).to_dict()
    keys = ("bitwise_equal", "num_differing", "frac_differing", "max_ulp", "first_diff_index")
    return row | {"present": True} | {k: c[k] for k in keys}
