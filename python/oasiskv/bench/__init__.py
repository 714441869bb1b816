"""Benchmarks: `python -m oasiskv.bench.kernels` (GPU kernels against measured ceilings),
`python -m oasiskv.bench.prefill` (the engine's prefill of one long prompt against a plain SDPA
forward) and `python -m oasiskv.bench.serve` (serving throughput and latency, through HTTP or
in-process)."""
