"""GPU kernels of the canonical block, in Triton (and Gluon for Hopper's unit-tree GEMM): the `triton` backend.

Each kernel file holds its @triton.jit kernel(s), one launcher and its builds (`variants(node)`,
h3lab.triton.variant); its pure-torch reference is the function of the same name in h3lab.ops.<its
module's name> (h3lab.ops lists the pairs; ARCHITECTURE.md gives the rule for the rest). The
configurations that fix the bits are pinned per node type in the repository's kernels/ folder (read
by h3lab.triton.configs). Part of the core: imports the core's flat modules and h3lab.ops only.

Kernels take their operands, strides and cursors as tuples (Triton flattens a tuple argument into
its elements, in order), with two exceptions that stay separate arguments: a TensorDescriptor
(Triton 3.6's CUDA launcher, the GPU nodes', expands one only at the top level) and an argument
named in do_not_specialize (a tuple's elements are always specialised).
"""
