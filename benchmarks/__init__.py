"""Scorer benchmarks (not part of the test run): ``python -m benchmarks.run``, see benchmarks/run.py."""
