"""Benchmarks: `python -m h3lab.bench.<name>`, each writing one JSON record (never timed tests).

workers/: the modules the benchmarks launch (h3lab.bench.workers).

May import anything below the workbench (core, io, model, reference, dist, launch, train, run).
"""
