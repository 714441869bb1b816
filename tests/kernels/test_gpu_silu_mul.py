"""``silu_mul_*`` (cuda/norm_rope.cu), the MLP's ``silu(gate) * up`` from the fused gate/up
projection, on the GPU: against its CPU twin (``oasis_core::kernels::silu_mul``) bit for bit, on
random shapes and values of every dtype, past the kernel's largest grid (it strides), with the
output poisoned first; in a captured CUDA graph. The CPU twin against float64 and torch:
tests/kernels/test_silu_mul.py."""

from __future__ import annotations

import pytest
import torch

from oasiskv import ops
from support.reference import DEV, gpu_test, seeded

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,inter", [(1, 1), (3, 37), (40, 12288), (70, 1000), (1100, 1024)])
@gpu_test
def test_silu_mul_is_the_twin_bit_for_bit(dtype, n, inter):
    gen = seeded("silu_mul", str(dtype), n, inter)
    gu = (torch.randn(n, 2 * inter, generator=gen) * 4).to(dtype)
    gu[0, 0] = -100.0  # exp overflows to inf in f32: silu is -0
    want = ops.silu_mul(gu)  # the CPU twin
    out = torch.full((n, inter), float("nan"), dtype=dtype, device=DEV)
    got = ops.silu_mul(gu.to(DEV), out=out)
    torch.cuda.synchronize()
    assert got is out
    assert torch.equal(got.cpu(), want), (got.cpu() - want).abs().max()


@gpu_test
def test_silu_mul_replays_in_a_cuda_graph():
    gu = torch.randn(16, 2 * 96, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(16, 96, device=DEV, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.silu_mul(gu, out=out)  # warm-up (module load) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.silu_mul(gu, out=out)
    gu.copy_(torch.randn(16, 2 * 96, dtype=torch.bfloat16).to(DEV))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ops.silu_mul(gu.cpu()))
