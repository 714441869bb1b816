"""The 2-bit key codes' independent reference (the definition, in float64) and the random cases
the CPU and GPU key-code tests share (``tests/kernels/test_key_codes.py``,
``test_gpu_key_codes.py``, ``test_gpu_kernels_random.py``; the evaluation's codes policy in
``tests/eval/test_eval.py``).

The reference quantises per the definition (``c = round(3 (k - min) / (max - min))`` in f32, half
away from zero, clamped to 0..=3, 0 for an empty range or NaN) and scores in float64: each logit is
``q_g . min + sum_d c_d w_gd`` with the f16 code weights ``w = f16(f16(q / 3) f16(max - min))``
(``code_weights``), the largest over the block's tokens, summed over the GQA group."""

from __future__ import annotations

import torch

from oasiskv import ops
from support.reference import csr, i32

LENS = [54, 1, 37, 0, 9]  # blocks per sequence: odd, one empty


def ref_key_codes(
    host_k: torch.Tensor, summaries: torch.Tensor, block_ids: list[int]
) -> dict[int, torch.Tensor]:
    """The codes of each listed block as integers 0..3, [num_kv_heads, block_size, head_dim]."""
    out = {}
    for b in block_ids:
        k = host_k[b].float()  # [H, B, D]
        lo = summaries[b, :, 0].float()[:, None, :]
        hi = summaries[b, :, 1].float()[:, None, :]
        w = hi - lo  # float32 arithmetic, as the definition
        v = ((k - lo) / w * 3.0).double()
        c = torch.floor(v + 0.5)  # half away from zero (v >= 0 where it matters)
        c = torch.where(torch.isnan(c) | (c < 0), torch.zeros_like(c), c).clamp(max=3.0)
        c = torch.where((w > 0).expand_as(c), c, torch.zeros_like(c))
        out[b] = c.to(torch.int64)
    return out


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., head_dim // 4] -> int64 [..., head_dim]: channel 4i + j is bits 2j..2j+2 of byte i."""
    c = codes.to(torch.int64)
    parts = [(c >> (2 * j)) & 3 for j in range(4)]
    return torch.stack(parts, dim=-1).flatten(-2)


