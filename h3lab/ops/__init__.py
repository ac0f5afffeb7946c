"""The canonical arithmetic in plain torch ops: the `torch` backend, and the reference of every kernel.

A kernel module h3lab.triton.<name> has its reference in h3lab.ops.<name>, under the same function
names (a launcher adds the rounding to its `out_dtype`): adamw, attention, chain, elementwise, gemm,
norm, rope, rows, squares, unit_gemm. The kernels of adamw, chain, elementwise, norm, rope, squares
and the row chains give these functions' bits; the GEMMs and attention add the same products in
their tensor cores' fixed order, bits of their own. The kernels' other modules pair by the rule in
ARCHITECTURE.md ("Where things go"). `fixed` holds what every reference is built from: the rounding
to storage (also elementwise.round's reference), sums in fixed trees and chains, exp, sigmoid and
cos/sin from basic operations. Part of the core: imports nothing from h3lab outside this package.
"""
