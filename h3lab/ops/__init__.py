"""The canonical arithmetic in plain torch ops: the `torch` backend, and the reference of every kernel.

Each function here is the bit-exact reference of a Triton kernel in h3lab.triton (same operation
order, one rounding per op). Part of the core: imports nothing from h3lab outside this package.
"""