def code_weights(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The definition's code weights ``f16(f16(q / 3) * f16(max - min))`` (q / 3 and max - min in
    f32; the product of two f16 is exact in f32), broadcast, as float64."""
    f16 = torch.float16
    q3 = (q.float() / 3.0).to(f16).float()
    r = (hi.float() - lo.float()).to(f16).float()
    return (q3 * r).to(f16).double()


def ref_score_blocks_codes(q, summaries, codes, blk_indptr, blk_indices, exact_weights=False) -> torch.Tensor:
    """q [S, Hq, D]; summaries [N, Hkv, 2, D]; codes [N, Hkv, B, D // 4]; float64 [nnz, Hkv].
    ``exact_weights``: ``q (max - min) / 3`` in float64 instead of the f16 weights (the score of
    the dequantised keys ``min + c (max - min) / 3``)."""
    s_n, hq, _ = q.shape
    hk = summaries.shape[1]
    group = hq // hk
    out = torch.zeros(blk_indices.shape[0], hk, dtype=torch.float64)
    for s in range(s_n):
        for j in range(int(blk_indptr[s]), int(blk_indptr[s + 1])):
            b = int(blk_indices[j])
            c = unpack_codes(codes[b]).double()  # [Hkv, B, D]
            for h in range(hk):
                lo, hi = summaries[b, h, 0], summaries[b, h, 1]
                total = 0.0
                for g in range(h * group, (h + 1) * group):
                    qg = q[s, g]
                    if exact_weights:
                        w = qg.double() * (hi.double() - lo.double()) / 3.0
                    else:
                        w = code_weights(qg, lo, hi)
                    logits = qg.double() @ lo.double() + c[h] @ w  # [B]
                    total += logits.max().item()
                out[j, h] = total
    return out


def magnitude(q, summaries, blk_indptr, blk_indices) -> torch.Tensor:
    """sum_g sum_d |q_g,d| (|min_d| + |max_d|) per entry and head: the scale of the f32 rounding."""
    s_n, hq, d = q.shape
    hk = summaries.shape[1]
    group = hq // hk
    seq = torch.repeat_interleave(torch.arange(s_n), torch.diff(blk_indptr).long())
    qa = q.double().abs().view(s_n, hk, group, d).sum(2)[seq]  # [nnz, Hkv, D]
    sa = summaries.double().abs()[blk_indices.long()].sum(2)  # [nnz, Hkv, D]
    return (qa * sa).sum(-1)


def key_codes_case(gen, dtype, group, head_dim, block_size, hk=2, lens=LENS, extra_host=7):
    """Random keys of ``sum(lens) + extra_host`` host blocks with their summaries and codes (built by
    the CPU twins), one query row per sequence, and the CSR tables of ``lens`` blocks per sequence:
    ``(geo, host_k, summaries, codes, q, blk_indptr, blk_indices)``."""
    n_host = sum(lens) + extra_host
    geo = ops.KvGeometry(hk * group, hk, head_dim, block_size)
    host_k = torch.randn(n_host, hk, block_size, head_dim, generator=gen).to(dtype)
    summaries = torch.empty(n_host, hk, 2, head_dim, dtype=dtype)
    ops.build_summaries(geo, host_k, i32(list(range(n_host))), i32([block_size] * n_host), summaries)
    codes = ops.empty_key_codes(geo, n_host)
    ops.build_key_codes(geo, host_k, summaries, i32(list(range(n_host))), codes)
    blk_indptr = csr(lens)
    blk_indices = torch.randperm(n_host, generator=gen)[: sum(lens)].to(torch.int32)
    q = torch.randn(len(lens), hk * group, head_dim, generator=gen).to(dtype)
    return geo, host_k, summaries, codes, q, blk_indptr, blk_indices


def rescore_candidates(gen, blk_indptr, hk: int, m: int) -> torch.Tensor:
    """[S, hk, m] int32: per (sequence, head) distinct logical blocks of the sequence in random
    order, then -1 padding where the sequence has fewer than m blocks."""
    out = torch.full((blk_indptr.numel() - 1, hk, m), -1, dtype=torch.int32)
    for s in range(blk_indptr.numel() - 1):
        n = int(blk_indptr[s + 1] - blk_indptr[s])
        for h in range(hk):
            pick = torch.randperm(n, generator=gen)[:m]
            out[s, h, : pick.numel()] = pick.to(torch.int32)
    return out


def assert_scores_close(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor) -> None:
    # NOTE: the tensor-core path computes the twin's products (codes times f16 weights, exact in
    # f32) but sums them in another order, so the difference is bounded by f32 rounding of the
    # magnitude sum_g sum_d |q| (|min| + |max|), not of the score itself (which cancels). The
    # scalar path is the twin's bit for bit.
    got, want = got.double(), want.double()
    same_nan = torch.equal(got.isnan(), want.isnan())
    assert same_nan, "NaN in different entries"
    ok = ~want.isnan()
    err = (got[ok] - want[ok]).abs()
    tol = 1e-5 * mag[ok] + 1e-6
    assert (err <= tol).all(), f"max error {err.max().item():.3g}, worst ratio {(err / tol).max().item():.3g}"


# The fused last step of the two-stage score (ops.rescore_topk_codes) over random geometries.
RESCORE_TOPK_BLOCK_SIZES = [8, 16, 32]
RESCORE_TOPK_HEAD_DIMS = [64, 128]
RESCORE_TOPK_GROUPS = [1, 2, 3, 4, 5, 8]
RESCORE_TOPK_MS = [1, 7, 40, 64]
RESCORE_TOPK_LENS = [54, 1, 37, 0, 9, 70]  # rows shorter and longer than m; one empty


def rescore_topk_case(gen, dtype, group, head_dim, block_size, m, hk=2, lens=RESCORE_TOPK_LENS, forced=True):
    """:func:`key_codes_case` with ties (a few host blocks are copies of others: equal codes scores,
    broken by candidate position) plus the candidates ``[S, hk, m]`` (:func:`rescore_candidates`:
    -1 padded where a row is shorter than m) and forced blocks ``[S, hk, 3]`` (some -1, some past
    the row) or None: ``(geo, summaries, codes, q, blk_indptr, blk_indices, cand, forced)``."""
    geo, host_k, summaries, codes, q, blk_indptr, blk_indices = key_codes_case(
        gen, dtype, group, head_dim, block_size, hk=hk, lens=lens
    )
    # Every fourth listed block reads the host block of the one before it: equal scores.
    dup = blk_indices.clone()
    dup[1::4] = blk_indices[0::4][: dup[1::4].numel()]
    cand = rescore_candidates(gen, blk_indptr, hk, m)
    f = None
    if forced:
        f = torch.randint(-2, max(lens) + 3, (len(lens), hk, 3), generator=gen).to(torch.int32)
    return geo, summaries, codes, q, blk_indptr, dup, cand, f
