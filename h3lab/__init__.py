"""h3lab: bitwise-deterministic, layout-invariant execution of the MiniMax-H3 DiT block.

Public surface (stable): H3Config, PackedBatch, packed_batch, BlockWeights, synthesize_checkpoint,
load_block, canonical_block, BlockResult.
"""

from h3lab.batch import PackedBatch, packed_batch
from h3lab.block import canonical_block
from h3lab.config import H3Config
from h3lab.contract import CONTRACT_ID, strict_mode
from h3lab.result import BlockResult
from h3lab.weights import BlockWeights, synthetic_block

__all__ = [
    "CONTRACT_ID",
    "BlockResult",
    "BlockWeights",
    "H3Config",
    "PackedBatch",
    "canonical_block",
    "load_block",
    "packed_batch",
    "strict_mode",
    "synthesize_checkpoint",
    "synthetic_block",
]


def __getattr__(name: str):  # checkpoint I/O is imported on first use
    if name in ("synthesize_checkpoint", "load_block"):
        from h3lab.io import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(name)
