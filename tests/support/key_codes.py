"""The 2-bit key codes' independent reference (the definition, in float64) and the random cases
the CPU and GPU key-code tests share (``tests/kernels/test_key_codes.py``,
``test_gpu_key_codes.py``, ``test_gpu_kernels_random.py``, ``test_topk_candidates.py``; the
engine's and the evaluation's codes checks).

The codes live inside each block's 8-bit bound (``ops.build_bounds8``: the min/max summary in E4M3
rounded outward, a power-of-two scale per (block, KV head)), decoded here from the E4M3 format's
definition (:mod:`support.e4m3`, not the code under test): ``lo = decode(lo8) s``, ``hi =
decode(hi8) s``. The reference encodes each key in float64, ``c = round(3 (k - lo) / (hi - lo))``
half away from zero, clamped to 0..=3, 0 for an empty or NaN range or a NaN key, and scores in
float64: each logit is ``q_g . lo + sum_d c_d w_gd`` with the f16 code weights
``w = f16(f16(q / 3) f16(hi - lo))`` (``code_weights``), the largest over the block's tokens,
summed over the GQA group."""

from __future__ import annotations

import torch

from oasiskv import ops
from support import e4m3
from support.reference import csr, i32

LENS = [54, 1, 37, 0, 9]  # blocks per sequence: odd, one empty

#: How close (relative) 3 (k - lo) / (hi - lo) may come to a half-integer before the kernels' f32
#: arithmetic may round it to either neighbour (a few f32 ulps of a value at most 3).
TIE_EPS = 1e-5


