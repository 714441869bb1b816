"""The 2-bit key-code kernels on CUDA (through oasiskv.ops) against their CPU twins.

The codes live inside each block's 8-bit bound (bounds8 and scales), which the scores read instead
of the summaries. Codes and bounds must match bit for bit (host_k pinned or on the device); scores
within the tolerance below; malformed blk_indptr rows and out-of-range block ids score -inf and are
read safely; a NaN bound scores NaN. Run under compute-sanitizer with ``-k key_codes``. Out of GPU
memory is a skip.
"""

from __future__ import annotations

import pytest
import torch

from oasiskv import ops
from support.key_codes import (
    LENS,
    RESCORE_TOPK_BLOCK_SIZES,
    RESCORE_TOPK_GROUPS,
    RESCORE_TOPK_HEAD_DIMS,
    RESCORE_TOPK_MS,
    assert_scores_close,
    key_codes_case,
    magnitude,
    rescore_candidates,
    rescore_topk_case,
)
from support.reference import (
    DEV,
    MALFORMED_INDPTR,
    back,
    csr,
    csr_rows,
    dev,
    gpu_test,
    i32,
    malformed_indptr,
    seeded,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HEAD_DIMS = [128, 64, 36]
GROUPS = [1, 3, 4, 8]
BLOCK_SIZES = [16, 5]
HOSTS = ["pinned", "cuda"]
POISON = float("nan")


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    """The same values bit for bit, NaN where the other has NaN."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=msg)


def _case(gen, dtype, group, head_dim, block_size, hk=3, lens=LENS):
    """test_key_codes' case (keys, (bounds8, scales), codes, queries, tables) with three KV heads."""
    return key_codes_case(gen, dtype, group, head_dim, block_size, hk=hk, lens=lens, extra_host=5)


def devs(bounds) -> tuple:
    """``(bounds8, scales)`` on the GPU."""
    return tuple(dev(t) for t in bounds)


def bounds_of(geo, summaries) -> tuple:
    """The CPU twin's 8-bit bounds ``(bounds8, scales)`` of every block of ``summaries``."""
    bounds = ops.empty_bounds8(geo, summaries.shape[0])
    ops.build_bounds8(geo, summaries, i32(list(range(summaries.shape[0]))), *bounds)
    return bounds


@gpu_test
@pytest.mark.parametrize("where", HOSTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_build_key_codes_bit_exact(dtype, head_dim, block_size, where):
    gen = seeded("key_codes-build", dtype, head_dim, block_size, where)
    hk, n_host = 3, 13
    geo = ops.KvGeometry(hk, hk, head_dim, block_size)
    keys = torch.randn(n_host, hk, block_size, head_dim, generator=gen).to(dtype)
    keys[0] = (torch.randint(0, 7, keys[0].shape, generator=gen).float() * 0.5).to(dtype)  # exact ties
    keys[1, :, :, 3] = 1.0  # an empty range
    keys[2, 1, 0, 5] = float("nan")
    keys[3, 2, 1, 0] = float("inf")  # a NaN bound: codes 0
    summ = torch.empty(n_host, hk, 2, head_dim, dtype=dtype)
    ops.build_summaries(geo, keys, i32(list(range(n_host))), i32([block_size] * n_host), summ)
    bounds = bounds_of(geo, summ)
    assert bounds[1][3, 2].isnan()
    codes = torch.randint(0, 256, (n_host, hk, block_size, head_dim // 4), generator=gen, dtype=torch.uint8)
    g_codes = dev(codes)
    ids = i32([12, 0, 1, 2, 7, 5, 3])
    ops.build_key_codes(geo, keys, *bounds, ids, codes)
    assert (codes[3, 2] == 0).all()
    host_k = keys.pin_memory() if where == "pinned" else dev(keys)
    # Out-of-range ids are skipped on the GPU (the CPU raises).
    g_ids = dev(torch.cat([ids, i32([n_host, -1, 2**31 - 1])]))
    ops.build_key_codes(geo, host_k, *devs(bounds), g_ids, g_codes)
    assert torch.equal(back(g_codes), codes)


@gpu_test
@pytest.mark.parametrize("rows", ["ids", "rows"])
@pytest.mark.parametrize("where", HOSTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_blocks_is_the_two_builds(dtype, head_dim, block_size, where, rows):
    """ops.encode_blocks (one launch) writes exactly what build_bounds8 + build_key_codes (inside
    that bound) write on the GPU, and what the CPU twin writes: codes, bounds and scales bit for
    bit, untouched entries left alone, out-of-range ids (and rows) skipped."""
    gen = seeded("key_codes-encode", dtype, head_dim, block_size, where, rows)
    hk, n_host = 3, 13
    geo = ops.KvGeometry(hk, hk, head_dim, block_size)
    keys = torch.randn(n_host, hk, block_size, head_dim, generator=gen).to(dtype)
    keys[1, :, :, 3] = 1.0  # an empty range
    keys[2, 1, 0, 5] = float("nan")  # a NaN scale
    summ = torch.empty(n_host, hk, 2, head_dim, dtype=dtype)
    ops.build_summaries(geo, keys, i32(list(range(n_host))), i32([block_size] * n_host), summ)
    ids = i32([12, 0, 1, 2, 7, 5])
    # Keys of block ids[i] in host row perm[i] (the engine's pages), or in row id.
    perm = i32([3, 9, 1, 2, 0, 11]) if rows == "rows" else None
    host_keys = keys.clone()
    if perm is not None:
        host_keys[perm.long()] = keys[ids.long()]
    codes = torch.randint(0, 256, (n_host, hk, block_size, head_dim // 4), generator=gen, dtype=torch.uint8)
    b8 = torch.randint(0, 256, (n_host, hk, 2, head_dim), generator=gen, dtype=torch.uint8)
    sc = torch.randn(n_host, hk, generator=gen)
    want = [codes.clone(), b8.clone(), sc.clone()]
    ops.encode_blocks(geo, host_keys, summ, ids, *want, block_rows=perm)
    host_k = host_keys.pin_memory() if where == "pinned" else dev(host_keys)
    # Out-of-range ids are skipped on the GPU (the CPU raises).
    g_ids = dev(torch.cat([ids, i32([n_host, -1, 2**31 - 1])]))
    g_rows = None if perm is None else dev(torch.cat([perm, i32([0, 0, 0])]))
    fused = [dev(codes), dev(b8), dev(sc)]
    ops.encode_blocks(geo, host_k, dev(summ), g_ids, *fused, block_rows=g_rows)
    two = [dev(codes), dev(b8), dev(sc)]
    ops.build_bounds8(geo, dev(summ), g_ids, two[1], two[2])
    ops.build_key_codes(geo, host_k, two[1], two[2], g_ids, two[0], block_rows=g_rows)
    torch.cuda.synchronize()
    for name, f, t, w in zip(("codes", "bounds8", "scales"), fused, two, want, strict=True):
        assert_bitwise(back(f), back(t), f"{name}: fused vs the two launches")
        assert_bitwise(back(f), w, f"{name}: fused vs the CPU twin")


@gpu_test
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_blocks_codes_matches_cpu_twin_key_codes(dtype, head_dim, group, block_size):
    gen = seeded("key_codes-score", dtype, head_dim, group, block_size)
    geo, _, bounds, codes, q, blk_indptr, blk_indices = _case(gen, dtype, group, head_dim, block_size)
    want = ops.score_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices)
    scores = torch.full((blk_indices.numel(), geo.num_kv_heads), POISON, device=DEV)
    g_indptr = dev(blk_indptr)
    got = ops.score_blocks_codes(
        geo, dev(q), *devs(bounds), dev(codes), g_indptr, dev(blk_indices), scores=scores
    )
    assert got is scores
    assert_scores_close(back(got), want, magnitude(q, *bounds, blk_indptr, blk_indices))
    # Top-K on the GPU's own scores, end to end: threshold property.
    k = 16
    top = back(ops.topk_blocks(geo.num_kv_heads, got, g_indptr, k))
    g = back(got)
    for s in range(len(LENS)):
        seg = g[int(blk_indptr[s]) : int(blk_indptr[s + 1])]
        n = seg.shape[0]
        for h in range(geo.num_kv_heads):
            chosen = top[s, h, : min(k, n)]
            assert (top[s, h, min(k, n) :] == -1).all()
            if n > k:
                assert (seg[chosen.long(), h] >= torch.topk(seg[:, h], k).values[-1]).all()


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_propagates_like_the_cpu_twin_key_codes(dtype):
    """A NaN query and a NaN bound (the scale of a block whose keys overflowed) score NaN on both
    paths (the tensor-core path hands the NaN block to the scalar one), as the twin does."""
    gen = seeded("key_codes-nan", dtype)
    geo, _, (b8, sc), codes, q, blk_indptr, blk_indices = _case(gen, dtype, 4, 128, 16, hk=2)
    q[0, 5, 9] = float("nan")
    b = int(blk_indices[int(blk_indptr[2])])
    sc[b, 0] = float("nan")
    want = ops.score_blocks_codes(geo, q, b8, sc, codes, blk_indptr, blk_indices)
    assert want.isnan().any()
    got = ops.score_blocks_codes(geo, dev(q), dev(b8), dev(sc), dev(codes), dev(blk_indptr), dev(blk_indices))
    mag = magnitude(q, b8, sc, blk_indptr, blk_indices).nan_to_num(0.0)
    assert_scores_close(back(got), want, mag)
    # The NaN block (logical block 0 of sequence 2) ranks last in the GPU's top-K, which orders
    # the GPU's scores as the twin's top-K does.
    k = LENS[2]
    top = back(ops.topk_blocks(geo.num_kv_heads, got, dev(blk_indptr), k))
    assert torch.equal(top, ops.topk_blocks(geo.num_kv_heads, back(got), blk_indptr, k))
    assert int(top[2, 0, k - 1]) == 0 and 0 not in top[2, 0, : k - 1].tolist()


@gpu_test
@pytest.mark.parametrize("head_dim", [128, 36])  # the Qwen3 shape and an odd one
@pytest.mark.parametrize("case", MALFORMED_INDPTR)
def test_malformed_blk_indptr_key_codes_scores_minus_inf(case, head_dim):
    """Memory safety (run under compute-sanitizer memcheck) and -inf for every entry in no
    well-formed row or with an out-of-range block id; entries of well-formed rows are scored."""
    gen = seeded("key_codes-malformed", case, head_dim)
    lens = [40, 9, 37, 30]  # rows span 32-entry tiles
    geo, _, bounds, codes, q, blk_indptr, blk_indices = _case(
        gen, torch.bfloat16, 2, head_dim, 16, hk=2, lens=lens
    )
    nnz = int(blk_indptr[-1])
    bad = malformed_indptr(blk_indptr, case)
    with pytest.raises(ValueError):
        ops.score_blocks_codes(geo, q, *bounds, codes, bad, blk_indices)
    idx = blk_indices.clone()
    idx[3], idx[45] = codes.shape[0] + 7, -1  # out-of-range ids score -inf
    whole = i32([0, nnz])
    ok_idx = torch.where((idx >= 0) & (idx < codes.shape[0]), idx, torch.zeros_like(idx))
    cand = [
        ops.score_blocks_codes(geo, q[s : s + 1].contiguous(), *bounds, codes, whole, ok_idx)
        for s in range(len(lens))
    ]
    scores = torch.full((nnz, 2), POISON, device=DEV)
    ops.score_blocks_codes(geo, dev(q), *devs(bounds), dev(codes), dev(bad), dev(idx), scores=scores)
    got = back(scores)
    assert not got.isnan().any(), "every entry is written (the poison is NaN)"
    rows = csr_rows(bad, nnz)
    for j in range(nnz):
        owners = [s for s, r in enumerate(rows) if r is not None and r[0] <= j < r[1]]
        if not owners or j in (3, 45):
            assert (got[j] == float("-inf")).all(), f"entry {j}: {got[j].tolist()}"
        else:  # the query of one of its rows (overlapping rows of a malformed table), or -inf
            ok = (got[j] == float("-inf")).all() or any(
                torch.allclose(got[j], cand[s][j], atol=0.05 * head_dim, rtol=1e-2) for s in owners
            )
            assert ok, f"entry {j}: {got[j].tolist()} matches none of rows {owners}"
    # The device is healthy: the well-formed table scores like the twin.
    want = ops.score_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices)
    again = ops.score_blocks_codes(geo, dev(q), *devs(bounds), dev(codes), dev(blk_indptr), dev(blk_indices))
    assert_scores_close(back(again), want, magnitude(q, *bounds, blk_indptr, blk_indices))


@gpu_test
def test_select_loop_with_key_codes_on_a_side_stream():
    """build_summaries -> build_bounds8 -> build_key_codes (pinned host_k) -> score -> top-K, queued
    on a side stream."""
    gen = seeded("key_codes-stream")
    dtype, hk, group, d, bs = torch.bfloat16, 8, 4, 128, 16
    lens = [300, 129]
    n_host = sum(lens)
    geo = ops.KvGeometry(hk * group, hk, d, bs)
    keys = torch.randn(n_host, hk, bs, d, generator=gen).to(dtype)
    ids, lens_t = i32(list(range(n_host))), i32([bs] * n_host)
    summ, codes = torch.empty(n_host, hk, 2, d, dtype=dtype), ops.empty_key_codes(geo, n_host)
    ops.build_summaries(geo, keys, ids, lens_t, summ)
    bounds = bounds_of(geo, summ)
    ops.build_key_codes(geo, keys, *bounds, ids, codes)
    q = torch.randn(2, hk * group, d, generator=gen).to(dtype)
    blk_indptr, blk_indices = csr(lens), torch.randperm(n_host, generator=gen).to(torch.int32)
    want = ops.score_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices)
    side = torch.cuda.Stream()
    pinned = keys.pin_memory()
    with torch.cuda.stream(side):
        g_summ = torch.empty(n_host, hk, 2, d, dtype=dtype, device=DEV)
        g_codes = ops.empty_key_codes(geo, n_host, device=DEV)
        g_bounds = ops.empty_bounds8(geo, n_host, device=DEV)
        g_ids, g_lens = dev(ids), dev(lens_t)
        ops.build_summaries(geo, pinned, g_ids, g_lens, g_summ)
        ops.build_bounds8(geo, g_summ, g_ids, *g_bounds)
        ops.build_key_codes(geo, pinned, *g_bounds, g_ids, g_codes)
        g_indptr = dev(blk_indptr)
        scores = ops.score_blocks_codes(geo, dev(q), *g_bounds, g_codes, g_indptr, dev(blk_indices))
        top = ops.topk_blocks(hk, scores, g_indptr, 32)
    side.synchronize()
    assert torch.equal(back(g_codes), codes)
    assert torch.equal(back(g_bounds[0]), bounds[0])
    assert_scores_close(back(scores), want, magnitude(q, *bounds, blk_indptr, blk_indices))
    assert back(top).shape == (2, hk, 32)


@gpu_test
@pytest.mark.parametrize("head_dim", [128, 64, 48])  # both tensor-core shapes and a scalar one
@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_core_path_is_as_close_as_f32_and_falls_back_exactly(dtype, head_dim):
    """The tensor-core path multiplies the codes by the twin's f16 weights (exact products) and
    sums in f32 in another order: within 1e-5 of the magnitude, so it selects what the CPU engine
    selects. A block whose weights may overflow f16 (a channel range beyond 65000 / max(1,
    max |q / 3|)), and every block of a (sequence, KV head) whose q / 3 overflows f16, take the
    exact scalar path: the twin's bits. head_dim 48 is scalar throughout."""
    gen = seeded("key_codes-tensor-core", dtype, head_dim)
    geo, _, bounds, codes, q, blk_indptr, blk_indices = _case(gen, dtype, 4, head_dim, 16)
    b_wide = int(blk_indices[1])  # sequence 0: a block (head 1) with a range beyond 65000
    b8, sc = bounds
    sc[b_wide, 1] *= 2.0**16  # a power of two still; the keys were within 2^-8 .. 2^9 of 448 s
    b8[b_wide, 1, 0, 5], b8[b_wide, 1, 1, 5] = 0xFE, 0x7E  # -448 s and 448 s: hi - lo >= 2^17
    if dtype != torch.float16:  # f16 cannot hold a q whose q / 3 overflows f16
        q[2, 0, 7] = 3e5  # inf weights: inf and NaN (0 x inf) logits, as the twin's
    want = ops.score_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices)
    args = (dev(q), *devs(bounds), dev(codes), dev(blk_indptr), dev(blk_indices))
    got = back(ops.score_blocks_codes(geo, *args))
    assert_scores_close(got, want, magnitude(q, *bounds, blk_indptr, blk_indices))
    if head_dim == 48:
        assert_bitwise(got, want, "the scalar path is the twin's bit for bit")
    assert_bitwise(got[1, 1], want[1, 1], "a block beyond the f16 range is scored exactly")
    if dtype != torch.float16:
        # q[2, 0] belongs to KV head 0: that (sequence, head) falls back; its other heads need not.
        seq2 = slice(int(blk_indptr[2]), int(blk_indptr[3]))
        assert_bitwise(got[seq2, 0], want[seq2, 0], "a sequence beyond the f16 range is scored exactly")


@gpu_test
@pytest.mark.parametrize("head_dim", [128, 36])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rescore_blocks_codes_matches_cpu_twin_key_codes(dtype, head_dim):
    """The second stage of KvConfig(score_candidates): each candidate's GPU score is the twin's
    (within the tensor-core tolerance), -1 and a candidate past its sequence's row score -inf
    (the twin refuses the latter), every entry is written, and top-K over the candidates' CSR
    picks the same positions where scores are apart."""
    gen = seeded("key_codes-rescore", dtype, head_dim)
    geo, _, bounds, codes, q, blk_indptr, blk_indices = _case(gen, dtype, 4, head_dim, 16)
    m = 40  # spans 32-entry tiles; sequences of 1 and 0 blocks get -1 padding
    cand = rescore_candidates(gen, blk_indptr, geo.num_kv_heads, m)
    want = ops.rescore_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices, cand)
    out = torch.full((len(LENS) * m, geo.num_kv_heads), POISON, device=DEV)
    got = ops.rescore_blocks_codes(
        geo, dev(q), *devs(bounds), dev(codes), dev(blk_indptr), dev(blk_indices), dev(cand), scores=out
    )
    assert got is out
    got = back(got)
    assert torch.equal(got == float("-inf"), want == float("-inf")) and (cand < 0).any()
    # The magnitude of each candidate's block, in the candidates' layout.
    mag = magnitude(q, *bounds, blk_indptr, blk_indices)
    j = (blk_indptr[:-1].view(-1, 1, 1) + cand.clamp(min=0)).long()  # [S, H, m]
    mag_c = (
        mag[j, torch.arange(geo.num_kv_heads).view(1, -1, 1)].permute(0, 2, 1).reshape(-1, geo.num_kv_heads)
    )
    fin = want != float("-inf")
    assert_scores_close(got[fin], want[fin], mag_c[fin])
    # A candidate past its row: the GPU scores it -inf (the CPU raises).
    past = cand.clone()
    past[0, 1, 0] = LENS[0]
    with pytest.raises(IndexError):
        ops.rescore_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices, past)
    g2 = back(
        ops.rescore_blocks_codes(
            geo, dev(q), *devs(bounds), dev(codes), dev(blk_indptr), dev(blk_indices), dev(past)
        )
    )
    assert g2[0, 1] == float("-inf") and torch.equal(g2[1:], got[1:])


@gpu_test
@pytest.mark.parametrize("m", [40, 2500, 9000])
def test_rescore_blocks_codes_every_tile_length_matches_the_twin(m):
    """The launch shortens the tile for a small batch (oasis_cuda::ops::score_codes_tile: 32, 16 or
    8 entries per warp by the entries per KV head against the SM count): with m candidates per
    sequence (repeats allowed, -1 sprinkled in) the H200 takes 8, 16 and 32; every length gives
    the twin's scores, -inf for each -1, every entry written."""
    dtype, head_dim = torch.bfloat16, 128
    gen = seeded("key_codes-tiles", m)
    geo, _, bounds, codes, q, blk_indptr, blk_indices = _case(gen, dtype, 4, head_dim, 16)
    lens = (blk_indptr[1:] - blk_indptr[:-1]).view(-1, 1, 1)
    pick = torch.randint(0, 1 << 30, (len(LENS), geo.num_kv_heads, m), generator=gen)
    cand = torch.where(lens > 0, pick % lens.clamp(min=1), -1).to(torch.int32)
    cand[torch.rand(cand.shape, generator=gen) < 0.05] = -1
    want = ops.rescore_blocks_codes(geo, q, *bounds, codes, blk_indptr, blk_indices, cand)
    out = torch.full((len(LENS) * m, geo.num_kv_heads), POISON, device=DEV)
    got = back(
        ops.rescore_blocks_codes(
            geo, dev(q), *devs(bounds), dev(codes), dev(blk_indptr), dev(blk_indices), dev(cand), scores=out
        )
    )
    assert not got.isnan().any()  # every entry written
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    mag = magnitude(q, *bounds, blk_indptr, blk_indices)
    j = (blk_indptr[:-1].view(-1, 1, 1) + cand.clamp(min=0)).long()
    mag_c = (
        mag[j, torch.arange(geo.num_kv_heads).view(1, -1, 1)].permute(0, 2, 1).reshape(-1, geo.num_kv_heads)
    )
    fin = want != float("-inf")
    assert_scores_close(got[fin], want[fin], mag_c[fin])


@gpu_test
@pytest.mark.parametrize("case", MALFORMED_INDPTR)
def test_rescore_blocks_codes_with_a_malformed_blk_indptr_scores_minus_inf(case):
    """Memory safety of the two-stage path (run under compute-sanitizer memcheck): a candidate of
    a malformed row scores -inf, every entry is written, and candidates of the well-formed rows
    score as with the table intact."""
    gen = seeded("key_codes-rescore-malformed", case)
    lens = [40, 9, 37, 30]
    geo, _, bounds, codes, q, blk_indptr, blk_indices = _case(
        gen, torch.bfloat16, 2, 128, 16, hk=2, lens=lens
    )
    m = 12
    cand = rescore_candidates(gen, blk_indptr, 2, m)
    bad = malformed_indptr(blk_indptr, case)
    args = (geo, dev(q), *devs(bounds), dev(codes))
    good = back(ops.rescore_blocks_codes(*args, dev(blk_indptr), dev(blk_indices), dev(cand)))
    out = torch.full((len(lens) * m, 2), POISON, device=DEV)
    got = back(ops.rescore_blocks_codes(*args, dev(bad), dev(blk_indices), dev(cand), scores=out))
    assert not got.isnan().any(), "every entry is written (the poison is NaN)"
    rows = csr_rows(bad, int(blk_indptr[-1]))
    for s in range(len(lens)):
        block = got[s * m : (s + 1) * m]
        r = rows[s]
        if r is None:
            assert (block == float("-inf")).all(), (case, s)
        elif r == (int(blk_indptr[s]), int(blk_indptr[s + 1])):
            assert torch.equal(block, good[s * m : (s + 1) * m]), (case, s)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unaligned_buffers_take_the_exact_scalar_path(dtype):
    """The tensor-core path copies 16-byte chunks of the bounds and the codes and 4 bytes of the
    scale: bounds or codes that are not 16-byte aligned (views into a larger buffer) take the
    scalar path, bit for bit the twin's scores; aligned (scales need 4 bytes only), the
    tensor-core path is within the f32 tolerance."""
    gen = seeded("key_codes-unaligned", dtype)
    geo, _, (b8, sc), codes, q, blk_indptr, blk_indices = _case(gen, dtype, 4, 128, 16)

    def shifted(t: torch.Tensor, nbytes: int) -> torch.Tensor:  # the same values nbytes past an aligned base
        n = nbytes // t.element_size()
        flat = torch.empty(t.numel() + n, dtype=t.dtype, device=DEV)
        out = flat[n:].view(t.shape)
        out.copy_(dev(t))
        return out

    def run(b, s, cod):
        return back(ops.score_blocks_codes(geo, dev(q), b, s, cod, dev(blk_indptr), dev(blk_indices)))

    want = ops.score_blocks_codes(geo, q, b8, sc, codes, blk_indptr, blk_indices)
    assert shifted(b8, 4).data_ptr() % 16 == 4 and shifted(codes, 1).data_ptr() % 16 == 1
    assert torch.equal(run(shifted(b8, 4), dev(sc), dev(codes)), want)
    assert torch.equal(run(shifted(b8, 1), dev(sc), dev(codes)), want)
    assert torch.equal(run(dev(b8), dev(sc), shifted(codes, 1)), want)
    mag = magnitude(q, b8, sc, blk_indptr, blk_indices)
    assert_scores_close(run(dev(b8), dev(sc), dev(codes)), want, mag)
    assert_scores_close(run(dev(b8), shifted(sc, 4), dev(codes)), want, mag)


def _rescore_topk_three_ways(geo, bounds, codes, q, indptr, indices, cand, f, k, n_succ, twin=True):
    """``(fused, unfused, twin_of_gpu_scores)`` as CPU int32 tensors: ops.rescore_topk_codes on the
    GPU, ops.rescore_blocks_codes + ops.topk_candidates on the GPU, and the CPU topk_candidates
    twin over the GPU's own codes scores (None with ``twin=False``: a malformed table, which the
    twin refuses)."""
    g = [dev(q), *devs(bounds), dev(codes), dev(indptr), dev(indices), dev(cand)]
    g_indptr, g_cand = g[4], g[6]
    gf = dev(f)
    heads = geo.num_kv_heads
    out = torch.full((cand.shape[0], heads, k), -7, dtype=torch.int32, device=DEV)
    fused = ops.rescore_topk_codes(geo, *g, k, successors=n_succ, forced=gf, out=out)
    assert fused is out
    scores = ops.rescore_blocks_codes(geo, *g)
    unfused = ops.topk_candidates(heads, scores, g_cand, g_indptr, k, successors=n_succ, forced=gf)
    want = None
    if twin:
        want = ops.topk_candidates(heads, back(scores), cand, indptr, k, successors=n_succ, forced=f)
    return back(fused), back(unfused), want


@gpu_test
@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("m", RESCORE_TOPK_MS)
@pytest.mark.parametrize("group", RESCORE_TOPK_GROUPS)
@pytest.mark.parametrize("head_dim", RESCORE_TOPK_HEAD_DIMS)
@pytest.mark.parametrize("block_size", RESCORE_TOPK_BLOCK_SIZES)
def test_rescore_topk_codes_is_the_two_launches(block_size, head_dim, group, m, forced):
    """The fused launch (ops.rescore_topk_codes) selects exactly what the two launches select,
    ties included (copied blocks score the same), with and without successors and forced blocks,
    rows shorter than m included; and what the CPU twin's top-K selects from the GPU's scores.
    Block size 16 takes the tensor-core score (sums in another order than the CPU twin); the
    other sizes the exact scalar path, where the whole CPU twin must agree too."""
    dtype = DTYPES[group % len(DTYPES)]
    gen = seeded("rescore_topk-gpu", block_size, head_dim, group, m, forced)
    geo, bounds, codes, q, indptr, indices, cand, f = rescore_topk_case(
        gen, dtype, group, head_dim, block_size, m, forced=forced
    )
    for n_succ in (0, 8):
        for k in sorted({1, max(1, m // 2), m, m + n_succ + 2}):
            fused, unfused, twin = _rescore_topk_three_ways(
                geo, bounds, codes, q, indptr, indices, cand, f, k, n_succ
            )
            key = (n_succ, k)
            assert torch.equal(fused, unfused), key
            assert torch.equal(fused, twin), key
            if block_size != 16:
                cpu = ops.rescore_topk_codes(
                    geo, q, *bounds, codes, indptr, indices, cand, k, successors=n_succ, forced=f
                )
                assert torch.equal(fused, cpu), key


@gpu_test
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("m", [300, 512])
def test_rescore_topk_codes_long_candidate_rows(m, block_size):
    """The engine's sizes (m = 1.25 x 256, and the 512 cap): more candidates than the launch has
    threads, several tiles per warp, successors appended past m."""
    gen = seeded("rescore_topk-long", m, block_size)
    lens = [700, 17, 520]
    geo, bounds, codes, q, indptr, indices, cand, f = rescore_topk_case(
        gen, torch.bfloat16, 4, 128, block_size, m, hk=3, lens=lens
    )
    for k in (256, 512):
        fused, unfused, twin = _rescore_topk_three_ways(geo, bounds, codes, q, indptr, indices, cand, f, k, 8)
        assert torch.equal(fused, unfused), k
        assert torch.equal(fused, twin), k


@gpu_test
def test_rescore_topk_codes_fewer_warps_where_shared_memory_is_short():
    """group 16 x head_dim 256 in f32: eight warps' shared memory is past an H100's 227 KiB, so the
    launch takes fewer warps; the result is the same."""
    gen = seeded("rescore_topk-big")
    geo, bounds, codes, q, indptr, indices, cand, f = rescore_topk_case(
        gen, torch.float32, 16, 256, 8, 40, hk=1, lens=[54, 3, 41]
    )
    fused, unfused, twin = _rescore_topk_three_ways(geo, bounds, codes, q, indptr, indices, cand, f, 24, 8)
    assert torch.equal(fused, unfused)
    assert torch.equal(fused, twin)


@gpu_test
def test_rescore_topk_codes_bad_candidates_and_ids_like_the_two_launches():
    """Candidates past their row, block ids past the pool and a malformed row score -inf in both
    the fused and the two launches (run under compute-sanitizer memcheck: nothing read outside)."""
    gen = seeded("rescore_topk-bad")
    geo, bounds, codes, q, indptr, indices, cand, f = rescore_topk_case(gen, torch.bfloat16, 4, 128, 16, 40)
    cand[0, 0, 3] = 2**30  # past the row
    indices[int(indptr[2]) + 5] = codes.shape[0] + 3  # past the pool
    indices[int(indptr[0])] = -4
    fused, unfused, twin = _rescore_topk_three_ways(geo, bounds, codes, q, indptr, indices, cand, f, 48, 8)
    assert torch.equal(fused, unfused)
    assert torch.equal(fused, twin)
    bad = indptr.clone()
    bad[3] = 10**6  # rows 2 and 3 malformed
    fused, unfused, _ = _rescore_topk_three_ways(
        geo, bounds, codes, q, bad, indices, cand, f, 48, 8, twin=False
    )
    assert torch.equal(fused, unfused)


@gpu_test
def test_rescore_topk_codes_replays_in_a_cuda_graph():
    """Captured on a side stream (the engine's background chain) and replayed with new queries:
    the replay selects what an eager call on the new queries selects."""
    gen = seeded("rescore_topk-graph")
    geo, bounds, codes, q, indptr, indices, cand, f = rescore_topk_case(gen, torch.bfloat16, 4, 128, 16, 40)
    g = [dev(q), *devs(bounds), dev(codes), dev(indptr), dev(indices), dev(cand)]
    gf = dev(f)
    out = torch.empty(cand.shape[0], geo.num_kv_heads, 32, dtype=torch.int32, device=DEV)
    # The engine's per-layer tickets: zeroed once, kept across eager calls and replays.
    counters = torch.zeros(4 * cand.shape[0] * geo.num_kv_heads, dtype=torch.int32, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.rescore_topk_codes(geo, *g, 32, successors=8, forced=gf, out=out, counters=counters)  # load first
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        ops.rescore_topk_codes(geo, *g, 32, successors=8, forced=gf, out=out, counters=counters)
    for _ in range(3):
        g[0].copy_(dev(torch.randn(q.shape, generator=gen).to(q.dtype)))
        graph.replay()
        want = ops.rescore_topk_codes(geo, *g, 32, successors=8, forced=gf, counters=counters)
        two = ops.topk_candidates(
            geo.num_kv_heads, ops.rescore_blocks_codes(geo, *g), g[6], g[4], 32, successors=8, forced=gf
        )
        assert torch.equal(back(out), back(want))
        assert torch.equal(back(out), back(two))
    assert not back(counters).any(), "every launch leaves its tickets at zero"
