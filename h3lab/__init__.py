"""h3lab: bitwise-deterministic, layout-invariant execution of the MiniMax-H3 DiT block.

Public surface (stable): H3Config, PackedBatch, packed_batch, BlockWeights, synthesize_checkpoint,
load_block, canonical_block, BlockResult. Your own PyTorch code on diffusers' model: `parallelize`,
`full_state_dict`, `record`, `current_layout` (h3lab.nn) and `h3lab.optim` (AdamW, clip_grad_norm_),
imported on first use.
"""

from h3lab.batch import PackedBatch, packed_batch
from h3lab.block import BlockResult, canonical_block
from h3lab.config import H3Config
from h3lab.contract import CONTRACT_ID, strict_mode
from h3lab.weights import BlockWeights, synthetic_block

__all__ = [
    "CONTRACT_ID",
    "BlockResult",
    "BlockWeights",
    "H3Config",
    "PackedBatch",
    "canonical_block",
    "current_layout",
    "full_state_dict",
    "load_block",
    "packed_batch",
    "parallelize",
    "record",
    "strict_mode",
    "synthesize_checkpoint",
    "synthetic_block",
]


_LAZY_NN = ("parallelize", "full_state_dict", "record", "current_layout")


def __getattr__(name: str):  # checkpoint I/O, h3lab.nn and h3lab.optim are imported on first use
    if name in ("synthesize_checkpoint", "load_block"):
        from h3lab.io import checkpoint

        return getattr(checkpoint, name)
    if name in _LAZY_NN:
        from h3lab import nn

        return getattr(nn, name)
    if name == "optim":
        import h3lab.optim

        return h3lab.optim
    raise AttributeError(name)
