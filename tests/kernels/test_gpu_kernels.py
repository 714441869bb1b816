"""The CUDA kernels (through oasiskv.ops on CUDA tensors) against their CPU twins.

The oracle of every GPU run is the CPU twin run on the same inputs copied to the CPU; the float64
references of tests/support/reference.py are added where they are cheap. Outputs are poisoned before each
run, so every element the kernel must write is checked. Copies (append, gather, copy_pages, the
summaries) and the selection (integer logic) must match bit for bit; attention and scores within
the tolerance table. Every test needs a CUDA GPU (`make test-gpu`); out of GPU memory is a skip.
"""

from __future__ import annotations

import pytest
import torch

from oasiskv import _core, errors, ops
from support.kernels import (
    HOSTS,
    INT_POISON,
    POISON,
    assert_bits_equal,
    bits,
    host,
    rand,
    select_state,
    tied_scores,
    topk_candidates_case,
)
from support.reference import (
    ATTN_TOL,
    DEV,
    MALFORMED_INDPTR,
    back,
    csr,
    csr_rows,
    dev,
    gpu_test,
    i32,
    malformed_indptr,
    ref_decode_attention,
    ref_score_blocks,
    seeded,
)

# Private names read here: ``oasiskv._core`` where the binding itself is checked (what ``ops`` does
# not expose): ``decode_attn_workspace_len`` and ``decode_attention``'s workspace argument,
# ``delta_select`` with its outputs given, ``cuda_status`` and ``compile_kernels``.

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HEAD_DIMS = [64, 128]
GROUPS = [1, 2, 4, 8]
PAGE_COUNTS = [1, 7, 129]  # pages of the longest sequence of a batch: odd on purpose
BLOCK_SIZE = 16
SPLITS = [1, 2, 5, 0]  # split-KV counts forced through ops; 0 = planned from the SM count
B = BLOCK_SIZE


