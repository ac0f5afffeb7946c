"""Benchmarks: `python -m h3lab.bench.<name>`, each writing one JSON record (never timed tests).

May import anything below the workbench (core, io, model, reference, dist, run).
"""
