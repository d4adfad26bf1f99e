"""Benchmarks that print JSON figures: ``python -m broker.bench [pass|api] ...``."""
