"""The Rust CPU kernels (through oasiskv.ops) against independent float64 references."""

from __future__ import annotations

import pytest
import torch

from oasiskv import _core, errors, ops
from support.reference import (
    ATTN_TOL,
    MALFORMED_INDPTR,
    TOL,
    malformed_indptr,
    ref_decode_attention,
    ref_score_blocks,
)

# Private names read here: ``oasiskv._core``'s planning functions (``plan_num_splits``,
# ``decode_attn_workspace_len``): ``ops`` calls them inside ``decode_attention``; their totality is
# what the tests check.

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GROUPS = [1, 3, 4, 8]
HEAD_DIMS = [64, 40]
BLOCK_SIZES = [16, 5]


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


def _rand_case(gen, dtype, group, head_dim, block_size, num_seqs=3, rows=2, hk=2, num_pages=97):
    hq = hk * group
    geo = ops.KvGeometry(hq, hk, head_dim, block_size)
    k_pages = torch.randn(num_pages, hk, block_size, head_dim, generator=gen).to(dtype)
    v_pages = torch.randn(num_pages, hk, block_size, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    lists, last = [], []
    for _ in range(num_seqs):
        n = int(torch.randint(1, 11, (1,), generator=gen))
        lists.append([perm.pop() for _ in range(n)])
        last.append(int(torch.randint(1, block_size + 1, (1,), generator=gen)))
    indptr = [0]
    for lst in lists:
        indptr.append(indptr[-1] + len(lst))
    flat = [p for lst in lists for p in lst]
    # Head-wise mapping: random logical ids, about a quarter of the entries empty; last pages valid.
    page_map = torch.randint(0, 1000, (num_pages, hk), generator=gen, dtype=torch.int32)
    page_map[torch.rand(num_pages, hk, generator=gen) < 0.25] = -1
    for lst in lists:
        page_map[lst[-1]] = 5000
    q = torch.randn(num_seqs, rows, hq, head_dim, generator=gen).to(dtype)
    extra_k = torch.randn(num_seqs, hk, head_dim, generator=gen).to(dtype) if rows > 1 else None
    extra_v = torch.randn(num_seqs, hk, head_dim, generator=gen).to(dtype) if rows > 1 else None
    return geo, q, k_pages, v_pages, i32(indptr), i32(flat), i32(last), page_map, extra_k, extra_v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_sparse_attention_matches_float64_reference(dtype, group, head_dim, block_size):
    gen = torch.Generator().manual_seed(hash((str(dtype), group, head_dim, block_size)) % 2**31)
    geo, q, kp, vp, indptr, indices, last, pmap, ek, ev = _rand_case(gen, dtype, group, head_dim, block_size)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    ops.decode_attention(
        geo, q, kp, vp, indptr, indices, last, page_map=pmap, extra_k=ek, extra_v=ev, out=out
    )
    ref = ref_decode_attention(q, kp, vp, indptr, indices, last, pmap, ek, ev)
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", GROUPS)
def test_full_budget_working_set_equals_dense_bit_exact(dtype, group):
    """A working set that holds every block, in shuffled slots, gives exactly the dense output."""
    gen = torch.Generator().manual_seed(7 + group)
    hk, d, b, n_blocks, last = 2, 64, 16, 13, 7
    geo = ops.KvGeometry(hk * group, hk, d, b)
    num_pages = 64
    kp = torch.randn(num_pages, hk, b, d, generator=gen).to(dtype)
    vp = torch.randn(num_pages, hk, b, d, generator=gen).to(dtype)
    dense_pages = list(range(n_blocks))  # logical block i in page i; the last is the local block
    page_map = torch.full((num_pages, hk), -1, dtype=torch.int32)
    for i in dense_pages:
        page_map[i] = i
    # Sparse copy: budget of 20 slots, complete blocks scattered over them per head, 7 empty slots.
    slots = list(range(30, 50))
    local = 60
    kp[local], vp[local] = kp[n_blocks - 1], vp[n_blocks - 1]
    page_map[local] = n_blocks - 1
    for h in range(hk):
        order = torch.randperm(len(slots), generator=gen).tolist()[: n_blocks - 1]
        for blk, slot_i in enumerate(order):
            page = slots[slot_i]
            kp[page, h], vp[page, h] = kp[blk, h], vp[blk, h]
            page_map[page, h] = blk
    q = torch.randn(1, 2, hk * group, d, generator=gen).to(dtype)
    ek = torch.randn(1, hk, d, generator=gen).to(dtype)
    ev = torch.randn(1, hk, d, generator=gen).to(dtype)
    dense = ops.decode_attention(
        geo,
        q,
        kp,
        vp,
        i32([0, n_blocks]),
        i32(dense_pages),
        i32([last]),
        page_map=page_map,
        extra_k=ek,
        extra_v=ev,
    )
    sparse = ops.decode_attention(
        geo,
        q,
        kp,
        vp,
        i32([0, len(slots) + 1]),
        i32(slots + [local]),
        i32([last]),
        page_map=page_map,
        extra_k=ek,
        extra_v=ev,
    )
    assert torch.equal(dense, sparse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
def test_score_and_topk_match_reference(dtype, group):
    gen = torch.Generator().manual_seed(11)
    hk, d, n_host = 3, 64, 101
    geo = ops.KvGeometry(hk * group, hk, d, 16)
    keys = torch.randn(n_host, hk, 16, d, generator=gen).to(dtype)
    summaries = torch.empty(n_host, hk, 2, d, dtype=dtype)
    ops.build_summaries(geo, keys, i32(list(range(n_host))), i32([16] * n_host), summaries)
    torch.testing.assert_close(summaries[:, :, 0], keys.amin(dim=2), atol=0, rtol=0)
    torch.testing.assert_close(summaries[:, :, 1], keys.amax(dim=2), atol=0, rtol=0)
    lens = [54, 1, 37]
    perm = torch.randperm(n_host, generator=gen).tolist()
    blk_indptr = i32([0, 54, 55, 92])
    blk_indices = i32(perm[: sum(lens)])
    q = torch.randn(3, hk * group, d, generator=gen).to(dtype)
    scores = ops.score_blocks(geo, q, summaries, blk_indptr, blk_indices)
    ref = ref_score_blocks(q, summaries, blk_indptr, blk_indices)
    atol, rtol = TOL[torch.float32]
    torch.testing.assert_close(scores.double(), ref, atol=1e-3 * d * group, rtol=max(rtol, 1e-4))
    k = 16
    top = ops.topk_blocks(hk, scores, blk_indptr, k)
    assert top.shape == (3, hk, k)
    for s, n in enumerate(lens):
        seg = scores[int(blk_indptr[s]) : int(blk_indptr[s + 1])]
        for h in range(hk):
            chosen = top[s, h]
            valid = chosen[chosen >= 0]
            assert valid.numel() == min(k, n)
            assert (chosen[valid.numel() :] == -1).all()
            assert len(set(valid.tolist())) == valid.numel()
            if n > k:  # top-K by threshold: every chosen score >= the k-th best
                kth = torch.topk(seg[:, h], k).values[-1]
                assert (seg[valid.long(), h] >= kth).all()
            got = seg[valid.long(), h]
            assert (got[:-1] >= got[1:]).all(), "best first"


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_writes_through_and_updates_summary(dtype):
    gen = torch.Generator().manual_seed(3)
    hk, d, b = 2, 8, 4
    geo = ops.KvGeometry(4, hk, d, b)
    kp = torch.zeros(6, hk, b, d, dtype=dtype)
    vp = torch.zeros_like(kp)
    hk_pool = torch.zeros(5, hk, b, d, dtype=dtype)
    hv_pool = torch.zeros_like(hk_pool)
    summ = torch.zeros(5, hk, 2, d, dtype=dtype)
    toks_k, toks_v = [], []
    for off in range(b):
        k_new = torch.randn(2, hk, d, generator=gen).to(dtype)
        v_new = torch.randn(2, hk, d, generator=gen).to(dtype)
        toks_k.append(k_new)
        toks_v.append(v_new)
        # seq 0 is sparse (page 3 mirrors host block 2), seq 1 dense (page 5, no write-through)
        ops.append_kv(
            geo, k_new, v_new, i32([3, 5]), i32([off, off]), i32([2, -1]), kp, vp, hk_pool, hv_pool, summ
        )
    ks = torch.stack(toks_k)  # [b, seqs, hk, d]
    assert torch.equal(kp[3], ks[:, 0].transpose(0, 1))
    assert torch.equal(kp[5], ks[:, 1].transpose(0, 1))
    assert torch.equal(vp[5], torch.stack(toks_v)[:, 1].transpose(0, 1))
    assert torch.equal(hk_pool[2], kp[3]) and torch.equal(hv_pool[2], vp[3])
    assert torch.equal(summ[2, :, 0], ks[:, 0].amin(dim=0)) and torch.equal(
        summ[2, :, 1], ks[:, 0].amax(dim=0)
    )
    assert not hk_pool[[0, 1, 3, 4]].any(), "dense sequences are not written through"


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_rows_apart_from_block_ids(dtype):
    """Host rows (host_k/host_v) and block ids (summaries, codes) as separate pools: append_kv writes
    K/V to ``host_rows[s]`` and the summary to ``host_block_ids[s]``; build_summaries and
    build_key_codes read the keys of block ``ids[i]`` from row ``rows[i]``. Checked against a
    reference that walks the rows token by token, and against rows = ids after moving the rows."""
    gen = torch.Generator().manual_seed(11)
    hk, d, b, n_rows, n_ids = 2, 8, 5, 3, 7
    geo = ops.KvGeometry(4, hk, d, b)
    kp = torch.zeros(2, hk, b, d, dtype=dtype)
    vp = torch.zeros_like(kp)
    hkp = torch.zeros(n_rows, hk, b, d, dtype=dtype)
    hvp = torch.zeros_like(hkp)
    summ = torch.zeros(n_ids, hk, 2, d, dtype=dtype)
    # seq 0: block 6 in row 1, seq 1: block 4 in row 0.
    ids, rows = [6, 4], [1, 0]
    toks = []
    for off in range(b):
        k_new = torch.randn(2, hk, d, generator=gen).to(dtype)
        toks.append(k_new)
        ops.append_kv(
            geo,
            k_new,
            -k_new,
            i32([0, 1]),
            i32([off] * 2),
            i32(ids),
            kp,
            vp,
            hkp,
            hvp,
            summ,
            host_rows=i32(rows),
        )
    ks = torch.stack(toks)  # [b, seqs, hk, d]
    for s, (blk, row) in enumerate(zip(ids, rows, strict=True)):
        assert torch.equal(hkp[row], ks[:, s].transpose(0, 1)) and torch.equal(hvp[row], -hkp[row])
        assert torch.equal(summ[blk, :, 0], ks[:, s].amin(0)) and torch.equal(
            summ[blk, :, 1], ks[:, s].amax(0)
        )
    assert not hkp[2].any() and not summ[[0, 1, 2, 3, 5]].any()
    # Rebuild the summaries from the rows: the same bits; then the codes.
    again = torch.zeros_like(summ)
    ops.build_summaries(geo, hkp, i32(ids), i32([b, 3]), again, block_rows=i32(rows))
    assert torch.equal(again[6], summ[6])
    for t in range(3):  # block 4 over its first 3 tokens, walked by hand
        assert (again[4, :, 0] <= hkp[0, :, t]).all() and (again[4, :, 1] >= hkp[0, :, t]).all()
    assert torch.equal(again[4, :, 0], hkp[0, :, :3].amin(1))
    codes = torch.full((n_ids, hk, b, d // 4), 0xAB, dtype=torch.uint8)
    bounds = ops.empty_bounds8(geo, n_ids)
    ops.build_bounds8(geo, summ, i32(ids), *bounds)
    ops.build_key_codes(geo, hkp, *bounds, i32(ids), codes, block_rows=i32(rows))
    moved = torch.zeros(n_ids, hk, b, d, dtype=dtype)
    moved[ids] = hkp[rows]
    want = torch.full_like(codes, 0xAB)
    ops.build_key_codes(geo, moved, *bounds, i32(ids), want)
    assert torch.equal(codes, want)
    # A row past the host pool is a typed error, though the id is in range; nothing is written.
    before = summ.clone()
    with pytest.raises(errors.IndexError_, match="host_rows"):
        ops.append_kv(
            geo,
            ks[0],
            ks[0],
            i32([0, 1]),
            i32([0, 0]),
            i32(ids),
            kp,
            vp,
            hkp,
            hvp,
            summ,
            host_rows=i32([1, 3]),
        )
    with pytest.raises(errors.IndexError_, match="block_rows"):
        ops.build_summaries(geo, hkp, i32([6]), i32([1]), summ, block_rows=i32([n_rows]))
    with pytest.raises(errors.ShapeError, match="block_rows"):
        ops.build_key_codes(geo, hkp, *bounds, i32([6]), codes, block_rows=i32([0, 1]))
    assert torch.equal(summ, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_select_and_gather_bit_exact(dtype):
    gen = torch.Generator().manual_seed(5)
    hk, d, b, cap = 2, 16, 4, 3
    geo = ops.KvGeometry(2, hk, d, b)
    host_k = torch.randn(40, hk, b, d, generator=gen).to(dtype)
    host_v = torch.randn(40, hk, b, d, generator=gen).to(dtype)
    kp = torch.full((20, hk, b, d), float("nan"), dtype=dtype)
    vp = kp.clone()
    page_map = torch.full((20, hk), -1, dtype=torch.int32)
    last_sel = torch.full((20, hk), -1, dtype=torch.int32)
    slot_pages = i32([[2, 4, 6, 8, 10, 12]])
    host_blocks = torch.randperm(40, generator=gen)[:15].to(torch.int32)
    predicted = i32([[[3, 9, 1, 14, 0, -1], [7, 2, -1, -1, -1, -1]]])
    ps, pb, (pairs, kept, missing) = ops.delta_select(hk, predicted, slot_pages, page_map, last_sel, 0, cap)
    assert pairs == 3 + 2 and kept == 0 and missing == 5 + 2
    copied = ops.gather_blocks(geo, ps, pb, slot_pages, i32([0, 15]), host_blocks, host_k, host_v, kp, vp)
    assert copied == pairs
    for h in range(hk):
        for page in slot_pages[0].tolist():
            blk = int(page_map[page, h])
            if blk >= 0:
                assert torch.equal(kp[page, h], host_k[int(host_blocks[blk]), h])
                assert torch.equal(vp[page, h], host_v[int(host_blocks[blk]), h])
    assert ((page_map[slot_pages[0].long()] >= 0).sum(dim=0) == torch.tensor([3, 2])).all()


def test_copy_pages_bit_exact():
    geo = ops.KvGeometry(2, 1, 8, 4)
    src_k = torch.randn(5, 1, 4, 8).to(torch.bfloat16)
    src_v = torch.randn(5, 1, 4, 8).to(torch.bfloat16)
    dst_k, dst_v = (
        torch.zeros(7, 1, 4, 8, dtype=torch.bfloat16),
        torch.zeros(7, 1, 4, 8, dtype=torch.bfloat16),
    )
    ops.copy_pages(geo, src_k, src_v, i32([4, 0]), dst_k, dst_v, i32([1, 6]))
    assert torch.equal(dst_k[1], src_k[4]) and torch.equal(dst_v[6], src_v[0])


# ---------------------------------------------------------------- bad input: typed errors, no crash
def _attn_args():
    gen = torch.Generator().manual_seed(0)
    return _rand_case(gen, torch.float32, 2, 16, 4, num_seqs=2)


def test_wrong_dtype_is_a_typed_error():
    geo, q, kp, vp, indptr, indices, last, pmap, ek, ev = _attn_args()
    with pytest.raises(errors.DTypeError, match="int32"):
        ops.decode_attention(
            geo, q, kp, vp, indptr.long(), indices, last, page_map=pmap, extra_k=ek, extra_v=ev
        )
    with pytest.raises(errors.DTypeError, match="one dtype"):
        ops.decode_attention(
            geo, q.half(), kp, vp, indptr, indices, last, page_map=pmap, extra_k=ek, extra_v=ev
        )
    with pytest.raises(TypeError):  # DTypeError is a TypeError
        ops.decode_attention(geo, q.double(), kp.double(), vp.double(), indptr, indices, last)


def test_wrong_shape_is_a_typed_error():
    geo, q, kp, vp, indptr, indices, last, pmap, ek, ev = _attn_args()
    with pytest.raises(errors.ShapeError, match="k_pages"):
        ops.decode_attention(geo, q, kp[:, :, :3].contiguous(), vp, indptr, indices, last)
    with pytest.raises(errors.ShapeError, match="contiguous"):
        ops.decode_attention(geo, q.transpose(2, 3), kp, vp, indptr, indices, last)
    with pytest.raises(ValueError):
        ops.decode_attention(geo, q, kp, vp, indptr[:-1], indices, last)


def test_wrong_device_is_a_typed_error():
    geo, q, kp, vp, indptr, indices, last, pmap, ek, ev = _attn_args()
    with pytest.raises(errors.DeviceError, match="cpu"):
        ops.decode_attention(geo, q.to("meta"), kp, vp, indptr, indices, last)


def test_bad_table_entries_and_aliasing_are_typed_errors():
    geo, q, kp, vp, indptr, indices, last, pmap, ek, ev = _attn_args()
    bad = indices.clone()
    bad[0] = kp.shape[0] + 3
    out = torch.zeros_like(q)
    with pytest.raises(IndexError, match="kv_indices"):
        ops.decode_attention(geo, q, kp, vp, indptr, bad, last, out=out)
    assert not out.any(), "a rejected call writes nothing"
    with pytest.raises(errors.InvalidArgumentError, match="share memory"):
        ops.decode_attention(geo, q, kp, vp, indptr, indices, last, out=q)
    with pytest.raises(errors.OasisError):
        ops.decode_attention(
            geo, q[:, :1].contiguous(), kp, vp, indptr, indices, last, extra_k=ek[:, :], extra_v=ev
        )
    # The process survives and the next valid call works.
    ops.decode_attention(geo, q, kp, vp, indptr, indices, last, page_map=pmap, extra_k=ek, extra_v=ev)


def test_block_pool_errors():
    pool = ops.BlockPool("gpu", 4)
    a = pool.allocate(3)
    with pytest.raises(errors.OutOfBlocksError, match="requested 2, free 1"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.free(a)
    with pytest.raises(errors.InvalidArgumentError):
        pool.free(a)
    with pytest.raises(errors.ConfigError):
        ops.BlockPool("disk", 4)
    with pytest.raises(errors.ConfigError):
        ops.KvGeometry(6, 4, 64, 16)


def test_block_pool_too_large_raises_instead_of_aborting():
    """BlockPool('gpu', 2**40) used to abort the process (SIGABRT from a huge allocation)."""
    with pytest.raises(errors.ConfigError, match="at most 2147483647 blocks"):
        ops.BlockPool("gpu", 2**40)
    with pytest.raises(ValueError, match="num_blocks=2147483648"):
        ops.BlockPool("host", 2**31)
    # An allocation the allocator refuses is an OutOfMemoryError (a MemoryError), tested in Rust
    # (oasis-core error::tests); here the process survives and the next pool works.
    assert issubclass(errors.OutOfMemoryError, MemoryError)
    assert ops.BlockPool("gpu", 3).num_free == 3


def test_enormous_geometry_is_a_config_error():
    with pytest.raises(errors.ConfigError, match="overflow"):
        ops.KvGeometry(2**62, 2**62, 256, 2**62)
    with pytest.raises(errors.ConfigError, match="overflow"):
        ops.KvGeometry(2, 1, 256, 2**63)
    assert ops.KvGeometry(2, 1, 64, 2**40).block_size == 2**40


HUGE = [0, 1, 132, 2**40, 2**63, 2**64 - 1]


@pytest.mark.parametrize("num_sms", HUGE)
@pytest.mark.parametrize("num_seqs", HUGE)
@pytest.mark.parametrize("max_pages", HUGE)
def test_plan_num_splits_is_total(num_sms, num_seqs, max_pages):
    """It divided by zero on huge arguments (reported as 'internal error')."""
    for heads in (0, 8, 2**64 - 1):
        assert 1 <= _core.plan_num_splits(num_sms, num_seqs, heads, max_pages) <= 256


def test_workspace_len_overflow_is_a_typed_error():
    assert _core.decode_attn_workspace_len(3, 2, 4, 64, 5) == 3 * 2 * 4 * 5 * 65
    with pytest.raises(errors.InvalidArgumentError, match="overflows"):
        _core.decode_attn_workspace_len(2**40, 2**20, 64, 128, 256)
    with pytest.raises(errors.InvalidArgumentError, match="overflows"):
        _core.decode_attn_workspace_len(1, 1, 1, 2**64 - 1, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_propagates_through_decode_attention(dtype):
    """NaN in q, K or V gives NaN in exactly the outputs that see it, never zeros (the softmax max
    skipped NaN: a NaN model decoded zeros and exited 0)."""
    gen = torch.Generator().manual_seed(9)
    geo, q, kp, vp, indptr, indices, last, _, ek, ev = _rand_case(gen, dtype, 2, 16, 4, num_seqs=3)
    group = geo.num_qo_heads // geo.num_kv_heads
    clean = ops.decode_attention(geo, q, kp, vp, indptr, indices, last, extra_k=ek, extra_v=ev)
    assert torch.isfinite(clean).all()
    q[0, 0, 1, 3] = float("nan")  # seq 0, row 0, query head 1
    kp[int(indices[int(indptr[1])]), 1, 0, 5] = float("nan")  # seq 1, KV head 1, a full page's token 0
    vp[int(indices[int(indptr[2])]), 0, 0, 7] = float("nan")  # seq 2, KV head 0, token 0, dim 7
    out = ops.decode_attention(geo, q, kp, vp, indptr, indices, last, extra_k=ek, extra_v=ev)
    want = torch.zeros_like(out, dtype=torch.bool)
    want[0, 0, 1, :] = True
    want[1, :, group : 2 * group, :] = True
    want[2, :, :group, 7] = True
    assert torch.equal(out.isnan(), want)
    torch.testing.assert_close(out[~want], clean[~want])


def _malformed_cases():
    """The CPU calls of every kernel that takes a CSR table, as (name, table, call(indptr), outputs)."""
    gen = torch.Generator().manual_seed(4)
    geo, q, kp, vp, indptr, indices, last, pmap, ek, ev = _rand_case(gen, torch.float32, 2, 16, 4)
    out = torch.zeros_like(q)
    yield (
        "decode_attention",
        indptr,
        lambda p: ops.decode_attention(
            geo, q, kp, vp, p, indices, last, page_map=pmap, extra_k=ek, extra_v=ev, out=out
        ),
        [out],
    )
    hk, d, n_host = geo.num_kv_heads, geo.head_dim, 20
    summaries = torch.randn(n_host, hk, 2, d, generator=gen)
    blk_indptr = i32([0, 5, 6, 11])
    blk_indices = torch.randperm(n_host, generator=gen)[:11].to(torch.int32)
    qs = torch.randn(3, geo.num_qo_heads, d, generator=gen)
    scores = torch.zeros(11, hk)
    yield (
        "score_blocks",
        blk_indptr,
        lambda p: ops.score_blocks(geo, qs, summaries, p, blk_indices, scores=scores),
        [scores],
    )
    top = torch.zeros(3, hk, 4, dtype=torch.int32)
    yield (
        "topk_blocks",
        blk_indptr,
        lambda p: ops.topk_blocks(hk, torch.randn(11, hk), p, 4, out=top),
        [top],
    )
    host_k = torch.randn(n_host, hk, 4, d, generator=gen)
    pages_k, pages_v = torch.zeros(9, hk, 4, d), torch.zeros(9, hk, 4, d)
    plan_slots = torch.zeros(3, hk, 1, dtype=torch.int32)
    plan_blocks = torch.zeros(3, hk, 1, dtype=torch.int32)
    slot_pages = i32([[0, 1], [2, 3], [4, 5]])
    yield (
        "gather_blocks",
        blk_indptr,
        lambda p: ops.gather_blocks(
            geo, plan_slots, plan_blocks, slot_pages, p, blk_indices, host_k, host_k.clone(), pages_k, pages_v
        ),
        [pages_k, pages_v],
    )


@pytest.mark.parametrize("case", MALFORMED_INDPTR)
def test_malformed_csr_tables_are_typed_errors_on_the_cpu(case):
    """Every kernel that takes kv_indptr / blk_indptr / host_indptr rejects a malformed one before
    writing anything (the GPU reads it row by row instead: test_gpu_kernels.py)."""
    for name, indptr, call, outputs in _malformed_cases():
        call(indptr)  # the well-formed table works
        for o in outputs:
            o.fill_(7)
        before = [o.clone() for o in outputs]
        with pytest.raises(errors.OasisError) as info:
            call(malformed_indptr(indptr, case))
        assert isinstance(info.value, ValueError), f"{name}: {info.value!r}"
        assert "indptr" in str(info.value) or "indices" in str(info.value) or "scores" in str(info.value), (
            name
        )
        for o, b in zip(outputs, before, strict=True):
            assert torch.equal(o, b), f"{name}: output written on error"


def test_topk_index_map_is_topk_then_a_gather():
    """``topk_blocks(..., index_map=m)`` answers each chosen position ``i`` as ``m[s, h, i]``: the
    same as taking the positions and gathering them (the two-stage codes score's last step), with
    the -1 padding kept and a position past the map's width as -1; a map of the wrong shape raises."""
    gen = torch.Generator().manual_seed(7)
    hk, k = 3, 6
    lens = [9, 4, 0, 6]
    blk_indptr = i32([0, 9, 13, 13, 19])
    scores = torch.randn(19, hk, generator=gen)
    width = 9
    index_map = torch.randint(-1, 500, (len(lens), hk, width), generator=gen, dtype=torch.int32)
    pos = ops.topk_blocks(hk, scores, blk_indptr, k)
    got = ops.topk_blocks(hk, scores, blk_indptr, k, index_map=index_map)
    want = index_map.gather(2, pos.clamp(min=0).long()).masked_fill_(pos < 0, -1)
    assert torch.equal(got, want) and (got[2] == -1).all() and (got[1, :, 4:] == -1).all()
    narrow = index_map[:, :, :5].contiguous()  # sequence 0 has 9 entries: positions 5.. map to -1
    got5 = ops.topk_blocks(hk, scores, blk_indptr, k, index_map=narrow)
    want5 = torch.where((pos >= 0) & (pos < 5), narrow.gather(2, pos.clamp(0, 4).long()), torch.tensor(-1))
    assert torch.equal(got5, want5) and (pos[0] >= 5).any()
    with pytest.raises(ValueError):
        ops.topk_blocks(hk, scores, blk_indptr, k, index_map=index_map[:3])
    with pytest.raises(TypeError):
        ops.topk_blocks(hk, scores, blk_indptr, k, index_map=index_map.long())
