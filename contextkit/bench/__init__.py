"""Benchmarks: one harness (harness.py), one module per bench."""
