"""The sm90 kernels' arithmetic on any CPU: models of what the GPU computes that no IEEE rule fixes.

- `mma`: the tensor cores' FP32-accumulating addition (groups of 16 products, truncation, round
  toward zero), and the dots and chains built from it;
- `fma`: the correctly rounded FP32 FMA and the FMA chain of Triton's IEEE tl.dot;
- `tree`: reduction trees (tl.sum's order over a tile axis), and how a probe reveals one;
- `floats`: exact integer views of IEEE floats, and the rounding toward zero to FP32;
- `sfu_ref`: the deterministic references the special-function probes store their residuals against;
- `wgmma`: mma's dots at speed (exact float passes, the same bits; mma itself where a rule is a hypothesis);
- `lanes`: tl.sum's order over a tile row in the kernels' register layouts (thread chains, butterflies);
- `sfu`: the special instructions the attention kernels run (ex2.approx, div.full, log2);
- `tiles`: the pinned sm90 tiles the emulation was derived for (kernels/sm90.json, checked);
- `gemm`, `attention`: the sm90 kernels' arithmetic, call for call: the `emulate-sm90` backend
  (h3lab.backend.EmulateSM90Backend) is these plus the torch backend's row-local ops.

Everything is torch integer or IEEE float64 arithmetic in separate ops, so a result is the same on
any device. What no GPU answer has confirmed is marked HYPOTHESIS where it is defined
(h3lab.emulate.mma.HYPOTHESES); the probes that answer it are in h3lab.bench (mma_probe, sfu_probe,
tree_probe). Part of the core, beside h3lab.ops and h3lab.triton: it imports the core only, and
h3lab.backend builds the emulate-sm90 backend from it.
"""
