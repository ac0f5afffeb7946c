"""Benchmarks: scripts run as `python -m h3lab.bench.<name>`, each writing one JSON record (never timed tests)."""
