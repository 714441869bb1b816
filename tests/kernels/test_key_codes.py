"""2-bit key codes on the CPU (the Rust twins through oasiskv.ops) against an independent reference.

The codes of a block live inside its 8-bit bound (``ops.build_bounds8``), decoded from the E4M3
format's definition in the test support (``lo = decode(lo8) s``, ``hi = decode(hi8) s``). The
reference encodes each key in float64 (``c = round(3 (k - lo) / (hi - lo))``, half away from zero,
clamped to 0..=3, 0 for an empty or NaN range or a NaN key) and scores in float64: each logit is
``q_g . lo + sum_d c_d w_gd`` with the f16 code weights ``w = f16(f16(q / 3) f16(hi - lo))``
(``code_weights``), the largest over the block's tokens, summed over the GQA group.
"""

from __future__ import annotations

import math

import pytest
import torch

from oasiskv import errors, ops
from support.key_codes import (
    LENS,
    decode_bound,
    key_codes_case,
    magnitude,
    ref_key_codes,
    ref_score_blocks_codes,
    ref_topk_nan_last,
    rescore_candidates,
    unpack_codes,
)
from support.reference import MALFORMED_INDPTR, i32, malformed_indptr

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GROUPS = [1, 3, 4]
HEAD_DIMS = [64, 36, 4]
BLOCK_SIZES = [16, 5, 1]


def bounds_of(geo, host_k, n_host):
    """The summaries of host blocks ``0 .. n_host - 1`` (complete) and their 8-bit bounds
    ``(bounds8, scales)``, from the CPU twins."""
    ids = i32(list(range(n_host)))
    summaries = torch.empty(n_host, geo.num_kv_heads, 2, geo.head_dim, dtype=host_k.dtype)
    ops.build_summaries(geo, host_k, ids, i32([geo.block_size] * n_host), summaries)
    bounds = ops.empty_bounds8(geo, n_host)
    ops.build_bounds8(geo, summaries, ids, *bounds)
    return summaries, bounds


