"""The canonical block under h3-parallel-v1: its step, in parts, and the block in a CUDA graph.

- `step`: the entry points. `block_step` runs one rank's rows and units of a block (its forward,
  input gradient and weight gradients) through a `BlockComm` and a `Backend`; `canonical_block` is
  the same step with all eight units and `LocalComm`; `block_forward` / `block_backward` split it
  with the forward kept between them (`KeptForward`).
- `forward` (F1-F11, and the records the backward reads, with each tensor's lifetime), `backward`
  (B11-B1): the step in parts.
- `rowspace`: one rank's row spaces and units inside a step.
- `result`: `BlockResult`, what `canonical_block` returns.
- `graph`: the canonical block captured in a CUDA graph (`GraphedBlock`).

What the block reads sits beside it in the core: the weights (h3lab.weights) as canonical units
(h3lab.units), the batch (h3lab.batch), the row plan (h3lab.rowplan, which the kernels read too),
the seams (h3lab.backend, h3lab.comm) and the rules (h3lab.contract).
"""

from h3lab.block.result import BlockResult
from h3lab.block.step import (
    TORCH,
    BlockStep,
    KeptForward,
    Trace,
    block_backward,
    block_forward,
    block_step,
    canonical_block,
)

__all__ = [
    "TORCH",
    "BlockResult",
    "BlockStep",
    "KeptForward",
    "Trace",
    "block_backward",
    "block_forward",
    "block_step",
    "canonical_block",
]
