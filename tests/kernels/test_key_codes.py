"""2-bit key codes on the CPU (the Rust twins through oasiskv.ops) against an independent reference.

The reference quantises per the definition (``c = round(3 (k - min) / (max - min))`` in f32, half away
from zero, clamped to 0..=3, 0 for an empty range or NaN) and scores in float64: each logit is
``q_g . min + sum_d c_d w_gd`` with the f16 code weights ``w = f16(f16(q / 3) f16(max - min))``
(``code_weights``), the largest over the block's tokens, summed over the GQA group.
"""

from __future__ import annotations

import math

import pytest
import torch

from oasiskv import errors, ops
from support.key_codes import (
    LENS,
    key_codes_case,
    magnitude,
    ref_key_codes,
    ref_score_blocks_codes,
    rescore_candidates,
    unpack_codes,
)
from support.reference import MALFORMED_INDPTR, i32, malformed_indptr

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GROUPS = [1, 3, 4]
HEAD_DIMS = [64, 36, 4]
BLOCK_SIZES = [16, 5, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_build_key_codes_matches_the_definition(dtype, head_dim, block_size):
    gen = torch.Generator().manual_seed(hash((str(dtype), head_dim, block_size)) % 2**31)
    hk, n_host = 3, 11
    geo = ops.KvGeometry(hk, hk, head_dim, block_size)
    host_k = torch.randn(n_host, hk, block_size, head_dim, generator=gen).to(dtype)
    # Keys on a coarse grid too: exact ties of 3 (k - min) / (max - min) at half-integers.
    host_k[0] = (torch.randint(0, 7, host_k[0].shape, generator=gen).float() * 0.5).to(dtype)
    host_k[1, :, :, 0] = 2.0  # a constant channel: empty range, code 0
    summaries = torch.empty(n_host, hk, 2, head_dim, dtype=dtype)
    ops.build_summaries(geo, host_k, i32(list(range(n_host))), i32([block_size] * n_host), summaries)
    codes = torch.full((n_host, hk, block_size, head_dim // 4), 0xAB, dtype=torch.uint8)
    ids = [9, 0, 1, 4, 10]
    ops.build_key_codes(geo, host_k, summaries, i32(ids), codes)
    want = ref_key_codes(host_k, summaries, ids)
    for b in range(n_host):
        if b in want:
            assert torch.equal(unpack_codes(codes[b]), want[b]), f"block {b}"
        else:
            assert (codes[b] == 0xAB).all(), f"block {b} is not listed: untouched"
    assert (unpack_codes(codes[1])[:, :, 0] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("with_rows", [False, True])
def test_encode_blocks_is_build_key_codes_then_build_bounds8(dtype, head_dim, with_rows):
    """ops.encode_blocks (the engine's one launch per layer) writes exactly what the two builds
    write, and nothing at all when a check fails."""
    gen = torch.Generator().manual_seed(hash((str(dtype), head_dim, with_rows)) % 2**31)
    hk, n_host, bs = 2, 9, 5
    geo = ops.KvGeometry(hk, hk, head_dim, bs)
    host_k = torch.randn(n_host, hk, bs, head_dim, generator=gen).to(dtype)
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
    ops.build_key_codes(geo, host_k, summaries, ids, two[0], block_rows=rows)
    ops.build_bounds8(geo, summaries, ids, two[1], two[2])
    for got, want in zip(outs, two, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    before = [t.clone() for t in outs]
    with pytest.raises(errors.OasisError):
        ops.encode_blocks(geo, host_k, summaries, i32([1, n_host]), *outs, block_rows=None)
    for got, want in zip(outs, before, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "written before the error"


def test_codes_of_keys_on_the_grid_score_the_exact_max_logit():
    """Keys on the 4-level grid of their block are decoded exactly: the score is the exact max
    logit up to the f16 code weights' rounding (three roundings of 2^-11 per weight)."""
    gen = torch.Generator().manual_seed(5)
    hk, group, d, bs, n_host = 2, 3, 12, 5, 6
    geo = ops.KvGeometry(hk * group, hk, d, bs)
    lo = torch.randint(-4, 0, (n_host, hk, 1, d), generator=gen).float()
    step = torch.randint(1, 3, (n_host, hk, 1, d), generator=gen).float()
    c = torch.randint(0, 4, (n_host, hk, bs, d), generator=gen)
    c[:, :, 0], c[:, :, 1] = 0, 3  # both ends present: the block's range is exactly [lo, lo + 3 step]
    host_k = lo + c.float() * step
    summaries = torch.empty(n_host, hk, 2, d)
    ops.build_summaries(geo, host_k, i32(list(range(n_host))), i32([bs] * n_host), summaries)
    codes = ops.empty_key_codes(geo, n_host)
    ops.build_key_codes(geo, host_k, summaries, i32(list(range(n_host))), codes)
    assert torch.equal(unpack_codes(codes), c)
    q = torch.randint(-3, 4, (2, hk * group, d), generator=gen).float()
    blk_indptr, blk_indices = i32([0, 4, 6]), i32([5, 0, 2, 3, 1, 4])
    got = ops.score_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices)
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
    geo, host_k, summaries, codes, q, blk_indptr, blk_indices = key_codes_case(
        gen, dtype, group, head_dim, block_size
    )
    scores = ops.score_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices)
    assert scores.shape == (sum(LENS), 2) and scores.dtype == torch.float32
    ref = ref_score_blocks_codes(q, summaries, codes, blk_indptr, blk_indices)
    # NOTE: the twin sums head_dim f32 products per logit: its error is bounded by a few head_dim
    # ulps of the magnitude sum_g sum_d |q| (|min| + |max|).
    tol = 2e-7 * head_dim * magnitude(q, summaries, blk_indptr, blk_indices) + 1e-6
    assert ((scores.double() - ref).abs() <= tol).all(), (scores.double() - ref).abs().max()
    # The score never exceeds Quest's bound (each decoded key lies inside the block's box) but by
    # the f16 weights' rounding.
    quest = ops.score_blocks(geo, q, summaries, blk_indptr, blk_indices)
    f16_slack = 2e-3 * magnitude(q, summaries, blk_indptr, blk_indices)
    assert (scores.double() <= quest.double() + tol + f16_slack).all()


def test_preallocated_scores_are_filled_and_returned():
    gen = torch.Generator().manual_seed(8)
    geo, _, summaries, codes, q, blk_indptr, blk_indices = key_codes_case(gen, torch.bfloat16, 4, 64, 16)
    out = torch.full((blk_indices.numel(), 2), float("nan"))
    got = ops.score_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices, scores=out)
    assert got is out and torch.isfinite(out).all()
    assert torch.equal(out, ops.score_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices))
    # And into top-K like the Quest scores.
    top = ops.topk_blocks(2, out, blk_indptr, 8)
    assert top.shape == (len(LENS), 2, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_propagates_like_the_twin(dtype):
    """A NaN query or summary makes the scores that use it NaN (they rank last in top-K); a NaN key is
    encoded as 0."""
    gen = torch.Generator().manual_seed(12)
    hk, group = 2, 2
    geo, host_k, summaries, codes, q, blk_indptr, blk_indices = key_codes_case(
        gen, dtype, group, 16, 4, hk=hk
    )
    clean = ops.score_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices)
    assert torch.isfinite(clean).all()
    q[0, 3, 5] = float("nan")  # seq 0, query head 3 -> KV head 1
    b = int(blk_indices[int(blk_indptr[2])])  # a block of seq 2
    summaries[b, 0, 0, 7] = float("nan")  # its min, KV head 0
    got = ops.score_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices)
    want = torch.zeros_like(got, dtype=torch.bool)
    want[int(blk_indptr[0]) : int(blk_indptr[1]), 1] = True
    want[(blk_indices == b).nonzero().flatten(), 0] = True
    assert torch.equal(got.isnan(), want)
    torch.testing.assert_close(got[~want], clean[~want], atol=0, rtol=0)
    # A NaN key: code 0 (the summaries ignore it).
    host_k[b, 1, 2, 9] = float("nan")
    ops.build_summaries(geo, host_k, i32([b]), i32([4]), summaries)
    ops.build_key_codes(geo, host_k, summaries, i32([b]), codes)
    assert unpack_codes(codes[b])[1, 2, 9] == 0


def test_bad_head_dim_is_a_config_error():
    geo = ops.KvGeometry(2, 1, 6, 4)
    host_k = torch.zeros(3, 1, 4, 6)
    summaries = torch.zeros(3, 1, 2, 6)
    codes = torch.zeros(3, 1, 4, 1, dtype=torch.uint8)
    with pytest.raises(errors.ConfigError, match="divisible by 4"):
        ops.build_key_codes(geo, host_k, summaries, i32([0]), codes)
    with pytest.raises(errors.ConfigError, match="divisible by 4"):
        ops.score_blocks_codes(geo, torch.zeros(1, 2, 6), summaries, codes, i32([0, 1]), i32([0]))
    with pytest.raises(errors.ConfigError, match="divisible by 4"):
        ops.empty_key_codes(geo, 3)
    assert isinstance(errors.ConfigError("x"), ValueError)


def test_out_of_range_ids_and_bad_shapes_are_typed_errors_and_write_nothing():
    gen = torch.Generator().manual_seed(2)
    geo, host_k, summaries, codes, q, blk_indptr, blk_indices = key_codes_case(gen, torch.float32, 2, 16, 4)
    n_host = host_k.shape[0]
    before = codes.clone()
    for bad in ([n_host], [-1], [0, n_host + 5]):
        with pytest.raises(IndexError, match="block_ids"):
            ops.build_key_codes(geo, host_k, summaries, i32(bad), codes)
        assert torch.equal(codes, before)
    scores = torch.full((blk_indices.numel(), 2), 7.0)
    for v in (n_host, -1):
        idx = blk_indices.clone()
        idx[3] = v
        with pytest.raises(IndexError, match="blk_indices"):
            ops.score_blocks_codes(geo, q, summaries, codes, blk_indptr, idx, scores=scores)
        assert (scores == 7.0).all()
    with pytest.raises(errors.ShapeError, match="codes"):
        ops.score_blocks_codes(geo, q, summaries, codes[:-1], blk_indptr, blk_indices)
    with pytest.raises(errors.ShapeError, match="codes"):
        ops.build_key_codes(geo, host_k, summaries, i32([0]), codes[:, :, :, :-1].contiguous())
    with pytest.raises(errors.DTypeError, match="uint8"):
        ops.score_blocks_codes(geo, q, summaries, codes.to(torch.int8), blk_indptr, blk_indices)
    with pytest.raises(errors.DTypeError, match="one dtype"):
        ops.score_blocks_codes(geo, q.half(), summaries, codes, blk_indptr, blk_indices)
    with pytest.raises(errors.InvalidArgumentError, match="share memory"):
        alias = host_k.view(torch.uint8).flatten()[: codes.numel()].view(codes.shape)
        ops.build_key_codes(geo, host_k, summaries, i32([0]), alias)
    # The next valid call works.
    ops.score_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices, scores=scores)
    assert torch.isfinite(scores).all()


