"""``ops.silu_mul`` on the CPU (the Rust twin of ``silu_mul_*``, the MLP's ``silu(gate) * up`` from
the fused gate/up projection): against a float64 reference rounded as the twin rounds, against
torch's ``F.silu(g) * u`` (bit for bit in bfloat16 and float16 here, within an ulp of float32 where
torch's float32 ``exp`` differs in its last bit), its shapes and argument errors. The decoder's
fused path through it: tests/kernels/test_fused.py; the CUDA kernel: test_gpu_silu_mul.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oasiskv import errors, ops
from support.reference import seeded

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def reference(gu: torch.Tensor) -> torch.Tensor:
    """float64 SiLU, rounded to float32 then to the dtype, times up in float64, rounded likewise."""
    inter = gu.shape[-1] // 2
    g, u = gu[..., :inter].double(), gu[..., inter:].double()
    e = torch.exp(-g).float().double()  # exp correctly rounded to float32, as the kernels take it
    s = (g / (1 + e)).float().to(gu.dtype).double()
    return (s * u).float().to(gu.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_the_float64_reference_and_torch(dtype):
    gen = seeded("silu_mul-cpu", str(dtype))
    gu = (torch.randn(9, 2 * 77, generator=gen) * 5).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # exp overflow, saturation, zeros
    got = ops.silu_mul(gu)
    assert got.shape == (9, 77) and got.dtype == dtype
    want = reference(gu)
    # The twin rounds 1 + e, the division and the product in float32 (the reference once), and
    # both round the SiLU and the product to the dtype: within a few ulps.
    ulp = torch.finfo(dtype).eps
    tol = 4 * ulp if dtype == torch.float32 else 2 * ulp
    err = (got.double() - want.double()).abs().max()
    assert torch.allclose(got.double(), want.double(), rtol=tol, atol=0), err
    torch_path = F.silu(gu[:, :77]) * gu[:, 77:]
    if dtype == torch.float32:
        assert torch.allclose(got, torch_path, rtol=4 * ulp, atol=1e-30)  # 2.3 ulps seen at g = -16.8
    else:
        assert torch.equal(got, torch_path)


def test_silu_mul_shapes_and_out():
    gu = torch.randn(2, 3, 10)
    out = torch.full((2, 3, 5), float("nan"))
    assert ops.silu_mul(gu, out=out) is out
    assert torch.equal(out, ops.silu_mul(gu.reshape(6, 10)).reshape(2, 3, 5))
    # A non-contiguous gu is copied first: the same values.
    wide = torch.randn(4, 24)
    assert torch.equal(ops.silu_mul(wide[:, :12]), ops.silu_mul(wide[:, :12].contiguous()))
    assert ops.silu_mul(torch.empty(0, 8)).shape == (0, 4)


def test_silu_mul_argument_errors():
    with pytest.raises(errors.ShapeError, match=r"2 \* inter"):
        ops.silu_mul(torch.randn(3, 7))
    with pytest.raises(errors.ShapeError, match="out must have shape"):
        ops.silu_mul(torch.randn(3, 8), out=torch.empty(3, 3))
    with pytest.raises(errors.OasisError):
        ops.silu_mul(torch.randn(3, 8), out=torch.empty(3, 4, dtype=torch.float16))  # dtypes differ
    gu = torch.randn(2, 8)
    with pytest.raises(errors.OasisError):
        ops.silu_mul(gu, out=gu[:, :4])  # out overlaps gu
