"""GPU kernels of the canonical block, in Triton (and Gluon for Hopper's unit-tree GEMM): the `triton` backend.

Each kernel file holds its @triton.jit kernel(s) and one launcher; its pure-torch reference is the
matching function in h3lab.ops. The configurations that fix the bits are pinned per node type in
the repository's kernels/ folder (read by h3lab.triton.configs). Part of the core: imports the
core's flat modules and h3lab.ops only.
"""