@pytest.mark.parametrize("case", MALFORMED_INDPTR)
def test_malformed_blk_indptr_is_a_typed_error_on_the_cpu(case):
    gen = torch.Generator().manual_seed(4)
    geo, _, summaries, codes, q, blk_indptr, blk_indices = key_codes_case(
        gen, torch.float32, 2, 16, 4, lens=[5, 1, 5]
    )
    scores = torch.full((11, 2), 7.0)
    ops.score_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices, scores=scores)
    scores.fill_(7.0)
    with pytest.raises(errors.OasisError) as info:
        ops.score_blocks_codes(
            geo, q, summaries, codes, malformed_indptr(blk_indptr, case), blk_indices, scores=scores
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_f16_code_weights_move_scores_far_less_than_the_codes_do(dtype, head_dim):
    """The f16 code weights (which let the GPU use one f16 MMA per 16 channels) change a score by
    under 1e-3 of the magnitude sum_g sum_d |q| (|min| + |max|); the 2-bit codes themselves err
    by up to a sixth of each channel's range, hundreds of times more."""
    gen = torch.Generator().manual_seed(head_dim + len(str(dtype)))
    geo, _, summaries, codes, q, blk_indptr, blk_indices = key_codes_case(
        gen, dtype, 4, head_dim, 16, lens=[23, 9]
    )
    f16w = ops.score_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices).double()
    exact = ref_score_blocks_codes(q, summaries, codes, blk_indptr, blk_indices, exact_weights=True)
    mag = magnitude(q, summaries, blk_indptr, blk_indices)
    rel = ((f16w - exact).abs() / mag).max().item()
    assert 0 < rel < 1e-3, rel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 36])
