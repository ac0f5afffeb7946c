"""The update of a parallelized model, with the bits of h3lab's training step: `AdamW` (adamw.py), a
`torch.optim.Optimizer` on FP32 masters per held shard, and `clip_grad_norm_` (clip.py), the global
norm in the canonical order.

May import: the core, io, model, dist, train, nn.
"""

from h3lab.optim.adamw import AdamW
from h3lab.optim.clip import clip_grad_norm_
from h3lab.train.adamw import NonFiniteGradError

__all__ = ["AdamW", "NonFiniteGradError", "clip_grad_norm_"]
