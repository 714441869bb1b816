"""Benchmarks: `python -m oasiskv.bench.kernels` (GPU kernels against measured ceilings) and
`python -m oasiskv.bench.serve` (serving throughput and latency, through HTTP or in-process)."""
