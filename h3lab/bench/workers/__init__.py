"""The benchmarks' workers: modules torchrun starts for h3lab.bench, launched only through
h3lab.launch.launcher, and what they share.

collective_check  deterministic collectives against the local tree; their bandwidth (h3lab.bench.collectives)
layout_bench      one rank of the layout benchmark: deterministic and eager steps, every collective timed
                  (h3lab.bench.layouts)
layout_diagnose   the layout benchmark's suspects of rank arrival skew, run on a rank's steps
eager_tp          the eager, non-deterministic block (TP, or any layout) timed on every rank
eager_layouts     the eager baseline at a layout: groups, shards, rows
"""
