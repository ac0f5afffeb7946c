"""References: what the canonical block is measured against.

  oracle    the block in float64 with no intermediate rounding (autograd)
  parity    diffusers' own `MiniMaxH3TransformerBlock` (0.42.1), in any dtype
  eager     the block people run today: eager bf16 torch (cuBLAS, SDPA, autograd), optionally TP
  eager_train  the training step people run today: diffusers' model, autograd, torch's AdamW on FP32 masters
  accuracy  the canonical block against the oracle and diffusers, per tensor

May import: the core, io, model.
"""
