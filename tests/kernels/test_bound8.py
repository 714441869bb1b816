"""The 8-bit Quest bound (``ops.build_bounds8`` / ``ops.score_blocks_bound8``, CPU twins) against
an independent float64 reference: the E4M3 grid enumerated from its definition
(``support.e4m3``), each summary value rounded outward onto it after dividing by the row's
power-of-two scale, then the Quest score over the decoded values. Random geometries (block sizes
8/16/32, head_dim 64/96/128, GQA groups 1-8, every KV dtype); the bound is never below the exact
Quest score of the summaries."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from oasiskv import ops
from oasiskv.errors import OasisError
from support import e4m3


def ref_bounds(summaries: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(decoded bound values [nb, h, 2, d] float64, scales [nb, h]) of every row."""
    s = summaries.double().numpy()
    nb, h, _, d = s.shape
    vals = np.zeros_like(s)
    scales = np.zeros((nb, h))
    for b in range(nb):
        for hh in range(h):
            row = s[b, hh]
            e = e4m3.exponent(float(np.abs(row).max()))
            y = row / 2.0**e
            lo = e4m3.GRID[np.searchsorted(e4m3.GRID, y[0], side="right") - 1]  # largest grid value <= y
            hi = e4m3.GRID[np.searchsorted(e4m3.GRID, y[1], side="left")]  # smallest grid value >= y
            vals[b, hh, 0], vals[b, hh, 1] = lo, hi
            scales[b, hh] = 2.0**e
    return vals, scales


def ref_quest(q: torch.Tensor, lo: np.ndarray, hi: np.ndarray, group: int) -> float:
    """sum over the group's query heads and d of max(q lo, q hi), float64."""
    qq = q.double().numpy()
    return float(sum(np.maximum(qq[g] * lo, qq[g] * hi).sum() for g in range(group)))


def _case(dtype, block_size, head_dim, group, heads, seed):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((dtype, block_size, head_dim, group, seed)).encode()))
    geo = ops.KvGeometry(heads * group, heads, head_dim, block_size)
    nb = 9
    # Keys with a few outlier channels and rows of very different magnitudes, as real keys have.
    mag = torch.tensor([1e-3, 0.05, 1.0, 3.0, 30.0, 300.0, 5e3, 1.0, 0.5]).view(nb, 1, 1, 1)
    a = torch.randn(nb, heads, 2, head_dim, generator=gen) * mag
    a[..., :3] *= 20
    lo, hi = a.min(dim=2).values, a.max(dim=2).values
    summaries = torch.stack([lo, hi], dim=2).to(dtype)
    return geo, summaries, gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size, head_dim, group", [(8, 64, 1), (16, 128, 4), (32, 96, 8), (16, 64, 2)])
def test_bounds_and_scores_match_the_float64_reference(dtype, block_size, head_dim, group):
    heads = 2
    geo, summaries, gen = _case(dtype, block_size, head_dim, group, heads, 0)
    if dtype == torch.float16:
        summaries = summaries.clamp(-6e4, 6e4)
    nb = summaries.shape[0]
    b8, sc = ops.empty_bounds8(geo, nb)
    ids = torch.tensor([3, 0, 8, 1, 2, 4, 5, 6, 7], dtype=torch.int32)
    ops.build_bounds8(geo, summaries, ids, b8, sc)
    vals, scales = ref_bounds(summaries)
    np.testing.assert_array_equal(sc.double().numpy(), scales)
    np.testing.assert_array_equal(e4m3.decode(b8.numpy()), vals)
    # Outward: the bound holds value by value.
    s64 = summaries.double().numpy()
    assert (vals[:, :, 0] * scales[..., None] <= s64[:, :, 0]).all()
    assert (vals[:, :, 1] * scales[..., None] >= s64[:, :, 1]).all()

    # Scores over two sequences with holes (blocks listed out of order, one repeated).
    indptr = torch.tensor([0, 4, 7], dtype=torch.int32)
    indices = torch.tensor([2, 5, 0, 5, 8, 1, 6], dtype=torch.int32)
    q = (torch.randn(2, geo.num_qo_heads, head_dim, generator=gen) * 2).to(dtype)
    got = ops.score_blocks_bound8(geo, q, b8, sc, indptr, indices)
    exact = ops.score_blocks(geo, q, summaries, indptr, indices)
    for j in range(indices.numel()):
        s = 0 if j < 4 else 1
        b = int(indices[j])
        for h in range(heads):
            qs = q[s, h * group : (h + 1) * group]
            want = scales[b, h] * ref_quest(qs, vals[b, h, 0], vals[b, h, 1], group)
            tol = 1e-5 * (abs(want) + scales[b, h] * float(qs.double().abs().sum()) * 448)
            assert abs(float(got[j, h]) - want) <= tol, (j, h, float(got[j, h]), want)
            floor = ref_quest(qs, s64[b, h, 0], s64[b, h, 1], group)  # the exact Quest bound
            assert want >= floor - 1e-9 * abs(floor)
            assert float(got[j, h]) >= float(exact[j, h]) - 1e-4 * (abs(float(exact[j, h])) + 1)


def test_non_finite_rows_score_nan_and_rank_last():
    geo = ops.KvGeometry(2, 1, 64, 16)
    s = torch.randn(3, 1, 2, 64)
    s[:, :, 0], s[:, :, 1] = s.min(dim=2).values, s.max(dim=2).values
    s[1, 0, 1, 5] = math.inf
    s[2, 0, 0, 7] = math.nan
    b8, sc = ops.empty_bounds8(geo, 3)
    ops.build_bounds8(geo, s, torch.arange(3, dtype=torch.int32), b8, sc)
    assert math.isfinite(float(sc[0])) and math.isnan(float(sc[1])) and math.isnan(float(sc[2]))
    ids, rows = torch.arange(3, dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    scores = ops.score_blocks_bound8(geo, torch.randn(1, 2, 64), b8, sc, rows, ids)
    assert math.isfinite(float(scores[0, 0])) and scores[1:].isnan().all()
    top = ops.topk_blocks(1, scores, torch.tensor([0, 3], dtype=torch.int32), 1)
    assert top.flatten().tolist() == [0]


def test_bad_calls_raise_typed_errors_and_write_nothing():
    geo = ops.KvGeometry(4, 2, 64, 16)
    s = torch.randn(4, 2, 2, 64)
    b8, sc = ops.empty_bounds8(geo, 4)
    b8.fill_(7)
    with pytest.raises(OasisError, match="block_ids"):
        ops.build_bounds8(geo, s, torch.tensor([1, 4], dtype=torch.int32), b8, sc)
    assert (b8 == 7).all()
    with pytest.raises(OasisError, match="host blocks"):
        ops.build_bounds8(geo, s, torch.tensor([1], dtype=torch.int32), *ops.empty_bounds8(geo, 3))
    with pytest.raises(OasisError, match="scales"):
        ops.build_bounds8(geo, s, torch.tensor([1], dtype=torch.int32), b8, torch.zeros(4, 3))
    with pytest.raises(OasisError, match="bounds8"):
        ops.score_blocks_bound8(
            geo,
            torch.randn(1, 4, 64),
            b8.view(torch.int8),
            sc,
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
        )
    with pytest.raises(OasisError, match="blk_indices"):
        bad, rows = torch.tensor([9], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
        ops.score_blocks_bound8(geo, torch.randn(1, 4, 64), b8, sc, rows, bad)
