"""The fused ops of the two-stage score (``ops.force_scores``, ``ops.topk_candidates``) against
their definition composed of the older ops (``keep_pins``, ``successors``, ``topk_blocks``):
random rows with ties, missing candidates, successors past the row and forced blocks."""

import pytest
import torch

from oasiskv import errors, ops
from oasiskv.engine import keep_pins, successors
from support.kernels import topk_candidates_case
from support.key_codes import (
    RESCORE_TOPK_BLOCK_SIZES,
    RESCORE_TOPK_GROUPS,
    RESCORE_TOPK_HEAD_DIMS,
    RESCORE_TOPK_MS,
    rescore_topk_case,
)
from support.reference import seeded


def reference_last_top_k(scores, cand, indptr, k, n_succ, forced):
    """The two-stage score's last top-k as device ops (the engine's composition before the
    fused op): successors of the codes' best appended as candidates, forced blocks at +inf."""
    n, heads, m = cand.shape
    rows = torch.arange(0, (n + 1) * m, m, dtype=torch.int32)
    if n_succ:
        best = ops.topk_blocks(heads, scores, rows, n_succ, index_map=cand)
        nxt = successors(best, indptr)
        forced = nxt if forced is None else torch.cat([forced, nxt], dim=-1)
        dup = (cand.unsqueeze(-1) == nxt.unsqueeze(2)) & (cand >= 0).unsqueeze(-1)
        nxt = nxt.masked_fill(dup.any(2), -1)
        extra = torch.where(nxt >= 0, torch.inf, -torch.inf).permute(0, 2, 1)
        scores = torch.cat([scores.view(n, m, -1), extra], dim=1).reshape(n * (m + n_succ), -1)
        cand = torch.cat([cand, nxt], dim=-1)
        m += n_succ
        rows = torch.arange(0, (n + 1) * m, m, dtype=torch.int32)
    if forced is not None:
        valid = (cand >= 0).unsqueeze(-1)
        hit = ((cand.unsqueeze(-1) == forced.unsqueeze(2)) & valid).any(-1)
        scores = scores.masked_fill(hit.permute(0, 2, 1).reshape(n * m, -1), torch.inf)
    return ops.topk_blocks(heads, scores.contiguous(), rows, k, index_map=cand.contiguous())


@pytest.mark.parametrize("seed", range(40))
def test_topk_candidates_is_its_composition(seed):
    heads, indptr, cand, scores, forced = topk_candidates_case(seed)
    m = cand.shape[-1]
    for n_succ in (0, 1, 3, m + 2):
        for k in (1, m, m + n_succ + 3):
            got = ops.topk_candidates(heads, scores, cand, indptr, k, successors=n_succ, forced=forced)
            want = reference_last_top_k(scores, cand, indptr, k, n_succ, forced)
            assert got.tolist() == want.tolist(), (seed, n_succ, k)


def test_topk_candidates_takes_successors_that_are_no_candidates():
    """One row, blocks 0..9; candidates 2, 7, 4 with scores 1, 3, 2; one successor: 8 (of 7)
    goes first, appended; then 7, 4. The forced block 4 goes ahead of 7; a successor past the
    row is none."""
    indptr = torch.tensor([0, 10], dtype=torch.int32)
    cand = torch.tensor([[[2, 7, 4]]], dtype=torch.int32)
    scores = torch.tensor([[1.0], [3.0], [2.0]])
    got = ops.topk_candidates(1, scores, cand, indptr, 3, successors=1)
    assert got.tolist() == [[[8, 7, 4]]]
    forced = torch.tensor([[[4]]], dtype=torch.int32)
    got = ops.topk_candidates(1, scores, cand, indptr, 3, successors=1, forced=forced)
    assert got.tolist() == [[[4, 8, 7]]]
    past = torch.tensor([[[2, 9, 4]]], dtype=torch.int32)  # 9 is the row's last block
    got = ops.topk_candidates(1, scores, past, indptr, 4, successors=1)
    assert got.tolist() == [[[9, 4, 2, -1]]]


@pytest.mark.parametrize("seed", range(20))
def test_force_scores_is_keep_pins(seed):
    heads, indptr, _, _, forced = topk_candidates_case(seed)
    nnz = int(indptr[-1])
    g = torch.Generator().manual_seed(1000 + seed)
    scores = torch.randn(nnz, heads, generator=g)
    if forced is None:
        forced = torch.full((indptr.numel() - 1, heads, 2), -1, dtype=torch.int32)
    want = keep_pins(scores, indptr, forced)
    got = ops.force_scores(heads, scores.clone(), indptr, forced)
    assert torch.equal(got, want)


def test_fused_ops_reject_bad_shapes():
    from oasiskv import errors

    indptr = torch.tensor([0, 4], dtype=torch.int32)
    cand = torch.zeros(1, 2, 3, dtype=torch.int32)
    with pytest.raises(errors.ShapeError):
        ops.topk_candidates(2, torch.zeros(4, 2), cand, indptr, 2)  # scores must be [1 * 3, 2]
    with pytest.raises(errors.ShapeError):
        ops.force_scores(2, torch.zeros(4, 2), indptr, torch.zeros(1, 1, 2, dtype=torch.int32))