def test_rescore_blocks_codes_matches_float64_reference(dtype, group, head_dim):
    """Each candidate scores the float64 codes score of its block for its head; -1 scores -inf; the
    layout is a CSR of m entries per sequence, so top-K over it picks positions of cand."""
    gen = torch.Generator().manual_seed(hash(("rescore", str(dtype), group, head_dim)) % 2**31)
    geo, _, summaries, codes, q, blk_indptr, blk_indices = key_codes_case(gen, dtype, group, head_dim, 16)
    m = 12
    cand = rescore_candidates(gen, blk_indptr, 2, m)
    got = ops.rescore_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices, cand)
    assert got.shape == (len(LENS) * m, 2) and got.dtype == torch.float32
    ref = ref_score_blocks_codes(q, summaries, codes, blk_indptr, blk_indices)  # [nnz, 2]
    mag = magnitude(q, summaries, blk_indptr, blk_indices)
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
    full = ops.score_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices)
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
    geo, _, summaries, codes, q, blk_indptr, blk_indices = key_codes_case(gen, torch.float32, 2, 36, 5)
    m = 3
    cand = rescore_candidates(gen, blk_indptr, 2, m)
    out = torch.full((len(LENS) * m, 2), 7.0)
    past = cand.clone()
    past[0, 1, 0] = LENS[0]  # one past sequence 0's last block
    with pytest.raises(errors.IndexError_):
        ops.rescore_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices, past, scores=out)
    with pytest.raises(errors.ShapeError):
        ops.rescore_blocks_codes(
            geo, q, summaries, codes, blk_indptr, blk_indices, cand[:, :1].contiguous(), scores=out
        )
    with pytest.raises(errors.ShapeError):
        ops.rescore_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices, cand, scores=out[:-1])
    with pytest.raises(errors.DTypeError):
        ops.rescore_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices, cand.long(), scores=out)
    with pytest.raises(errors.ShapeError, match="cand must be"):
        ops.rescore_blocks_codes(geo, q, summaries, codes, blk_indptr, blk_indices, cand.flatten())
    assert (out == 7.0).all()