def decode_bound(bounds8: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoded 8-bit bounds, float64 ``(lo, hi)`` ``[N, Hkv, D]`` each: the E4M3 bytes of rows
    0 and 1 times the scale of their (block, head), NaN throughout for a NaN scale."""
    vals = torch.from_numpy(e4m3.decode(bounds8.cpu().numpy()))  # float64 [N, H, 2, D]
    vals = vals * scales.cpu().double()[:, :, None, None]
    return vals[:, :, 0], vals[:, :, 1]


def ref_key_codes(
    host_k: torch.Tensor, bounds8: torch.Tensor, scales: torch.Tensor, block_ids: list[int]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The codes of each listed block as integers 0..3, ``[num_kv_heads, block_size, head_dim]``,
    encoded in float64 inside the decoded bound: ``(want, alt)``, where ``alt`` is the other code a
    value within :data:`TIE_EPS` of a half-integer may round to in f32 (``want`` elsewhere; exact
    half-integers round up, as the definition's half away from zero)."""
    lo_all, hi_all = decode_bound(bounds8, scales)
    out = {}
    for b in block_ids:
        k = host_k[b].double()  # [H, B, D]
        lo, hi = lo_all[b][:, None, :], hi_all[b][:, None, :]
        w = hi - lo
        v = 3.0 * (k - lo) / w
        ok = (w > 0) & ~torch.isnan(v)  # an empty or NaN range, or a NaN key: code 0
        v = torch.where(ok, v, torch.zeros_like(v))
        want = torch.floor(v + 0.5)
        frac = v - torch.floor(v)
        near = ((frac - 0.5).abs() < TIE_EPS) & (frac != 0.5)
        alt = torch.where(near, torch.where(want > v, want - 1, want + 1), want)
        want, alt = (x.clamp(0.0, 3.0).to(torch.int64) for x in (want, alt))
        out[b] = (want, alt)
    return out


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., head_dim // 4] -> int64 [..., head_dim]: channel 4i + j is bits 2j..2j+2 of byte i."""
    c = codes.to(torch.int64)
    parts = [(c >> (2 * j)) & 3 for j in range(4)]
    return torch.stack(parts, dim=-1).flatten(-2)


def code_weights(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The definition's code weights ``f16(f16(q / 3) * f16(hi - lo))`` (q / 3 and hi - lo in
    f32; the bound's values are exact in f32; the product of two f16 is exact in f32),
    broadcast, as float64."""
    f16 = torch.float16
    q3 = (q.float() / 3.0).to(f16).float()
    r = (hi.float() - lo.float()).to(f16).float()
    return (q3 * r).to(f16).double()


def ref_score_blocks_codes(
    q, bounds8, scales, codes, blk_indptr, blk_indices, exact_weights=False
) -> torch.Tensor:
    """q [S, Hq, D]; bounds8 [N, Hkv, 2, D] uint8, scales [N, Hkv]; codes [N, Hkv, B, D // 4];
    float64 [nnz, Hkv]. ``exact_weights``: ``q (hi - lo) / 3`` in float64 instead of the f16
    weights (the score of the dequantised keys ``lo + c (hi - lo) / 3``)."""
    s_n, hq, _ = q.shape
    hk = bounds8.shape[1]
    group = hq // hk
    lo_all, hi_all = decode_bound(bounds8, scales)
    out = torch.zeros(blk_indices.shape[0], hk, dtype=torch.float64)
    for s in range(s_n):
        for j in range(int(blk_indptr[s]), int(blk_indptr[s + 1])):
            b = int(blk_indices[j])
            c = unpack_codes(codes[b]).double()  # [Hkv, B, D]
            for h in range(hk):
                lo, hi = lo_all[b, h], hi_all[b, h]
                total = 0.0
                for g in range(h * group, (h + 1) * group):
                    qg = q[s, g]
                    if exact_weights:
                        w = qg.double() * (hi - lo) / 3.0
                    else:
                        w = code_weights(qg, lo, hi)
                    logits = qg.double() @ lo + c[h] @ w  # [B]
                    total += logits.max().item()
                out[j, h] = total
    return out


def ref_topk_nan_last(scores: torch.Tensor, blk_indptr: torch.Tensor, k: int) -> torch.Tensor:
    """[S, Hkv, k] int64: per (sequence, head) the k best logical blocks, higher score first, NaN
    after every number, ties to the lower index, -1 padded (the top-K kernels' order)."""
    hk = scores.shape[1]
    out = torch.full((blk_indptr.numel() - 1, hk, k), -1, dtype=torch.int64)
    for s in range(blk_indptr.numel() - 1):
        b0, b1 = int(blk_indptr[s]), int(blk_indptr[s + 1])
        for h in range(hk):
            col = [float(x) for x in scores[b0:b1, h]]

            def rank(i, col=col):
                nan = col[i] != col[i]
                return (nan, 0.0 if nan else -col[i], i)

            take = sorted(range(len(col)), key=rank)[:k]
            out[s, h, : len(take)] = torch.tensor(take, dtype=torch.int64)
    return out


def magnitude(q, bounds8, scales, blk_indptr, blk_indices) -> torch.Tensor:
    """sum_g sum_d |q_g,d| (|lo_d| + |hi_d|) per entry and head, over the decoded bound: the scale
    of the f32 rounding."""
    s_n, hq, d = q.shape
    hk = bounds8.shape[1]
    group = hq // hk
    lo, hi = decode_bound(bounds8, scales)
    seq = torch.repeat_interleave(torch.arange(s_n), torch.diff(blk_indptr).long())
    qa = q.double().abs().view(s_n, hk, group, d).sum(2)[seq]  # [nnz, Hkv, D]
    sa = (lo.abs() + hi.abs())[blk_indices.long()]  # [nnz, Hkv, D]
    return (qa * sa).sum(-1)


def key_codes_case(gen, dtype, group, head_dim, block_size, hk=2, lens=LENS, extra_host=7):
    """Random keys of ``sum(lens) + extra_host`` host blocks with their 8-bit bounds and codes (built
    by the CPU twins: summaries, then ``encode_blocks``), one query row per sequence, and the CSR
    tables of ``lens`` blocks per sequence: ``(geo, host_k, (bounds8, scales), codes, q, blk_indptr,
    blk_indices)``."""
    n_host = sum(lens) + extra_host
    geo = ops.KvGeometry(hk * group, hk, head_dim, block_size)
    host_k = torch.randn(n_host, hk, block_size, head_dim, generator=gen).to(dtype)
    ids = i32(list(range(n_host)))
    summaries = torch.empty(n_host, hk, 2, head_dim, dtype=dtype)
    ops.build_summaries(geo, host_k, ids, i32([block_size] * n_host), summaries)
    codes = ops.empty_key_codes(geo, n_host)
    bounds = ops.empty_bounds8(geo, n_host)
    ops.encode_blocks(geo, host_k, summaries, ids, codes, *bounds)
    blk_indptr = csr(lens)
    blk_indices = torch.randperm(n_host, generator=gen)[: sum(lens)].to(torch.int32)
    q = torch.randn(len(lens), hk * group, head_dim, generator=gen).to(dtype)
    return geo, host_k, bounds, codes, q, blk_indptr, blk_indices


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
    # magnitude sum_g sum_d |q| (|lo| + |hi|), not of the score itself (which cancels). The
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
    the row) or None: ``(geo, (bounds8, scales), codes, q, blk_indptr, blk_indices, cand, forced)``."""
    geo, host_k, bounds, codes, q, blk_indptr, blk_indices = key_codes_case(
        gen, dtype, group, head_dim, block_size, hk=hk, lens=lens
    )
    # Every fourth listed block reads the host block of the one before it: equal scores.
    dup = blk_indices.clone()
    dup[1::4] = blk_indices[0::4][: dup[1::4].numel()]
    cand = rescore_candidates(gen, blk_indptr, hk, m)
    f = None
    if forced:
        f = torch.randint(-2, max(lens) + 3, (len(lens), hk, 3), generator=gen).to(torch.int32)
    return geo, bounds, codes, q, blk_indptr, dup, cand, f
