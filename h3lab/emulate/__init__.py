"""The sm90 kernels' arithmetic on any CPU: models of what the GPU computes that no IEEE rule fixes.

- `mma`: the tensor cores' FP32-accumulating addition (groups of 16 products, truncation, round
  toward zero, the edge rules the H200 gave), and the dots and chains built from it;
- `fma`: the correctly rounded FP32 FMA (with and without FTZ) and the FMA chain of Triton's IEEE tl.dot;
- `tree`: reduction trees (tl.sum's order over a tile axis; the attention kernels' own), and how a
  probe reveals one;
- `sfu`: the approximate instructions of the attention kernels, bit for bit: ex2.approx.ftz, MUFU.RCP,
  div.full, libdevice's log2;
- `mufu`: the special-function unit's table-driven quadratic interpolator and its fitted tables;
- `floats`: exact integer views of IEEE floats, and the rounding toward zero to FP32;
- `sfu_ref`: the deterministic references the special-function probes store their residuals against;
- `wgmma`: mma's dots at speed (exact float passes, the same bits; mma itself where a rule is a hypothesis);
- `lanes`: tl.sum's order over a tile row in the kernels' register layouts (thread chains, butterflies);
- `sfu`: the special instructions the attention kernels run (ex2.approx, div.full, log2);
- `tiles`: the pinned sm90 tiles the emulation was derived for (kernels/sm90.json, checked);
- `gemm`, `attention`: the sm90 kernels' arithmetic, call for call: the `emulate-sm90` backend
  (h3lab.backend.EmulateSM90Backend) is these plus the torch backend's row-local ops.

Everything is torch integer or IEEE float64 arithmetic in separate ops, so a result is the same on
any device. The rules come from the H200's answers to h3lab.bench's probes (h3lab.bench.sm90_probe: mma_probe,
sfu_probe, tree_probe); what no probe drew is named in h3lab.emulate.mma.HYPOTHESES. Part of the
core, beside h3lab.ops and h3lab.triton: it imports the core only, and h3lab.backend builds the
emulate-sm90 backend from it.
"""
