"""The sm90 kernels' arithmetic on any CPU: models of what the GPU computes that no IEEE rule fixes.

- `mma`: the tensor cores' FP32-accumulating addition (groups of 16 products, truncation, round
  toward zero), and the dots and chains built from it;
- `fma`: the correctly rounded FP32 FMA and the FMA chain of Triton's IEEE tl.dot;
- `tree`: reduction trees (tl.sum's order over a tile axis), and how a probe reveals one;
- `floats`: exact integer views of IEEE floats, and the rounding toward zero to FP32;
- `sfu_ref`: the deterministic references the special-function probes store their residuals against.

Everything is torch integer or IEEE float64 arithmetic in separate ops, so a result is the same on
any device. What no GPU answer has confirmed is marked HYPOTHESIS where it is defined
(h3lab.emulate.mma.HYPOTHESES); the probes that answer it are in h3lab.bench (mma_probe, sfu_probe,
tree_probe). Part of its own layer: imports the core only.
"""