# ---------------------------------------------------------------- decode attention
def _attn_case(gen, dtype, group, head_dim, n_pages, hk=2):
    """Three sequences of n_pages, n_pages // 2 and 1 pages scattered over a pool with spare pages,
    a head-wise map with a quarter of the entries empty, two query rows and the extra K/V."""
    lens = [n_pages, max(1, n_pages // 2), 1]
    num_pages = sum(lens) + 13
    hq = hk * group
    geo = ops.KvGeometry(hq, hk, head_dim, B)
    kp = rand(gen, dtype, num_pages, hk, B, head_dim)
    vp = rand(gen, dtype, num_pages, hk, B, head_dim)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    lists = [[perm.pop() for _ in range(n)] for n in lens]
    indices = i32([p for lst in lists for p in lst])
    last = i32([int(torch.randint(1, B + 1, (1,), generator=gen)) for _ in lens])
    page_map = torch.randint(0, 1000, (num_pages, hk), generator=gen, dtype=torch.int32)
    page_map[torch.rand(num_pages, hk, generator=gen) < 0.25] = -1
    q2 = rand(gen, dtype, len(lens), 2, hq, head_dim)
    ek = rand(gen, dtype, len(lens), hk, head_dim)
    ev = rand(gen, dtype, len(lens), hk, head_dim)
    return geo, kp, vp, csr(lens), indices, last, page_map, q2, ek, ev


@gpu_test
@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("n_pages", PAGE_COUNTS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_matches_cpu_twin(dtype, head_dim, group, n_pages, with_map):
    gen = seeded("attn", dtype, head_dim, group, n_pages, with_map)
    geo, kp, vp, indptr, indices, last, pmap, q2, ek, ev = _attn_case(gen, dtype, group, head_dim, n_pages)
    pmap = pmap if with_map else None
    atol, rtol = ATTN_TOL[dtype]
    g_kp, g_vp, g_indptr, g_indices, g_last, g_pmap = map(dev, (kp, vp, indptr, indices, last, pmap))
    for rows in (2, 1):  # two rows with the extra K/V; one row without
        q = q2[:, :rows].contiguous()
        xk, xv = (ek, ev) if rows == 2 else (None, None)
        want = ops.decode_attention(
            geo, q, kp, vp, indptr, indices, last, page_map=pmap, extra_k=xk, extra_v=xv
        )
        if n_pages <= 7:  # the float64 walk over the tables is cheap here
            ref = ref_decode_attention(q, kp, vp, indptr, indices, last, pmap, xk, xv)
            torch.testing.assert_close(want.double(), ref, atol=atol, rtol=rtol)
        g_q, g_xk, g_xv = dev(q), dev(xk), dev(xv)
        for splits in SPLITS:
            out = torch.full_like(g_q, POISON)
            got = ops.decode_attention(
                geo,
                g_q,
                g_kp,
                g_vp,
                g_indptr,
                g_indices,
                g_last,
                page_map=g_pmap,
                extra_k=g_xk,
                extra_v=g_xv,
                out=out,
                num_splits=splits,
                max_pages_per_seq=n_pages if splits == 0 else 0,
            )
            assert got is out
            torch.testing.assert_close(
                back(out),
                want,
                atol=atol,
                rtol=rtol,
                msg=lambda m, r=rows, s=splits: f"rows={r} num_splits={s}: {m}",
            )


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_kv_planned_from_kv_indices_and_on_a_side_stream(dtype):
    """No max_pages_per_seq: the plan is bounded by len(kv_indices); the call follows the current
    stream (here a side stream)."""
    gen = seeded("attn-side", dtype)
    geo, kp, vp, indptr, indices, last, pmap, q2, ek, ev = _attn_case(gen, dtype, 4, 128, 129)
    want = ops.decode_attention(geo, q2, kp, vp, indptr, indices, last, page_map=pmap, extra_k=ek, extra_v=ev)
    args = [dev(t) for t in (q2, kp, vp, indptr, indices, last)]
    g_pmap, g_ek, g_ev = dev(pmap), dev(ek), dev(ev)
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(side):
        out = torch.full_like(args[0], POISON)
        ops.decode_attention(geo, *args, page_map=g_pmap, extra_k=g_ek, extra_v=g_ev, out=out)
    side.synchronize()
    torch.testing.assert_close(out.cpu(), want, atol=ATTN_TOL[dtype][0], rtol=ATTN_TOL[dtype][1])


@gpu_test
def test_split_kv_needs_a_workspace_of_the_documented_size():
    gen = seeded("ws")
    dtype = torch.bfloat16
    geo, kp, vp, indptr, indices, last, pmap, q2, ek, ev = _attn_case(gen, dtype, 2, 64, 7)
    want = ops.decode_attention(geo, q2, kp, vp, indptr, indices, last, page_map=pmap, extra_k=ek, extra_v=ev)
    g = [dev(t) for t in (q2, kp, vp, indptr, indices, last, pmap, ek, ev)]
    stream = torch.cuda.current_stream(DEV).cuda_stream
    ns, rows = q2.shape[:2]
    need = _core.decode_attn_workspace_len(ns, rows, geo.num_qo_heads, geo.head_dim, 4)
    assert need == ns * rows * geo.num_qo_heads * 4 * (geo.head_dim + 1)
    out = torch.full_like(g[0], POISON)
    with pytest.raises(errors.InvalidArgumentError, match=str(need)):
        _core.decode_attention(geo, *g, 0.125, out, num_splits=4, stream=stream)
    with pytest.raises(errors.ShapeError, match="workspace"):
        small = torch.empty(need - 1, dtype=torch.float32, device=DEV)
        _core.decode_attention(geo, *g, 0.125, out, num_splits=4, workspace=small, stream=stream)
    with pytest.raises(errors.DTypeError, match="workspace"):
        wrong = torch.empty(need, dtype=torch.float16, device=DEV)
        _core.decode_attention(geo, *g, 0.125, out, num_splits=4, workspace=wrong, stream=stream)
    ws = torch.empty(need, dtype=torch.float32, device=DEV)
    _core.decode_attention(geo, *g, geo.head_dim**-0.5, out, num_splits=4, workspace=ws, stream=stream)
    torch.testing.assert_close(back(out), want, atol=ATTN_TOL[dtype][0], rtol=ATTN_TOL[dtype][1])


@gpu_test
def test_out_of_range_table_entries_are_skipped_on_the_gpu():
    """Table contents are not validated on the GPU (that would need a synchronisation): a page id
    past the pool is skipped where the CPU raises, and the device stays usable."""
    gen = seeded("bad-entry")
    dtype = torch.float32
    geo, kp, vp, indptr, indices, last, pmap, q2, ek, ev = _attn_case(gen, dtype, 2, 64, 7)
    bad = indices.tolist()
    bad.insert(2, kp.shape[0] + 1000)  # in the middle of sequence 0: its last page keeps last_len
    bad_indptr = indptr.clone()
    bad_indptr[1:] += 1
    with pytest.raises(IndexError):
        ops.decode_attention(geo, q2, kp, vp, bad_indptr, i32(bad), last, extra_k=ek, extra_v=ev)
    want = ops.decode_attention(geo, q2, kp, vp, indptr, indices, last, extra_k=ek, extra_v=ev)
    out = ops.decode_attention(
        geo,
        dev(q2),
        dev(kp),
        dev(vp),
        dev(bad_indptr),
        dev(i32(bad)),
        dev(last),
        extra_k=dev(ek),
        extra_v=dev(ev),
        num_splits=1,
    )
    torch.testing.assert_close(back(out), want, atol=ATTN_TOL[dtype][0], rtol=ATTN_TOL[dtype][1])
    # The context is healthy: a valid call right after works.
    again = ops.decode_attention(
        geo,
        dev(q2),
        dev(kp),
        dev(vp),
        dev(indptr),
        dev(indices),
        dev(last),
        extra_k=dev(ek),
        extra_v=dev(ev),
        num_splits=3,
    )
    torch.testing.assert_close(back(again), want, atol=ATTN_TOL[dtype][0], rtol=ATTN_TOL[dtype][1])


# ---------------------------------------------------------------- malformed CSR tables
# The kernels check each kv_indptr / blk_indptr / host_indptr row against the length of its
# indices and read a malformed row as empty (docs/CORE_CONTRACT.md, last section): no read outside
# the tables (run these under compute-sanitizer memcheck: -k malformed), the well-formed rows as
# the CPU twin computes them alone, and the device usable afterwards.
def _attn_malformed_expected(geo, q2, kp, vp, indptr, indices, last, pmap, ek, ev):
    """Sequence by sequence on the CPU: a well-formed non-empty row is the twin on that row alone;
    a malformed (or empty) one has no pages: zeros in row 0, the extra value in row 1."""
    group = geo.num_qo_heads // geo.num_kv_heads
    want = torch.zeros_like(q2)
    for s, row in enumerate(csr_rows(indptr, indices.numel())):
        if row is None or row[0] == row[1]:
            want[s, 1] = ev[s].repeat_interleave(group, dim=0)
            continue
        b, e = row
        sl = slice(s, s + 1)
        want[sl] = ops.decode_attention(
            geo,
            q2[sl],
            kp,
            vp,
            i32([0, e - b]),
            indices[b:e],
            last[sl],
            page_map=pmap,
            extra_k=ek[sl],
            extra_v=ev[sl],
        )
    return want


@gpu_test
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # tensor-core and generic kernels
@pytest.mark.parametrize("case", MALFORMED_INDPTR)
def test_malformed_kv_indptr_reads_as_empty_rows(case, dtype, splits):
    gen = seeded("malformed-attn", case, dtype, splits)
    geo, kp, vp, indptr, indices, last, pmap, q2, ek, ev = _attn_case(gen, dtype, 2, 64, 7)
    bad = malformed_indptr(indptr, case)
    with pytest.raises(ValueError):  # the CPU twin rejects it
        ops.decode_attention(geo, q2, kp, vp, bad, indices, last, page_map=pmap, extra_k=ek, extra_v=ev)
    want = _attn_malformed_expected(geo, q2, kp, vp, bad, indices, last, pmap, ek, ev)
    out = torch.full_like(dev(q2), POISON)
    g = [dev(t) for t in (q2, kp, vp, bad, indices, last)]
    ops.decode_attention(
        *[geo, *g], page_map=dev(pmap), extra_k=dev(ek), extra_v=dev(ev), out=out, num_splits=splits
    )
    torch.testing.assert_close(back(out), want, atol=ATTN_TOL[dtype][0], rtol=ATTN_TOL[dtype][1])
    # The device is healthy: the well-formed table right after gives the twin's result.
    good = ops.decode_attention(geo, q2, kp, vp, indptr, indices, last, page_map=pmap, extra_k=ek, extra_v=ev)
    g[3] = dev(indptr)
    again = ops.decode_attention(
        *[geo, *g], page_map=dev(pmap), extra_k=dev(ek), extra_v=dev(ev), num_splits=splits
    )
    torch.testing.assert_close(back(again), good, atol=ATTN_TOL[dtype][0], rtol=ATTN_TOL[dtype][1])


@gpu_test
@pytest.mark.parametrize("head_dim", [64, 40])  # the vector and the scalar scoring paths
@pytest.mark.parametrize("case", MALFORMED_INDPTR)
def test_malformed_blk_indptr_scores_minus_inf_and_topk_is_empty(case, head_dim):
    gen = seeded("malformed-score", case, head_dim)
    dtype, hk, group = torch.bfloat16, 2, 2
    lens = [40, 9, 37, 30]  # > 32 entries per row: rows span score tiles
    n_host = sum(lens) + 4
    geo = ops.KvGeometry(hk * group, hk, head_dim, B)
    summaries = rand(gen, dtype, n_host, hk, 2, head_dim)
    blk_indptr = csr(lens)
    nnz = int(blk_indptr[-1])
    blk_indices = torch.randperm(n_host, generator=gen)[:nnz].to(torch.int32)
    q = rand(gen, dtype, len(lens), hk * group, head_dim)
    bad = malformed_indptr(blk_indptr, case)
    with pytest.raises(ValueError):
        ops.score_blocks(geo, q, summaries, bad, blk_indices)
    # Every sequence's query against every entry, on the CPU: the candidates of entry j are the
    # sequences whose well-formed row holds j; an entry in none scores -inf.
    whole = i32([0, nnz])
    cand = [ops.score_blocks(geo, q[s : s + 1], summaries, whole, blk_indices) for s in range(len(lens))]
    rows = csr_rows(bad, nnz)
    scores = torch.full((nnz, hk), POISON, device=DEV)
    ops.score_blocks(geo, dev(q), dev(summaries), dev(bad), dev(blk_indices), scores=scores)
    got = back(scores)
    tol = dict(atol=1e-4 * head_dim * group, rtol=1e-4)
    # NOTE: the vector path (head_dim a multiple of 8) scores the entries of a well-formed row that
    # follows a malformed one in the same 32-entry tile against the wrong (in-bounds: every block
    # id is checked) summaries, as seen on the H200; only memory safety and the -inf of entries in
    # no row are promised there. The scalar path scores well-formed rows exactly.
    exact = head_dim % 8 != 0
    assert not torch.isnan(got).any(), "every entry is written (the poison is NaN)"
    for j in range(nnz):
        owners = [s for s, r in enumerate(rows) if r is not None and r[0] <= j < r[1]]
        if not owners:
            assert (got[j] == float("-inf")).all(), f"entry {j} is in no row: {got[j].tolist()}"
        elif not exact:
            assert (torch.isfinite(got[j]) | (got[j] == float("-inf"))).all(), f"entry {j}: {got[j]}"
        elif len(owners) == 1:
            torch.testing.assert_close(got[j], cand[owners[0]][j], **tol)
        else:  # overlapping rows: the query of one of them, or -inf
            ok = (got[j] == float("-inf")).all() or any(
                torch.allclose(got[j], cand[s][j], **tol) for s in owners
            )
            assert ok, f"entry {j}: {got[j].tolist()} matches none of rows {owners}"
    # Top-K over tie-free scores: a malformed row gives -1 everywhere, a well-formed one the twin
    # on that row alone.
    k = 16
    tie_free = torch.randn(nnz, hk, generator=gen)
    out = torch.full((len(lens), hk, k), INT_POISON, dtype=torch.int32, device=DEV)
    ops.topk_blocks(hk, dev(tie_free), dev(bad), k, out=out)
    top = back(out)
    for s, r in enumerate(rows):
        if r is None:
            assert (top[s] == -1).all(), f"seq {s}: malformed row must give -1"
        else:
            want = ops.topk_blocks(hk, tie_free[r[0] : r[1]].contiguous(), i32([0, r[1] - r[0]]), k)
            assert torch.equal(top[s], want[0]), f"seq {s}"
    # The device is healthy.
    assert torch.equal(
        back(ops.topk_blocks(hk, dev(tie_free), dev(blk_indptr), k)),
        ops.topk_blocks(hk, tie_free, blk_indptr, k),
    )


@gpu_test
@pytest.mark.parametrize("where", HOSTS)
@pytest.mark.parametrize("case", MALFORMED_INDPTR)
def test_malformed_host_indptr_gathers_nothing_for_that_row(case, where):
    gen = seeded("malformed-gather", case, where)
    dtype, ns, hk, budget, cap, d = torch.float16, 3, 2, 4, 3, 64
    n_logical = [12, 7, 9]
    n_host = sum(n_logical) + 5
    geo = ops.KvGeometry(2 * hk, hk, d, B)
    host_k, host_v = rand(gen, dtype, n_host, hk, B, d), rand(gen, dtype, n_host, hk, B, d)
    num_pages = ns * budget + 2
    kp = torch.full((num_pages, hk, B, d), POISON, dtype=dtype)
    vp = torch.full((num_pages, hk, B, d), POISON, dtype=dtype)
    slot_pages = torch.randperm(num_pages, generator=gen)[: ns * budget].view(ns, budget).to(torch.int32)
    host_indptr = csr(n_logical)
    nnz = int(host_indptr[-1])
    host_indices = torch.randperm(n_host, generator=gen)[:nnz].to(torch.int32)
    # Every sequence fetches `cap` of its first blocks into its first slots, every head.
    plan_slots = torch.arange(cap, dtype=torch.int32).expand(ns, hk, cap).contiguous()
    plan_blocks = (torch.arange(cap, dtype=torch.int32) + 1).expand(ns, hk, cap).contiguous()
    bad = malformed_indptr(host_indptr, case)
    with pytest.raises(ValueError):
        ops.gather_blocks(
            geo,
            plan_slots,
            plan_blocks,
            slot_pages,
            bad,
            host_indices,
            host_k,
            host_v,
            kp.clone(),
            vp.clone(),
        )
    want_k, want_v = kp.clone(), vp.clone()
    for s, r in enumerate(csr_rows(bad, nnz)):
        if r is None:  # malformed: nothing is gathered for this sequence
            continue
        n = r[1] - r[0]
        sl = slice(s, s + 1)
        slots = plan_slots[sl].masked_fill(plan_blocks[sl] >= n, -1)  # past a short row: skipped
        rows = (i32([0, n]), host_indices[r[0] : r[1]])
        ops.gather_blocks(geo, slots, plan_blocks[sl], slot_pages[sl], *rows, host_k, host_v, want_k, want_v)
    g_kp, g_vp = dev(kp), dev(vp)
    tables = [dev(t) for t in (plan_slots, plan_blocks, slot_pages, bad, host_indices)]
    ops.gather_blocks(geo, *tables, host(host_k, where), host(host_v, where), g_kp, g_vp)
    assert_bits_equal(g_kp, want_k, "k_pages")
    assert_bits_equal(g_vp, want_v, "v_pages")


# ---------------------------------------------------------------- NaN
@gpu_test
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_propagates_through_decode_attention_like_the_cpu_twin(dtype, splits):
    """NaN in q, K or V: NaN in exactly the outputs the CPU twin makes NaN (fmaxf skips NaN; the
    kernels used to turn it into zeros), split-KV merge included."""
    gen = seeded("nan", dtype, splits)
    geo, kp, vp, indptr, indices, last, _, q2, ek, ev = _attn_case(gen, dtype, 2, 64, 7)
    q2[0, 0, 1, 3] = float("nan")  # seq 0, row 0, query head 1
    kp[int(indices[int(indptr[1])]), 1, 0, 5] = float("nan")  # seq 1's first (full) page, KV head 1
    vp[int(indices[int(indptr[2])]), 0, 0, 7] = float("nan")  # seq 2's page, KV head 0, dim 7
    want = ops.decode_attention(geo, q2, kp, vp, indptr, indices, last, extra_k=ek, extra_v=ev)
    assert want.isnan().any() and not want.isnan().all()
    g = [dev(t) for t in (q2, kp, vp, indptr, indices, last)]
    got = back(ops.decode_attention(geo, *g, extra_k=dev(ek), extra_v=dev(ev), num_splits=splits))
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    torch.testing.assert_close(got[ok], want[ok], atol=ATTN_TOL[dtype][0], rtol=ATTN_TOL[dtype][1])


# ---------------------------------------------------------------- append and summaries
@gpu_test
@pytest.mark.parametrize("where", HOSTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_append_kv_bit_exact_with_write_through_and_summaries(dtype, head_dim, where):
    gen = seeded("append", dtype, head_dim, where)
    hk, d, num_pages, n_host = 2, head_dim, 11, 7
    geo = ops.KvGeometry(2 * hk, hk, d, B)
    # Garbage everywhere: entries the kernel must not touch are compared too.
    kp, vp = rand(gen, dtype, num_pages, hk, B, d), rand(gen, dtype, num_pages, hk, B, d)
    hkp, hvp = rand(gen, dtype, n_host, hk, B, d), rand(gen, dtype, n_host, hk, B, d)
    summ = rand(gen, dtype, n_host, hk, 2, d)
    g_kp, g_vp, g_summ = dev(kp), dev(vp), dev(summ)
    g_hk, g_hv = host(hkp, where), host(hvp, where)
    # seq 0 sparse (page 3 mirrors host block 2), seq 1 dense (page 5), seq 2 sparse (page 9 <-> block 6),
    # seq 2 five tokens ahead so that its block restarts (summary reset) half way.
    page_ids, host_ids = i32([3, 5, 9]), i32([2, -1, 6])
    g_pages, g_host_ids = dev(page_ids), dev(host_ids)
    for step in range(B):
        offs = i32([step, step, (step + 5) % B])
        k_new, v_new = rand(gen, dtype, 3, hk, d), rand(gen, dtype, 3, hk, d)
        ops.append_kv(geo, k_new, v_new, page_ids, offs, host_ids, kp, vp, hkp, hvp, summ)
        ops.append_kv(
            geo, dev(k_new), dev(v_new), g_pages, dev(offs), g_host_ids, g_kp, g_vp, g_hk, g_hv, g_summ
        )
        if step in (0, 1, 10, 11, B - 1):
            for name, got, want in [
                ("k_pages", g_kp, kp),
                ("v_pages", g_vp, vp),
                ("host_k", g_hk, hkp),
                ("host_v", g_hv, hvp),
                ("summaries", g_summ, summ),
            ]:
                assert_bits_equal(got, want, f"{name} after step {step}")


@gpu_test
@pytest.mark.parametrize("where", HOSTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_build_summaries_bit_exact(dtype, head_dim, where):
    gen = seeded("summaries", dtype, head_dim, where)
    hk, n_host = 3, 9
    geo = ops.KvGeometry(hk, hk, head_dim, B)
    keys = rand(gen, dtype, n_host, hk, B, head_dim)
    summ = rand(gen, dtype, n_host, hk, 2, head_dim)  # blocks not listed keep this garbage
    g_summ = dev(summ)
    ids, lens = i32([8, 0, 3, 5, 1]), i32([16, 1, 7, 16, 9])
    ops.build_summaries(geo, keys, ids, lens, summ)
    ops.build_summaries(geo, host(keys, where), dev(ids), dev(lens), g_summ)
    assert_bits_equal(g_summ, summ, "summaries")


@gpu_test
@pytest.mark.parametrize("where", HOSTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_host_rows_apart_from_block_ids_bit_exact(dtype, where):
    """append_kv / build_summaries / build_key_codes with host rows (host_k) apart from block ids
    (summaries, codes): the kernels equal the CPU twins bit for bit; garbage rows and ids not listed
    are untouched; out-of-range rows are skipped on the GPU."""
    gen = seeded("rows", dtype, where)
    hk, d, n_rows, n_ids = 2, 64, 5, 13
    geo = ops.KvGeometry(2 * hk, hk, d, B)
    kp, vp = rand(gen, dtype, 4, hk, B, d), rand(gen, dtype, 4, hk, B, d)
    hkp, hvp = rand(gen, dtype, n_rows, hk, B, d), rand(gen, dtype, n_rows, hk, B, d)
    summ = rand(gen, dtype, n_ids, hk, 2, d)
    g_kp, g_vp, g_summ, g_hk, g_hv = dev(kp), dev(vp), dev(summ), host(hkp, where), host(hvp, where)
    page_ids, ids, rows = i32([0, 2, 3]), i32([12, -1, 3]), i32([4, 0, 1])
    for step in range(B):
        offs = i32([step, step, (step + 5) % B])
        k_new, v_new = rand(gen, dtype, 3, hk, d), rand(gen, dtype, 3, hk, d)
        ops.append_kv(geo, k_new, v_new, page_ids, offs, ids, kp, vp, hkp, hvp, summ, host_rows=rows)
        ops.append_kv(
            geo,
            dev(k_new),
            dev(v_new),
            dev(page_ids),
            dev(offs),
            dev(ids),
            g_kp,
            g_vp,
            g_hk,
            g_hv,
            g_summ,
            host_rows=dev(rows),
        )
    for name, got, want in [
        ("k_pages", g_kp, kp),
        ("host_k", g_hk, hkp),
        ("host_v", g_hv, hvp),
        ("summaries", g_summ, summ),
    ]:
        assert_bits_equal(got, want, name)
    b_ids, b_rows, lens = i32([12, 3, 7]), i32([4, 1, 2]), i32([16, 9, 1])
    ops.build_summaries(geo, hkp, b_ids, lens, summ, block_rows=b_rows)
    ops.build_summaries(geo, g_hk, dev(b_ids), dev(lens), g_summ, block_rows=dev(b_rows))
    assert_bits_equal(g_summ, summ, "summaries (rows)")
    codes = torch.randint(0, 256, (n_ids, hk, B, d // 4), generator=gen, dtype=torch.uint8)
    g_codes = dev(codes)
    # The codes live inside each block's 8-bit bound (every id's, ids 5 and 6 included).
    b8, sc = ops.empty_bounds8(geo, n_ids)
    ops.build_bounds8(geo, summ, i32(list(range(n_ids))), b8, sc)
    ops.build_key_codes(geo, hkp, b8, sc, b_ids, codes, block_rows=b_rows)
    g_ids, g_rows = dev(torch.cat([b_ids, i32([5, 6])])), dev(torch.cat([b_rows, i32([n_rows, -1])]))
    ops.build_key_codes(geo, g_hk, dev(b8), dev(sc), g_ids, g_codes, block_rows=g_rows)
    assert torch.equal(back(g_codes), codes)


# ---------------------------------------------------------------- scores and top-k
SCORE_LENS = [54, 1, 37, 0, 9]  # blocks per sequence, one empty
TOPK_LENS = [1100, 54, 1, 37, 0, 16]  # 1100 > the kernel's 512 threads: several compaction chunks


def _check_topk(scores: torch.Tensor, blk_indptr: torch.Tensor, k: int, top: torch.Tensor) -> None:
    """Top-K by threshold: the right count, -1 padding, distinct in-range entries, best first, and
    every chosen score >= the k-th best score."""
    top = back(top)
    ns, hk = blk_indptr.numel() - 1, scores.shape[1]
    assert top.shape == (ns, hk, k)
    for s in range(ns):
        seg = scores[int(blk_indptr[s]) : int(blk_indptr[s + 1])]
        n = seg.shape[0]
        for h in range(hk):
            chosen = top[s, h]
            valid = chosen[: min(k, n)]
            assert (chosen[min(k, n) :] == -1).all(), f"seq {s} head {h}: padding"
            assert ((valid >= 0) & (valid < n)).all(), f"seq {s} head {h}: {valid.tolist()} out of 0..{n}"
            assert len(set(valid.tolist())) == valid.numel(), f"seq {s} head {h}: duplicates"
            got = seg[valid.long(), h]
            assert (got[:-1] >= got[1:]).all(), f"seq {s} head {h}: not best first"
            if n > k:
                kth = torch.topk(seg[:, h], k).values[-1]
                assert (got >= kth).all(), f"seq {s} head {h}: below the k-th best score"


@gpu_test
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_blocks_matches_cpu_twin_and_reference(dtype, head_dim, group):
    gen = seeded("score", dtype, head_dim, group)
    hk, d = 3, head_dim
    n_host = sum(SCORE_LENS) + 4
    geo = ops.KvGeometry(hk * group, hk, d, B)
    keys = rand(gen, dtype, n_host, hk, B, d)
    summaries = torch.empty(n_host, hk, 2, d, dtype=dtype)
    ops.build_summaries(geo, keys, i32(list(range(n_host))), i32([B] * n_host), summaries)
    blk_indptr = csr(SCORE_LENS)
    blk_indices = torch.randperm(n_host, generator=gen)[: sum(SCORE_LENS)].to(torch.int32)
    q = rand(gen, dtype, len(SCORE_LENS), hk * group, d)
    want = ops.score_blocks(geo, q, summaries, blk_indptr, blk_indices)
    g_indptr = dev(blk_indptr)
    scores = torch.full((blk_indices.numel(), hk), POISON, device=DEV)
    got = ops.score_blocks(geo, dev(q), dev(summaries), g_indptr, dev(blk_indices), scores=scores)
    assert got is scores
    # NOTE: both sum d * group f32 products, in different orders.
    torch.testing.assert_close(back(got), want, atol=1e-4 * d * group, rtol=1e-4)
    ref = ref_score_blocks(q, summaries, blk_indptr, blk_indices)
    torch.testing.assert_close(back(got).double(), ref, atol=1e-3 * d * group, rtol=1e-4)
    # Top-K on the GPU's own scores, end to end.
    k = 16
    top = ops.topk_blocks(hk, got, g_indptr, k)
    _check_topk(back(got), blk_indptr, k, top)


@gpu_test
@pytest.mark.parametrize("k", [1, 16, 64, 512])
def test_topk_exact_on_tie_free_scores(k):
    gen = seeded("topk", k)
    hk = 3
    blk_indptr = csr(TOPK_LENS)
    scores = torch.randn(int(blk_indptr[-1]), hk, generator=gen)
    for s in range(len(TOPK_LENS)):  # tie-free by construction (checked)
        seg = scores[int(blk_indptr[s]) : int(blk_indptr[s + 1])]
        for h in range(hk):
            assert seg[:, h].unique().numel() == seg.shape[0]
    want = ops.topk_blocks(hk, scores, blk_indptr, k)
    out = torch.full((len(TOPK_LENS), hk, k), INT_POISON, dtype=torch.int32, device=DEV)
    got = ops.topk_blocks(hk, dev(scores), dev(blk_indptr), k, out=out)
    assert got is out
    assert torch.equal(back(got), want)
    _check_topk(scores, blk_indptr, k, got)


@gpu_test
@pytest.mark.parametrize("k", [1, 16, 64, 512])
def test_topk_threshold_property_with_ties(k):
    gen = seeded("topk-ties", k)
    hk = 2
    blk_indptr = csr(TOPK_LENS)
    scores = tied_scores(gen, int(blk_indptr[-1]), hk)
    out = torch.full((len(TOPK_LENS), hk, k), INT_POISON, dtype=torch.int32, device=DEV)
    _check_topk(scores, blk_indptr, k, ops.topk_blocks(hk, dev(scores), dev(blk_indptr), k, out=out))


@gpu_test
@pytest.mark.parametrize("k", [1, 16, 64])
def test_topk_ties_go_to_the_lower_index_like_the_twin(k):
    """The contract breaks ties by the lower logical index, so even with ties the twin is exact."""
    gen = seeded("topk-ties-exact", k)
    hk = 2
    blk_indptr = csr(TOPK_LENS)
    scores = tied_scores(gen, int(blk_indptr[-1]), hk)
    want = ops.topk_blocks(hk, scores, blk_indptr, k)
    assert torch.equal(back(ops.topk_blocks(hk, dev(scores), dev(blk_indptr), k)), want)


@gpu_test
@pytest.mark.parametrize("k", [1, 16, 128])
def test_topk_index_map_matches_the_twin(k):
    """topk_blocks with index_map (the two-stage codes score's map back to logical blocks, in the
    top-K launch): the twin's output exactly, a position past the map's width gives -1."""
    gen = seeded("topk-map", k)
    hk = 3
    blk_indptr = csr(TOPK_LENS)
    scores = tied_scores(gen, int(blk_indptr[-1]), hk)
    for width in (max(TOPK_LENS), 40):
        index_map = torch.randint(-1, 10_000, (len(TOPK_LENS), hk, width), generator=gen, dtype=torch.int32)
        want = ops.topk_blocks(hk, scores, blk_indptr, k, index_map=index_map)
        out = torch.full((len(TOPK_LENS), hk, k), INT_POISON, dtype=torch.int32, device=DEV)
        got = ops.topk_blocks(hk, dev(scores), dev(blk_indptr), k, out=out, index_map=dev(index_map))
        assert got is out
        assert torch.equal(back(got), want)


@gpu_test
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fetch_cap", [1, 3, 64])
@pytest.mark.parametrize("budget", [1, 7, 33, 130])
def test_delta_select_equals_cpu_twin(budget, fetch_cap, seed):
    gen = seeded("select", budget, fetch_cap, seed)
    ns, hk, step = 3, 4, 9
    num_pred = [budget, (2 * budget) // 3, 0][seed]
    slot_pages, page_map, last_sel, predicted = select_state(gen, ns, hk, budget, num_pred)
    g_map, g_last = dev(page_map), dev(last_sel)
    plan_poison = torch.full((ns, hk, fetch_cap), INT_POISON, dtype=torch.int32)
    ps, pb, totals = ops.delta_select(
        hk,
        predicted,
        slot_pages,
        page_map,
        last_sel,
        step,
        fetch_cap,
        plan_slots=plan_poison.clone(),
        plan_blocks=plan_poison.clone(),
    )
    stats = torch.full((ns, hk, 3), -1, dtype=torch.int32, device=DEV)
    g_ps, g_pb, g_stats = ops.delta_select(
        hk,
        dev(predicted),
        dev(slot_pages),
        g_map,
        g_last,
        step,
        fetch_cap,
        plan_slots=dev(plan_poison),
        plan_blocks=dev(plan_poison),
        stats=stats,
    )
    assert g_stats is stats
    for name, got, want in [
        ("page_map", g_map, page_map),
        ("page_last_selected", g_last, last_sel),
        ("plan_slots", g_ps, ps),
        ("plan_blocks", g_pb, pb),
    ]:
        got = back(got)
        assert torch.equal(got, want), f"{name}: differs at {(got != want).nonzero()[:5].tolist()}"
    st = back(stats)
    assert tuple(st.sum(dim=(0, 1)).tolist()) == totals
    assert torch.equal(st[..., 0], (ps >= 0).sum(dim=2).to(torch.int32)), "pairs per (seq, head)"
    if fetch_cap < budget and num_pred == budget:
        assert totals[2] > totals[0], "the cap binds somewhere in this case (blocks left missing)"


@gpu_test
def test_delta_select_without_stats_returns_none():
    gen = seeded("select-none")
    slot_pages, page_map, last_sel, predicted = select_state(gen, 2, 2, 5, 4)
    ps, pb, st = ops.delta_select(2, dev(predicted), dev(slot_pages), dev(page_map), dev(last_sel), 1, 2)
    assert st is None and ps.device == DEV and pb.device == DEV
    assert (
        _core.delta_select(
            2, dev(predicted), dev(slot_pages), dev(page_map), dev(last_sel), 1, 2, dev(ps), dev(pb)
        )
        is None
    )


# ---------------------------------------------------------------- gather and copy
@gpu_test
@pytest.mark.parametrize("where", HOSTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_blocks_bit_exact(dtype, head_dim, where):
    gen = seeded("gather", dtype, head_dim, where)
    ns, hk, budget, cap = 2, 2, 7, 5
    n_logical = [20, 13]
    n_host = sum(n_logical) + 8
    geo = ops.KvGeometry(2 * hk, hk, head_dim, B)
    host_k, host_v = rand(gen, dtype, n_host, hk, B, head_dim), rand(gen, dtype, n_host, hk, B, head_dim)
    num_pages = ns * budget + 3
    kp = torch.full((num_pages, hk, B, head_dim), POISON, dtype=dtype)
    vp = rand(gen, dtype, num_pages, hk, B, head_dim)
    slot_pages = torch.randperm(num_pages, generator=gen)[: ns * budget].view(ns, budget).to(torch.int32)
    host_indptr = csr(n_logical)
    host_indices = torch.randperm(n_host, generator=gen)[: sum(n_logical)].to(torch.int32)
    predicted = torch.stack(
        [torch.stack([torch.randperm(n, generator=gen)[:budget] for _ in range(hk)]) for n in n_logical]
    ).to(torch.int32)
    predicted[0, 1, 3] = -1
    page_map = torch.full((num_pages, hk), -1, dtype=torch.int32)
    last_sel = torch.full((num_pages, hk), -1, dtype=torch.int32)
    ps, pb, (pairs, _, _) = ops.delta_select(hk, predicted, slot_pages, page_map, last_sel, 0, cap)
    assert 0 < pairs < ns * hk * cap + 1
    g_kp, g_vp = dev(kp), dev(vp)
    copied = ops.gather_blocks(geo, ps, pb, slot_pages, host_indptr, host_indices, host_k, host_v, kp, vp)
    assert copied == pairs
    assert (
        ops.gather_blocks(
            geo,
            dev(ps),
            dev(pb),
            dev(slot_pages),
            dev(host_indptr),
            dev(host_indices),
            host(host_k, where),
            host(host_v, where),
            g_kp,
            g_vp,
        )
        is None
    )
    assert_bits_equal(g_kp, kp, "k_pages")
    assert_bits_equal(g_vp, vp, "v_pages")


@gpu_test
@pytest.mark.parametrize("direction", ["device_to_pinned", "pinned_to_device", "device_to_device"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_pages_bit_exact(dtype, head_dim, direction):
    gen = seeded("copy", dtype, head_dim, direction)
    hk = 2
    geo = ops.KvGeometry(hk, hk, head_dim, B)
    src_k, src_v = rand(gen, dtype, 9, hk, B, head_dim), rand(gen, dtype, 9, hk, B, head_dim)
    dst_k, dst_v = rand(gen, dtype, 13, hk, B, head_dim), rand(gen, dtype, 13, hk, B, head_dim)
    dst_k[0] = POISON
    src_ids, dst_ids = i32([4, 0, 8, 2, 7]), i32([12, 1, 5, 0, 9])
    src_where, dst_where = {
        "device_to_pinned": ("cuda", "pinned"),
        "pinned_to_device": ("pinned", "cuda"),
        "device_to_device": ("cuda", "cuda"),
    }[direction]
    g_src_k, g_src_v = host(src_k, src_where), host(src_v, src_where)
    g_dst_k, g_dst_v = host(dst_k, dst_where), host(dst_v, dst_where)
    ops.copy_pages(geo, src_k, src_v, src_ids, dst_k, dst_v, dst_ids)
    ops.copy_pages(geo, g_src_k, g_src_v, dev(src_ids), g_dst_k, g_dst_v, dev(dst_ids))
    assert_bits_equal(g_dst_k, dst_k, "dst_k")
    assert_bits_equal(g_dst_v, dst_v, "dst_v")


# ---------------------------------------------------------------- the selection loop, end to end
@gpu_test
@pytest.mark.parametrize("on_side_stream", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_select_gather_loop_keeps_slots_equal_to_page_map(dtype, on_side_stream):
    """score -> top-K -> delta selection -> gather, step after step on the GPU: the selection equals
    the CPU twin's on the same predictions, and every filled slot holds exactly the host block its
    page_map entry names."""
    gen = seeded("loop", dtype, on_side_stream)
    ns, hk, group, d, budget, cap, steps = 2, 2, 4, 64, 16, 4, 12
    n_logical = [129, 41]
    n_host = sum(n_logical) + 5
    geo = ops.KvGeometry(hk * group, hk, d, B)
    host_k = rand(gen, dtype, n_host, hk, B, d).pin_memory()
    host_v = rand(gen, dtype, n_host, hk, B, d).pin_memory()
    host_indptr = csr(n_logical)
    host_indices = torch.randperm(n_host, generator=gen)[: sum(n_logical)].to(torch.int32)
    num_pages = ns * budget + 2
    slot_pages = torch.randperm(num_pages, generator=gen)[: ns * budget].view(ns, budget).to(torch.int32)
    g_indptr, g_indices, g_slots = dev(host_indptr), dev(host_indices), dev(slot_pages)
    summaries = torch.full((n_host, hk, 2, d), POISON, dtype=dtype, device=DEV)
    k_pages = torch.full((num_pages, hk, B, d), POISON, dtype=dtype, device=DEV)
    v_pages = torch.full((num_pages, hk, B, d), POISON, dtype=dtype, device=DEV)
    page_map = torch.full((num_pages, hk), -1, dtype=torch.int32, device=DEV)
    last_sel = torch.full((num_pages, hk), -1, dtype=torch.int32, device=DEV)
    cpu_map = torch.full((num_pages, hk), -1, dtype=torch.int32)
    cpu_last = torch.full((num_pages, hk), -1, dtype=torch.int32)
    stream = torch.cuda.Stream(DEV) if on_side_stream else torch.cuda.current_stream(DEV)
    stream.wait_stream(torch.cuda.current_stream(DEV))
    queries = [rand(gen, dtype, ns, hk * group, d) for _ in range(steps)]
    with torch.cuda.stream(stream):
        ops.build_summaries(geo, host_k, dev(i32(list(range(n_host)))), dev(i32([B] * n_host)), summaries)
    for step in range(steps):
        with torch.cuda.stream(stream):
            scores = ops.score_blocks(geo, dev(queries[step]), summaries, g_indptr, g_indices)
            pred = ops.topk_blocks(hk, scores, g_indptr, budget)
            ps, pb, _ = ops.delta_select(hk, pred, g_slots, page_map, last_sel, step, cap)
            ops.gather_blocks(geo, ps, pb, g_slots, g_indptr, g_indices, host_k, host_v, k_pages, v_pages)
        stream.synchronize()
        c_ps, c_pb, _ = ops.delta_select(hk, pred.cpu(), slot_pages, cpu_map, cpu_last, step, cap)
        assert torch.equal(page_map.cpu(), cpu_map), f"page_map at step {step}"
        assert torch.equal(last_sel.cpu(), cpu_last), f"page_last_selected at step {step}"
        assert torch.equal(ps.cpu(), c_ps) and torch.equal(pb.cpu(), c_pb), f"plan at step {step}"
        kp, vp, pm = k_pages.cpu(), v_pages.cpu(), page_map.cpu()
        for s in range(ns):
            filled = 0
            for page in slot_pages[s].tolist():
                for h in range(hk):
                    blk = int(pm[page, h])
                    if blk < 0:
                        continue
                    filled += 1
                    hb = int(host_indices[int(host_indptr[s]) + blk])
                    assert torch.equal(bits(kp[page, h]), bits(host_k[hb, h])), (
                        f"step {step} seq {s} page {page}"
                    )
                    assert torch.equal(bits(vp[page, h]), bits(host_v[hb, h])), (
                        f"step {step} seq {s} page {page}"
                    )
            # Empty slots are victims first: the working set fills `cap` entries per head per step.
            assert filled == hk * min(budget, cap * (step + 1)), f"step {step} seq {s}: {filled} filled"


@gpu_test
def test_a_second_device_while_the_current_one_is_the_first():
    """Tensors on cuda:1 with torch's current device 0: the call attaches to device 1's context."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    d1 = torch.device("cuda", 1)
    gen = seeded("device-1")
    geo, kp, vp, indptr, indices, last, pmap, q2, ek, ev = _attn_case(gen, torch.bfloat16, 2, 64, 7)
    want = ops.decode_attention(geo, q2, kp, vp, indptr, indices, last, page_map=pmap, extra_k=ek, extra_v=ev)
    assert torch.cuda.current_device() == 0
    args = [t.to(d1) for t in (q2, kp, vp, indptr, indices, last)]
    out = ops.decode_attention(
        geo, *args, page_map=pmap.to(d1), extra_k=ek.to(d1), extra_v=ev.to(d1), num_splits=3
    )
    torch.cuda.synchronize(d1)
    torch.testing.assert_close(
        out.cpu(), want, atol=ATTN_TOL[torch.bfloat16][0], rtol=ATTN_TOL[torch.bfloat16][1]
    )


# ---------------------------------------------------------------- errors on the GPU path
@gpu_test
def test_gpu_path_errors_are_typed():
    assert _core.cuda_status() is None
    major, minor = torch.cuda.get_device_capability(DEV)
    assert {name for name, _ in _core.compile_kernels(f"sm_{major}{minor}")} >= {
        "decode_attn",
        "gather_blocks",
    }
    gen = seeded("errors")
    geo, kp, vp, indptr, indices, last, pmap, q2, ek, ev = _attn_case(gen, torch.float16, 2, 64, 7)
    g = [dev(t) for t in (q2, kp, vp, indptr, indices, last)]
    with pytest.raises(errors.DeviceError, match="out"):
        ops.decode_attention(geo, *g, out=torch.empty_like(q2))  # out on the CPU
    with pytest.raises(errors.DeviceError, match="kv_indptr"):
        ops.decode_attention(geo, g[0], g[1], g[2], indptr, g[4], g[5])
    with pytest.raises(errors.ShapeError, match="contiguous"):
        ops.decode_attention(geo, g[0].transpose(2, 3), *g[1:])
    with pytest.raises(errors.InvalidArgumentError, match="share memory"):
        ops.decode_attention(geo, *g, out=g[0])
    # A pageable host pool: the kernels could not reach it.
    hk_pool = torch.zeros(4, geo.num_kv_heads, B, geo.head_dim, dtype=torch.float16)
    plan = torch.full((1, geo.num_kv_heads, 2), -1, dtype=torch.int32, device=DEV)
    with pytest.raises(errors.DeviceError, match="pin_memory"):
        ops.gather_blocks(
            geo,
            plan,
            plan.clone(),
            dev(i32([[0, 1]])),
            dev(i32([0, 4])),
            dev(i32([0, 1, 2, 3])),
            hk_pool,
            hk_pool.clone(),
            g[1],
            g[2],
        )
    with pytest.raises(errors.InvalidArgumentError, match="512"):
        ops.topk_blocks(2, torch.zeros(3, 2, device=DEV), dev(i32([0, 3])), 513)
    # The device is still healthy.
    want = ops.decode_attention(geo, q2, kp, vp, indptr, indices, last)
    torch.testing.assert_close(back(ops.decode_attention(geo, *g)), want, atol=2e-3, rtol=1e-2)


def topk_candidates_twin_and_gpu(heads, scores, cand, indptr, k, successors, forced):
    """``ops.topk_candidates`` by the CPU twin and on the GPU, as lists: ``(want, got)``."""
    want = ops.topk_candidates(heads, scores, cand, indptr, k, successors=successors, forced=forced)
    got = ops.topk_candidates(
        heads, dev(scores), dev(cand), dev(indptr), k, successors=successors, forced=dev(forced)
    )
    return want.tolist(), back(got).tolist()


@pytest.mark.parametrize("seed", range(12))
def test_topk_candidates_and_force_scores_match_the_twins(seed):
    """The two-stage score's fused ops (force_scores, topk_candidates) on the GPU against the CPU
    twins, bit for bit; rows past the thread count (m + successors > 512) take the bitonic sort."""
    heads, indptr, cand, scores, forced = topk_candidates_case(seed)
    m = cand.shape[-1]
    for n_succ in (0, 2, m + 1):
        for k in (1, m + n_succ + 2):
            want, got = topk_candidates_twin_and_gpu(heads, scores, cand, indptr, k, n_succ, forced)
            assert got == want, (seed, n_succ, k)
    nnz = int(indptr[-1])
    base = torch.randn(nnz, heads, generator=torch.Generator().manual_seed(seed))
    f = forced if forced is not None else torch.full((indptr.numel() - 1, heads, 1), 0, dtype=torch.int32)
    want = ops.force_scores(heads, base.clone(), indptr, f)
    got = ops.force_scores(heads, dev(base), dev(indptr), dev(f))
    assert torch.equal(back(got), want)


def test_topk_candidates_long_rows_match_the_twin():
    """512 candidates and 300 successors (812 entries: the bitonic path), k = 400."""
    g = torch.Generator().manual_seed(7)
    n, heads, m, blocks = 3, 2, 512, 2000
    indptr = torch.tensor([0, blocks, 2 * blocks, 3 * blocks], dtype=torch.int32)
    cand = torch.stack([torch.randperm(blocks, generator=g)[:m] for _ in range(n * heads)]).view(n, heads, m)
    cand = cand.to(torch.int32)
    scores = torch.randn(n * m, heads, generator=g)
    forced = torch.randint(-1, blocks, (n, heads, 5), generator=g).to(torch.int32)
    want, got = topk_candidates_twin_and_gpu(heads, scores, cand, indptr, 400, 300, forced)
    assert got == want


@pytest.mark.parametrize("seed", range(6))
def test_topk_candidates_nan_and_inf_scores_match_the_twin(seed):
    """NaN scores rank last (after the successor slots that are no blocks), +inf ones tie with
    the forced blocks and go by position: the merge of the kernel's one sort against the twin."""
    heads, indptr, cand, scores, forced = topk_candidates_case(seed + 100)
    g = torch.Generator().manual_seed(seed)
    pick = torch.rand(scores.shape, generator=g)
    scores = scores.masked_fill(pick < 0.15, float("nan")).masked_fill(pick > 0.9, float("inf"))
    m = cand.shape[-1]
    for n_succ in (0, 3, m + 1):
        want, got = topk_candidates_twin_and_gpu(heads, scores, cand, indptr, m + n_succ, n_succ, forced)
        assert got == want, (seed, n_succ)


def test_topk_candidates_more_candidates_than_threads_match_the_twin():
    """700 candidates (the sort of the candidates alone takes the bitonic path) and 100
    successors, k = 500 (the kernel's largest)."""
    g = torch.Generator().manual_seed(11)
    n, heads, m, blocks = 2, 3, 700, 3000
    indptr = torch.tensor([0, blocks, 2 * blocks], dtype=torch.int32)
    cand = torch.stack([torch.randperm(blocks, generator=g)[:m] for _ in range(n * heads)]).view(n, heads, m)
    cand = cand.to(torch.int32)
    scores = torch.randint(-20, 20, (n * m, heads), generator=g).float()  # ties
    forced = torch.randint(-1, blocks, (n, heads, 4), generator=g).to(torch.int32)
    want, got = topk_candidates_twin_and_gpu(heads, scores, cand, indptr, 500, 100, forced)
    assert got == want


@pytest.mark.parametrize("row", [40, 2048, 9000])
def test_topk_blocks_with_forced_matches_the_twin(row):
    """``topk_blocks(forced=)`` on the GPU against the CPU twin (force_scores, then top-k), bit
    for bit, scores included: whole-sorted rows, radix-selected ones, and rows past the kernel's
    key cache (8192 entries), whose forced entries are read back from the scores."""
    g = torch.Generator().manual_seed(row)
    n, heads = 3, 2
    indptr = torch.tensor([0, row, row, 2 * row - 7], dtype=torch.int32)  # an empty row too
    nnz = int(indptr[-1])
    scores = torch.randint(-50, 50, (nnz, heads), generator=g).float()  # ties
    forced = torch.randint(-2, row + 3, (n, heads, 9), generator=g).to(torch.int32)
    for k in (1, 37, 160):
        want_scores = scores.clone()
        want = ops.topk_blocks(heads, want_scores, indptr, k, forced=forced)
        got_scores = dev(scores)
        got = ops.topk_blocks(heads, got_scores, dev(indptr), k, forced=dev(forced))
        assert back(got).tolist() == want.tolist(), (row, k)
        assert torch.equal(back(got_scores), want_scores)