@pytest.mark.parametrize("seed", range(12))
def test_topk_blocks_with_forced_is_force_scores_then_topk(seed):
    """``topk_blocks(forced=)`` (the two-stage score's first stage in one launch): the scores come
    back forced, as :func:`ops.force_scores` leaves them, and the top-k is theirs."""
    heads, indptr, cand, _, forced = topk_candidates_case(seed)
    if forced is None:
        forced = torch.full((indptr.numel() - 1, heads, 2), -1, dtype=torch.int32)
    nnz = int(indptr[-1])
    base = torch.randint(-3, 4, (nnz, heads), generator=torch.Generator().manual_seed(seed)).float()
    for k in (1, 5, 30):
        want_scores = ops.force_scores(heads, base.clone(), indptr, forced)
        want = ops.topk_blocks(heads, want_scores, indptr, k)
        got_scores = base.clone()
        got = ops.topk_blocks(heads, got_scores, indptr, k, forced=forced)
        assert got.tolist() == want.tolist(), (seed, k)
        assert torch.equal(got_scores, want_scores)


def test_topk_blocks_takes_index_map_or_forced_not_both():
    from oasiskv import errors

    indptr = torch.tensor([0, 3], dtype=torch.int32)
    scores = torch.zeros(3, 1)
    both = torch.zeros(1, 1, 2, dtype=torch.int32)
    with pytest.raises(errors.InvalidArgumentError, match="not both"):
        ops.topk_blocks(1, scores, indptr, 2, index_map=both, forced=both)
    with pytest.raises(errors.ShapeError, match="forced must have shape"):
        ops.topk_blocks(1, scores, indptr, 2, forced=torch.zeros(1, 2, 2, dtype=torch.int32))


@pytest.mark.parametrize("seed", range(8))
def test_engine_one_stage_forced_top_k_is_keep_pins_then_top_k(seed):
    """The engine's one-stage top-K with sinks, pins or successors (one launch with ``forced``)
    against its definition, and the scores it was given are left as they were (a selection
    policy's may be kept)."""
    from oasiskv.engine import top_k_forced

    heads, indptr, _, _, forced = topk_candidates_case(seed)
    if forced is None:
        forced = torch.full((indptr.numel() - 1, heads, 1), 0, dtype=torch.int32)
    scores = torch.randint(
        -3, 4, (int(indptr[-1]), heads), generator=torch.Generator().manual_seed(seed)
    ).float()
    before = scores.clone()
    for k in (1, 4, 30):
        want = ops.topk_blocks(heads, keep_pins(scores, indptr, forced), indptr, k)
        assert top_k_forced(heads, scores, indptr, k, forced).tolist() == want.tolist(), (seed, k)
        assert torch.equal(scores, before)
    assert (
        top_k_forced(heads, scores, indptr, 3, None).tolist()
        == ops.topk_blocks(heads, scores, indptr, 3).tolist()
    )


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("m", RESCORE_TOPK_MS)
@pytest.mark.parametrize("group", RESCORE_TOPK_GROUPS)
@pytest.mark.parametrize("head_dim", RESCORE_TOPK_HEAD_DIMS)
@pytest.mark.parametrize("block_size", RESCORE_TOPK_BLOCK_SIZES)
def test_rescore_topk_codes_is_rescore_then_topk_candidates(block_size, head_dim, group, m, forced):
    """ops.rescore_topk_codes (the engine's one launch for the candidates) gives exactly
    ops.rescore_blocks_codes followed by ops.topk_candidates, ties included (copied blocks score
    the same), with and without successors and forced blocks, rows shorter than m included."""
    dtype = torch.bfloat16 if group % 2 else torch.float32
    gen = seeded("rescore_topk", block_size, head_dim, group, m, forced)
    geo, bounds, codes, q, indptr, indices, cand, f = rescore_topk_case(
        gen, dtype, group, head_dim, block_size, m, forced=forced
    )
    scores = ops.rescore_blocks_codes(geo, q, *bounds, codes, indptr, indices, cand)
    for n_succ in (0, 8):
        for k in sorted({1, max(1, m // 2), m, m + n_succ + 2}):
            got = ops.rescore_topk_codes(
                geo, q, *bounds, codes, indptr, indices, cand, k, successors=n_succ, forced=f
            )
            want = ops.topk_candidates(geo.num_kv_heads, scores, cand, indptr, k, successors=n_succ, forced=f)
            assert got.tolist() == want.tolist(), (n_succ, k)


def test_rescore_topk_codes_checks_like_the_two_ops():
    """A candidate outside its row raises on the CPU (as rescore_blocks_codes), and a bad out
    shape is a ShapeError before anything runs."""
    gen = seeded("rescore_topk-errors")
    geo, bounds, codes, q, indptr, indices, cand, _ = rescore_topk_case(gen, torch.float32, 2, 64, 8, 7)
    bad = cand.clone()
    bad[1, 0, 0] = 5  # row 1 has one block
    with pytest.raises(errors.OasisError):
        ops.rescore_topk_codes(geo, q, *bounds, codes, indptr, indices, bad, 4)
    with pytest.raises(errors.ShapeError):
        out = torch.empty(cand.shape[0], geo.num_kv_heads, 3, dtype=torch.int32)
        ops.rescore_topk_codes(geo, q, *bounds, codes, indptr, indices, cand, 4, out=out)
    with pytest.raises(errors.ShapeError, match="scales"):
        ops.rescore_topk_codes(geo, q, bounds[0], bounds[1][:-1], codes, indptr, indices, cand, 4)
