"""Benchmarks: `python -m oasiskv.bench.kernels` (GPU kernels against measured ceilings)."""
