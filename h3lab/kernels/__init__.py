"""Triton kernels of the canonical block (GPU). Each kernel file holds its @triton.jit kernel(s) and
one launcher; its pure-torch reference is the matching function in h3lab.ops. Configurations that
fix the bits are pinned per node type in the repository's kernels/ folder (h3lab.kernels.configs).
"""