def assert_codes_are_the_reference(codes, host_k, bounds, ids) -> int:
    """Every listed block's codes are the float64 encode inside its decoded bound (either
    neighbour for a value within rounding of a half-integer); returns how many were such ties."""
    near = 0
    for b, (want, alt) in ref_key_codes(host_k, *bounds, ids).items():
        got = unpack_codes(codes[b])
        assert ((got == want) | (got == alt)).all(), f"block {b}"
        near += int((want != alt).sum())
    return near


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_build_key_codes_matches_the_definition(dtype, head_dim, block_size):
    gen = torch.Generator().manual_seed(hash((str(dtype), head_dim, block_size)) % 2**31)
    hk, n_host = 3, 11
    geo = ops.KvGeometry(hk, hk, head_dim, block_size)
    host_k = torch.randn(n_host, hk, block_size, head_dim, generator=gen).to(dtype)
    # Keys on a coarse grid too: exact ties of 3 (k - lo) / (hi - lo) at half-integers (the bound
    # of a row of multiples of 0.5 up to 3 is the summary itself).
    host_k[0] = (torch.randint(0, 7, host_k[0].shape, generator=gen).float() * 0.5).to(dtype)
    host_k[1, :, :, 0] = 2.0  # a constant channel: an empty range (2 is an E4M3 value), code 0
    host_k[2] *= 1e-3  # small and large magnitudes: the scale follows them
    host_k[3] *= 300.0
    _, bounds = bounds_of(geo, host_k, n_host)
    codes = torch.full((n_host, hk, block_size, head_dim // 4), 0xAB, dtype=torch.uint8)
    ids = [9, 0, 1, 4, 10, 2, 3]
    ops.build_key_codes(geo, host_k, *bounds, i32(ids), codes)
    near = assert_codes_are_the_reference(codes, host_k, bounds, ids)
    assert near <= 2, f"{near} near-ties: the reference barely checks the rounding"
    for b in set(range(n_host)) - set(ids):
        assert (codes[b] == 0xAB).all(), f"block {b} is not listed: untouched"
    assert (unpack_codes(codes[1])[:, :, 0] == 0).all()
    if block_size > 1:  # the grid block's ties round half away from zero, and both ends are used
        c0 = unpack_codes(codes[0])
        assert (c0 == 0).any() and (c0 == 3).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_are_encoded_inside_the_written_bound_not_the_summary(dtype):
    """The keys of a row whose maximum is no E4M3 value (1.1, 2.6 after the scale): the bound's
    max is rounded up, so some keys take another code inside the bound than inside the summary,
    and the codes are those of the bound."""
    geo = ops.KvGeometry(2, 1, 8, 16)
    t = torch.linspace(0.0, 1.0, 16)
    host_k = torch.stack([t * (1.1 + 0.2 * x) for x in range(8)], dim=-1)[None, None].to(dtype)  # [1,1,16,8]
    summaries, bounds = bounds_of(geo, host_k, 1)
    lo, hi = decode_bound(*bounds)
    assert (lo[0, 0] == summaries[0, 0, 0].double()).all()  # 0 is exact
    assert (hi[0, 0] > summaries[0, 0, 1].double()).any()  # rounded up
    codes = ops.empty_key_codes(geo, 1)
    ops.build_key_codes(geo, host_k, *bounds, i32([0]), codes)
    assert_codes_are_the_reference(codes, host_k, bounds, [0])
    # Inside the summary instead (the old basis) the codes differ somewhere.
    k, mn, mx = host_k[0, 0].double(), summaries[0, 0, 0].double(), summaries[0, 0, 1].double()
    in_summary = torch.floor(3.0 * (k - mn) / (mx - mn) + 0.5).clamp(0, 3).to(torch.int64)
    assert not torch.equal(unpack_codes(codes[0, 0]), in_summary)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("with_rows", [False, True])
def test_encode_blocks_is_build_bounds8_then_build_key_codes(dtype, head_dim, with_rows):
    """ops.encode_blocks (the engine's one launch per layer) writes exactly what the two builds
    write (the bound, then the codes inside it), and nothing at all when a check fails."""
    gen = torch.Generator().manual_seed(hash((str(dtype), head_dim, with_rows)) % 2**31)
    hk, n_host, bs = 2, 9, 5
    geo = ops.KvGeometry(hk, hk, head_dim, bs)
    host_k = torch.randn(n_host, hk, bs, head_dim, generator=gen).to(dtype)
    host_k[3, 1, 2, 0] = float("inf")  # block 3, head 1: a NaN bound, codes 0
    summaries = torch.empty(n_host, hk, 2, head_dim, dtype=dtype)
    ops.build_summaries(geo, host_k, i32(list(range(n_host))), i32([bs] * n_host), summaries)
    ids, rows = i32([8, 0, 3]), (i32([2, 7, 3]) if with_rows else None)
    outs = [
        torch.full((n_host, hk, bs, head_dim // 4), 0xAB, dtype=torch.uint8),
        torch.full((n_host, hk, 2, head_dim), 0xCD, dtype=torch.uint8),
        torch.full((n_host, hk), 7.0),
    ]
    two = [t.clone() for t in outs]
    ops.encode_blocks(geo, host_k, summaries, ids, *outs, block_rows=rows)
    ops.build_bounds8(geo, summaries, ids, two[1], two[2])
    ops.build_key_codes(geo, host_k, two[1], two[2], ids, two[0], block_rows=rows)
    for got, want in zip(outs, two, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert outs[2][3, 1].isnan() and (outs[0][3, 1] == 0).all()
    # Keys from the rows: the codes are those of the keys moved to rows = ids.
    moved = host_k.clone()
    if rows is not None:
        moved[ids.long()] = host_k[rows.long()]
    assert_codes_are_the_reference(outs[0], moved, (outs[1], outs[2]), ids.tolist())
    before = [t.clone() for t in outs]
    with pytest.raises(errors.OasisError):
        ops.encode_blocks(geo, host_k, summaries, i32([1, n_host]), *outs, block_rows=None)
    with pytest.raises(errors.OasisError):  # a key row past the pool: not even the bound is written
        ops.encode_blocks(geo, host_k, summaries, i32([1, 2]), *outs, block_rows=i32([0, n_host]))
    for got, want in zip(outs, before, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "written before the error"


def test_codes_of_keys_on_the_grid_score_the_exact_max_logit():
    """Keys on the 4-level grid of their block, whose ends (small integers) the 8-bit bound holds
    exactly, are decoded exactly: the score is the exact max logit up to the f16 code weights'
    rounding (three roundings of 2^-11 per weight)."""
    gen = torch.Generator().manual_seed(5)
    hk, group, d, bs, n_host = 2, 3, 12, 5, 6
    geo = ops.KvGeometry(hk * group, hk, d, bs)
    lo = torch.randint(-4, 0, (n_host, hk, 1, d), generator=gen).float()
    step = torch.randint(1, 3, (n_host, hk, 1, d), generator=gen).float()
    c = torch.randint(0, 4, (n_host, hk, bs, d), generator=gen)
    c[:, :, 0], c[:, :, 1] = 0, 3  # both ends present: the block's range is exactly [lo, lo + 3 step]
    host_k = lo + c.float() * step
    summaries, bounds = bounds_of(geo, host_k, n_host)
    dlo, dhi = decode_bound(*bounds)
    assert torch.equal(dlo, summaries[:, :, 0].double()) and torch.equal(dhi, summaries[:, :, 1].double())
    codes = ops.empty_key_codes(geo, n_host)
    ops.build_key_codes(geo, host_k, *bounds, i32(list(range(n_host))), codes)
    assert torch.equal(unpack_codes(codes), c)
    q = torch.randint(-3, 4, (2, hk * group, d), generator=gen).float()
    blk_indptr, blk_indices = i32([0, 4, 6]), i32([5, 0, 2, 3, 1, 4])
    got = ops.score_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices)
    for j in range(6):
        s = 0 if j < 4 else 1
        b = int(blk_indices[j])
        for h in range(hk):
            qs = q[s, h * group : (h + 1) * group]
            want = sum((host_k[b, h] @ qg).max().item() for qg in qs)
            slack = 2e-3 * float((qs.abs() * 3 * step[b, h, 0]).sum()) + 1e-6
            assert abs(got[j, h].item() - want) <= slack, (j, h, got[j, h].item(), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_score_blocks_codes_matches_float64_reference(dtype, group, head_dim, block_size):
    gen = torch.Generator().manual_seed(hash(("score", str(dtype), group, head_dim, block_size)) % 2**31)
    geo, host_k, bounds, codes, q, blk_indptr, blk_indices = key_codes_case(
        gen, dtype, group, head_dim, block_size
    )
    scores = ops.score_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices)
    assert scores.shape == (sum(LENS), 2) and scores.dtype == torch.float32
    ref = ref_score_blocks_codes(q, *bounds, codes, blk_indptr, blk_indices)
    # NOTE: the twin sums head_dim f32 products per logit: its error is bounded by a few head_dim
    # ulps of the magnitude sum_g sum_d |q| (|lo| + |hi|).
    mag = magnitude(q, *bounds, blk_indptr, blk_indices)
    tol = 2e-7 * head_dim * mag + 1e-6
    assert ((scores.double() - ref).abs() <= tol).all(), (scores.double() - ref).abs().max()
    # The score never exceeds the Quest score of the same 8-bit bound (each decoded key lies inside
    # the bound's box) but by the f16 weights' rounding.
    quest = ops.score_blocks_bound8(geo, q, *bounds, blk_indptr, blk_indices)
    assert (scores.double() <= quest.double() + tol + 2e-3 * mag).all()


def test_preallocated_scores_are_filled_and_returned():
    gen = torch.Generator().manual_seed(8)
    geo, _, bounds, codes, q, blk_indptr, blk_indices = key_codes_case(gen, torch.bfloat16, 4, 64, 16)
    out = torch.full((blk_indices.numel(), 2), float("nan"))
    got = ops.score_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices, scores=out)
    assert got is out and torch.isfinite(out).all()
    assert torch.equal(out, ops.score_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices))
    # And into top-K like the Quest scores.
    top = ops.topk_blocks(2, out, blk_indptr, 8)
    assert top.shape == (len(LENS), 2, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_propagates_like_the_twin(dtype):
    """A NaN query or a NaN scale makes the scores that use it NaN (they rank last in top-K); a NaN
    key is encoded as 0."""
    gen = torch.Generator().manual_seed(12)
    hk, group = 2, 2
    geo, host_k, (b8, sc), codes, q, blk_indptr, blk_indices = key_codes_case(gen, dtype, group, 16, 4, hk=hk)
    clean = ops.score_blocks_codes(geo, q, b8, sc, codes, blk_indptr, blk_indices)
    assert torch.isfinite(clean).all()
    q[0, 3, 5] = float("nan")  # seq 0, query head 3 -> KV head 1
    b = int(blk_indices[int(blk_indptr[2])])  # a block of seq 2
    sc[b, 0] = float("nan")  # its bound, KV head 0
    got = ops.score_blocks_codes(geo, q, b8, sc, codes, blk_indptr, blk_indices)
    want = torch.zeros_like(got, dtype=torch.bool)
    want[int(blk_indptr[0]) : int(blk_indptr[1]), 1] = True
    want[(blk_indices == b).nonzero().flatten(), 0] = True
    assert torch.equal(got.isnan(), want)
    torch.testing.assert_close(got[~want], clean[~want], atol=0, rtol=0)
    # A NaN key: code 0 (the summaries, hence the bound, ignore it).
    host_k[b, 1, 2, 9] = float("nan")
    summaries = torch.empty(host_k.shape[0], hk, 2, 16, dtype=dtype)
    ops.build_summaries(geo, host_k, i32([b]), i32([4]), summaries)
    ops.encode_blocks(geo, host_k, summaries, i32([b]), codes, b8, sc)
    assert torch.isfinite(sc[b]).all()
    assert unpack_codes(codes[b])[1, 2, 9] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_whose_keys_overflow_has_codes_0_and_ranks_last(dtype):
    """A block with an infinite key (an overflowed key) has a NaN bound (build_bounds8): its codes
    are all 0 and it scores NaN for that KV head, not garbage, so every top-K takes it after every
    other block (the one-stage top-K, and the two stages' last top-K over the candidates); its
    other head is scored as usual."""
    gen = torch.Generator().manual_seed(31)
    hk, group, d, bs = 2, 2, 16, 4
    geo = ops.KvGeometry(hk * group, hk, d, bs)
    n_host = 6
    host_k = torch.randn(n_host, hk, bs, d, generator=gen).to(dtype)
    host_k[4, 0, 1, 3] = float("inf")
    host_k[2, 1, 0, 0] = -float("inf")
    summaries = torch.empty(n_host, hk, 2, d, dtype=dtype)
    ids = i32(list(range(n_host)))
    ops.build_summaries(geo, host_k, ids, i32([bs] * n_host), summaries)
    codes = torch.full((n_host, hk, bs, d // 4), 0xFF, dtype=torch.uint8)
    b8, sc = ops.empty_bounds8(geo, n_host)
    ops.encode_blocks(geo, host_k, summaries, ids, codes, b8, sc)
    bad = torch.zeros(n_host, hk, dtype=torch.bool)
    bad[4, 0] = bad[2, 1] = True
    assert torch.equal(sc.isnan(), bad)
    assert (codes[bad] == 0).all() and (codes[~bad] != 0).any()
    # One sequence over every block; a query that would favour the big key, were it scored.
    q = torch.ones(1, hk * group, d, dtype=dtype)
    indptr, indices = i32([0, n_host]), ids
    scores = ops.score_blocks_codes(geo, q, b8, sc, codes, indptr, indices)
    assert torch.equal(scores.isnan(), bad)
    for k in (n_host - 1, n_host):
        top = ops.topk_blocks(hk, scores, indptr, k)
        assert torch.equal(top.long(), ref_topk_nan_last(scores, indptr, k))
    assert int(top[0, 0, -1]) == 4 and int(top[0, 1, -1]) == 2
    # The candidates' rescoring: the same NaN, and topk_candidates takes it last too.
    cand = torch.tensor([[[4, 0, 1, 5], [2, 3, 5, 1]]], dtype=torch.int32)
    re = ops.rescore_blocks_codes(geo, q, b8, sc, codes, indptr, indices, cand)
    assert re[0].isnan().all() and re[1:].isfinite().all()
    last = ops.topk_candidates(hk, re, cand, indptr, 4)
    assert last[0, 0].tolist()[-1] == 4 and last[0, 1].tolist()[-1] == 2
    fused = ops.rescore_topk_codes(geo, q, b8, sc, codes, indptr, indices, cand, 4)
    assert torch.equal(fused, last)


def test_bad_head_dim_is_a_config_error():
    geo = ops.KvGeometry(2, 1, 6, 4)
    host_k = torch.zeros(3, 1, 4, 6)
    b8, sc = torch.zeros(3, 1, 2, 6, dtype=torch.uint8), torch.ones(3, 1)
    codes = torch.zeros(3, 1, 4, 1, dtype=torch.uint8)
    with pytest.raises(errors.ConfigError, match="divisible by 4"):
        ops.build_key_codes(geo, host_k, b8, sc, i32([0]), codes)
    with pytest.raises(errors.ConfigError, match="divisible by 4"):
        ops.score_blocks_codes(geo, torch.zeros(1, 2, 6), b8, sc, codes, i32([0, 1]), i32([0]))
    with pytest.raises(errors.ConfigError, match="divisible by 4"):
        ops.empty_key_codes(geo, 3)
    assert isinstance(errors.ConfigError("x"), ValueError)


def test_out_of_range_ids_and_bad_shapes_are_typed_errors_and_write_nothing():
    gen = torch.Generator().manual_seed(2)
    geo, host_k, (b8, sc), codes, q, blk_indptr, blk_indices = key_codes_case(gen, torch.float32, 2, 16, 4)
    n_host = host_k.shape[0]
    before = codes.clone()
    for bad in ([n_host], [-1], [0, n_host + 5]):
        with pytest.raises(IndexError, match="block_ids"):
            ops.build_key_codes(geo, host_k, b8, sc, i32(bad), codes)
        assert torch.equal(codes, before)
    scores = torch.full((blk_indices.numel(), 2), 7.0)
    for v in (n_host, -1):
        idx = blk_indices.clone()
        idx[3] = v
        with pytest.raises(IndexError, match="blk_indices"):
            ops.score_blocks_codes(geo, q, b8, sc, codes, blk_indptr, idx, scores=scores)
        assert (scores == 7.0).all()
    with pytest.raises(errors.ShapeError, match="codes"):
        ops.score_blocks_codes(geo, q, b8, sc, codes[:-1], blk_indptr, blk_indices)
    with pytest.raises(errors.ShapeError, match="scales"):
        ops.score_blocks_codes(geo, q, b8, sc[:-1], codes, blk_indptr, blk_indices)
    with pytest.raises(errors.ShapeError, match="scales"):
        ops.build_key_codes(geo, host_k, b8, sc[:, :1].contiguous(), i32([0]), codes)
    with pytest.raises(errors.ShapeError, match="codes"):
        ops.build_key_codes(geo, host_k, b8, sc, i32([0]), codes[:, :, :, :-1].contiguous())
    with pytest.raises(errors.DTypeError, match="uint8"):
        ops.score_blocks_codes(geo, q, b8, sc, codes.to(torch.int8), blk_indptr, blk_indices)
    with pytest.raises(errors.DTypeError, match="uint8"):
        ops.score_blocks_codes(geo, q, b8.to(torch.int8), sc, codes, blk_indptr, blk_indices)
    with pytest.raises(errors.DTypeError, match="float32"):
        ops.build_key_codes(geo, host_k, b8, sc.double(), i32([0]), codes)
    with pytest.raises(errors.InvalidArgumentError, match="share memory"):
        alias = host_k.view(torch.uint8).flatten()[: codes.numel()].view(codes.shape)
        ops.build_key_codes(geo, host_k, b8, sc, i32([0]), alias)
    with pytest.raises(errors.InvalidArgumentError, match="share memory"):
        alias = b8.flatten()[: codes.numel()].view(codes.shape)
        ops.build_key_codes(geo, host_k, b8, sc, i32([0]), alias)
    # The next valid call works.
    ops.score_blocks_codes(geo, q, b8, sc, codes, blk_indptr, blk_indices, scores=scores)
    assert torch.isfinite(scores).all()


@pytest.mark.parametrize("case", MALFORMED_INDPTR)
def test_malformed_blk_indptr_is_a_typed_error_on_the_cpu(case):
    gen = torch.Generator().manual_seed(4)
    geo, _, bounds, codes, q, blk_indptr, blk_indices = key_codes_case(
        gen, torch.float32, 2, 16, 4, lens=[5, 1, 5]
    )
    scores = torch.full((11, 2), 7.0)
    ops.score_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices, scores=scores)
    scores.fill_(7.0)
    with pytest.raises(errors.OasisError) as info:
        ops.score_blocks_codes(
            geo, q, *bounds, codes, malformed_indptr(blk_indptr, case), blk_indices, scores=scores
        )
    assert isinstance(info.value, ValueError) and "blk_ind" in str(info.value)
    assert (scores == 7.0).all(), "output written on error"


def test_empty_key_codes_has_the_documented_layout():
    geo = ops.KvGeometry(32, 8, 128, 16)
    codes = ops.empty_key_codes(geo, 10)
    assert codes.shape == (10, 8, 16, 32) and codes.dtype == torch.uint8
    # 2 x the summary bytes of 16-bit storage, in all: the codes alone equal the summaries.
    assert codes.numel() == 10 * 8 * 2 * 128 * 2
    assert math.prod(codes.shape[1:]) * 8 == geo.num_kv_heads * geo.block_size * geo.head_dim * 2
    # What a codes score reads per (block, KV head): the bound's 256 bytes and the codes' 512
    # (768, and a 4-byte scale), not the 16-bit summaries' 512 and the codes (1,024).
    b8, sc = ops.empty_bounds8(geo, 10)
    per = (b8[0, 0].numel() * b8.element_size(), codes[0, 0].numel())
    assert per == (256, 512) and sum(per) == 768 and sc[0, 0].element_size() == 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_f16_code_weights_move_scores_far_less_than_the_codes_do(dtype, head_dim):
    """The f16 code weights (which let the GPU use one f16 MMA per 16 channels) change a score by
    under 1e-3 of the magnitude sum_g sum_d |q| (|lo| + |hi|); the 2-bit codes themselves err
    by up to a sixth of each channel's range, hundreds of times more."""
    gen = torch.Generator().manual_seed(head_dim + len(str(dtype)))
    geo, _, bounds, codes, q, blk_indptr, blk_indices = key_codes_case(
        gen, dtype, 4, head_dim, 16, lens=[23, 9]
    )
    f16w = ops.score_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices).double()
    exact = ref_score_blocks_codes(q, *bounds, codes, blk_indptr, blk_indices, exact_weights=True)
    mag = magnitude(q, *bounds, blk_indptr, blk_indices)
    rel = ((f16w - exact).abs() / mag).max().item()
    assert 0 < rel < 1e-3, rel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 36])
def test_rescore_blocks_codes_matches_float64_reference(dtype, group, head_dim):
    """Each candidate scores the float64 codes score of its block for its head; -1 scores -inf; the
    layout is a CSR of m entries per sequence, so top-K over it picks positions of cand."""
    gen = torch.Generator().manual_seed(hash(("rescore", str(dtype), group, head_dim)) % 2**31)
    geo, _, bounds, codes, q, blk_indptr, blk_indices = key_codes_case(gen, dtype, group, head_dim, 16)
    m = 12
    cand = rescore_candidates(gen, blk_indptr, 2, m)
    got = ops.rescore_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices, cand)
    assert got.shape == (len(LENS) * m, 2) and got.dtype == torch.float32
    ref = ref_score_blocks_codes(q, *bounds, codes, blk_indptr, blk_indices)  # [nnz, 2]
    mag = magnitude(q, *bounds, blk_indptr, blk_indices)
    for s in range(len(LENS)):
        for h in range(2):
            for i in range(m):
                c = int(cand[s, h, i])
                v = float(got[s * m + i, h])
                if c < 0:
                    assert v == -math.inf
                    continue
                j = int(blk_indptr[s]) + c
                tol = 2e-7 * head_dim * float(mag[j, h]) + 1e-6
                assert abs(v - float(ref[j, h])) <= tol, (s, h, i, v, float(ref[j, h]))
    # Bit for bit the one-stage scores of the same blocks.
    full = ops.score_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices)
    ok = cand >= 0
    j = (blk_indptr[:-1].view(-1, 1, 1) + cand.clamp(min=0)).long()  # [S, 2, m]
    same = full[j, torch.arange(2).view(1, 2, 1)]  # [S, 2, m]
    assert torch.equal(got.view(len(LENS), m, 2).permute(0, 2, 1)[ok], same[ok])
    # Top-K over the candidates' CSR: positions of the best candidates, -inf last.
    rows = torch.arange(0, (len(LENS) + 1) * m, m, dtype=torch.int32)
    pos = ops.topk_blocks(2, got, rows, 4)
    for s in range(len(LENS)):
        for h in range(2):
            col = got[s * m : (s + 1) * m, h]
            want = sorted(range(m), key=lambda i: (-float(col[i]), i))[:4]
            assert pos[s, h].tolist() == want


def test_rescore_blocks_codes_bad_calls_are_typed_errors_and_write_nothing():
    gen = torch.Generator().manual_seed(11)
    geo, _, bounds, codes, q, blk_indptr, blk_indices = key_codes_case(gen, torch.float32, 2, 36, 5)
    m = 3
    cand = rescore_candidates(gen, blk_indptr, 2, m)
    out = torch.full((len(LENS) * m, 2), 7.0)
    past = cand.clone()
    past[0, 1, 0] = LENS[0]  # one past sequence 0's last block
    args = (geo, q, *bounds, codes, blk_indptr, blk_indices)
    with pytest.raises(errors.IndexError_):
        ops.rescore_blocks_codes(*args, past, scores=out)
    with pytest.raises(errors.ShapeError):
        ops.rescore_blocks_codes(*args, cand[:, :1].contiguous(), scores=out)
    with pytest.raises(errors.ShapeError):
        ops.rescore_blocks_codes(*args, cand, scores=out[:-1])
    with pytest.raises(errors.DTypeError):
        ops.rescore_blocks_codes(*args, cand.long(), scores=out)
    with pytest.raises(errors.ShapeError, match="cand must be"):
        ops.rescore_blocks_codes(*args, cand.flatten())
    assert (out == 7.0).all()
