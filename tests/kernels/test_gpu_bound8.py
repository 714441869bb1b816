"""The 8-bit Quest bound's kernels on CUDA (``build_bounds8_*``, ``score_blocks_bound8_*``) against
their CPU twins: bytes and scales bit for bit, scores within f32 summation-order rounding; both
vector paths (head_dim 64 and 128) and the scalar one (96), under each score kernel ("fma", and
"mma": the tensor cores, short sequences sharing its 8-entry tiles); a malformed blk_indptr row or an
out-of-range block id scores -inf and is read safely. Run under compute-sanitizer with
``-k bound8``."""

from __future__ import annotations

import zlib

import pytest
import torch

from oasiskv import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

DEV = torch.device("cuda", 0)


def _summaries(nb, heads, head_dim, dtype, gen):
    mag = torch.logspace(-3, 3.5, nb).view(nb, 1, 1, 1)
    a = torch.randn(nb, heads, 2, head_dim, generator=gen) * mag
    a[..., :2] *= 30  # outlier channels
    lo, hi = a.min(dim=2).values, a.max(dim=2).values
    s = torch.stack([lo, hi], dim=2)
    if dtype == torch.float16:
        s = s.clamp(-6e4, 6e4)
    return s.to(dtype)


@pytest.fixture(params=["fma", "mma"])
def score_kernel(request):
    """Each 8-bit bound score kernel (``ops.set_bound8_score_kernel``; "mma" serves head_dim
    64/128/256, 96 falls back to "fma"), the process's choice restored after."""
    before = ops.bound8_score_kernel()
    ops.set_bound8_score_kernel(request.param)
    yield request.param
    ops.set_bound8_score_kernel(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim, group", [(128, 4), (64, 1), (96, 8), (128, 8), (64, 3), (256, 2)])
def test_bound8_kernels_match_their_twins(dtype, head_dim, group, score_kernel):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((dtype, head_dim, group)).encode()))
    heads, nb = 4, 97
    geo = ops.KvGeometry(heads * group, heads, head_dim, 16)
    s = _summaries(nb, heads, head_dim, dtype, gen)
    s[5, 1, 1, 3] = float("inf")  # a non-finite row: NaN scale
    ids = torch.randperm(nb, generator=gen)[:90].to(torch.int32)
    want_b8, want_sc = ops.empty_bounds8(geo, nb)
    want_b8.zero_()
    want_sc.zero_()
    ops.build_bounds8(geo, s, ids, want_b8, want_sc)
    got_b8, got_sc = (t.zero_() for t in ops.empty_bounds8(geo, nb, DEV))
    ops.build_bounds8(geo, s.to(DEV), ids.to(DEV), got_b8, got_sc)
    torch.cuda.synchronize()
    assert torch.equal(got_b8.cpu(), want_b8)
    assert torch.equal(got_sc.cpu().isnan(), want_sc.isnan())
    assert torch.equal(got_sc.cpu().nan_to_num(), want_sc.nan_to_num())

    lens = [0, 33, 1, 57, 200, 2]
    indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    nnz = int(indptr[-1])
    indices = ids[torch.randint(0, ids.numel(), (nnz,), generator=gen)]  # built blocks only
    q = (torch.randn(len(lens), heads * group, head_dim, generator=gen) * 3).to(dtype)
    want = ops.score_blocks_bound8(geo, q, want_b8, want_sc, indptr, indices)
    got = ops.score_blocks_bound8(geo, q.to(DEV), got_b8, got_sc, indptr.to(DEV), indices.to(DEV)).cpu()
    assert torch.equal(got.isnan(), want.isnan())
    # Summation order differs from the twin's: f32 rounding of sum |q| |bound| per entry.
    mag = torch.zeros_like(want, dtype=torch.float64)
    dec = ops_decode(want_b8).double() * want_sc.double().nan_to_num()[..., None, None]
    absb = dec.abs().amax(dim=2).sum(-1)  # [nb, heads]
    for s_ in range(len(lens)):
        qs = q[s_].double().abs().view(heads, group, head_dim).amax(-1).sum(-1)
        for j in range(int(indptr[s_]), int(indptr[s_ + 1])):
            mag[j] = qs * absb[int(indices[j])]
    fin = ~want.isnan()
    assert ((got.double() - want.double()).abs()[fin] <= 1e-5 * mag[fin] + 1e-30).all()
    # The bound is above the 16-bit Quest score of the same summaries.
    exact = ops.score_blocks(geo, q.to(DEV), s.to(DEV), indptr.to(DEV), indices.to(DEV)).cpu()
    assert (got.double()[fin] >= exact.double()[fin] - 1e-5 * mag[fin] - 1e-30).all()


def ops_decode(b8: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes -> float32 (torch's own float8_e4m3fn, an independent decoder)."""
    return b8.view(torch.float8_e4m3fn).float()


def test_bound8_score_reads_safely_past_bad_tables(score_kernel):
    heads, head_dim, nb = 2, 128, 8
    geo = ops.KvGeometry(heads * 2, heads, head_dim, 16)
    gen = torch.Generator().manual_seed(3)
    s = _summaries(nb, heads, head_dim, torch.bfloat16, gen).to(DEV)
    b8, sc = ops.empty_bounds8(geo, nb, DEV)
    ops.build_bounds8(geo, s, torch.arange(nb, dtype=torch.int32, device=DEV), b8, sc)
    q = torch.randn(2, heads * 2, head_dim, device=DEV, dtype=torch.bfloat16)
    # Out-of-range ids and a malformed second row (end < start): -inf there, finite elsewhere.
    indptr = torch.tensor([0, 3, 1], dtype=torch.int32, device=DEV)
    indices = torch.tensor([1, nb, -1], dtype=torch.int32, device=DEV)
    out = ops.score_blocks_bound8(geo, q, b8, sc, indptr, indices).cpu()
    assert out[0].isfinite().all() and (out[1:] == -float("inf")).all()
    # Out-of-range ids in the build are skipped.
    before = b8.clone()
    ops.build_bounds8(geo, s, torch.tensor([-1, nb, 1 << 20], dtype=torch.int32, device=DEV), b8, sc)
    torch.cuda.synchronize()
    assert torch.equal(b8, before)
