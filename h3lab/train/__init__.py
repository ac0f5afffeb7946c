"""The training step under the h3-parallel-v1 contract: the rectified-flow objective, gradient
clipping by a global norm summed in the canonical order, and AdamW on FP32 master weights held per
shard; `step.Trainer` composes them into one rank's training loop. The gradients themselves come
from h3lab.model (the block stack through the chain, the parts around it through their own backward).

May import: the core, io and model.
"""
