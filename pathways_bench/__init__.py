"""Benchmarks, run with ``python -m pathways bench NAME``; results go in BENCHMARKS.md."""
