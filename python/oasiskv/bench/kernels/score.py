"""``bench.kernels``' selection rows: the Quest score, the codes score, the two-stage chains
(the 8-bit bound, candidates, rescoring) and the delta select, against the copy ceiling."""

from __future__ import annotations

import math

import torch

from .common import i32, kernel_breakdown, time_both


def bench_score(ops, geo, dev, dtype, batch: int, ctx: int, k: int) -> dict:
    hq, hk, d, b = geo.num_qo_heads, geo.num_kv_heads, geo.head_dim, geo.block_size
    nb = ctx // b
    n_host = batch * nb
    summaries = torch.randn(n_host, hk, 2, d, device=dev, dtype=dtype)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
    blk_indptr = i32(list(range(0, n_host + 1, nb)), dev)
    blk_indices = torch.randperm(n_host, device=dev).to(torch.int32)
    scores = torch.empty(n_host, hk, device=dev, dtype=torch.float32)
    top = torch.empty(batch, hk, k, device=dev, dtype=torch.int32)

    def score():
        ops.score_blocks(geo, q, summaries, blk_indptr, blk_indices, scores)

    def both():
        score()
        ops.topk_blocks(hk, scores, blk_indptr, k, top)

    ms_s, _ = time_both(score)
    ms, eager = time_both(both)
    sb = n_host * hk * 2 * d * dtype.itemsize
    return {
        "label": f"score+top-{k}, {ctx} ctx, batch {batch}",
        "ms": ms,
        "eager_ms": eager,
        "score_only_ms": ms_s,
        "summary_bytes": sb,
        "Bps": sb / (ms * 1e-3),
        "score_only_Bps": sb / (ms_s * 1e-3),
    }


def codes_candidate_bytes(geo) -> int:
    """Bytes the codes score reads per (block, KV head): the block's 8-bit bound (``2 head_dim``
    E4M3 bytes) and its 2-bit codes (``block_size head_dim / 4`` bytes), 768 at head_dim 128,
    block 16 -- the codes once sat in the 16-bit summaries, 1,024 then. The bound's f32 scale
    (4 bytes more) is not counted."""
    return 2 * geo.head_dim + geo.block_size * geo.head_dim // 4


def codes_inputs(geo, dev, dtype, batch: int, ctx: int) -> tuple:
    """Random inputs of the codes scores at :func:`bench_score`'s shapes: ``(q, summaries (min <=
    max), bounds8, scales, codes, blk_indptr, blk_indices)`` (the 8-bit bound of those summaries,
    random codes), ``batch`` sequences of ``ctx // block_size`` blocks."""
    from oasiskv import ops

    hq, hk, d, b = geo.num_qo_heads, geo.num_kv_heads, geo.head_dim, geo.block_size
    nb = ctx // b
    n_host = batch * nb
    summaries = torch.randn(n_host, hk, 2, d, device=dev, dtype=dtype)
    summaries = torch.stack([summaries.amin(2), summaries.amax(2)], dim=2)  # min <= max
    bounds8, scales = ops.empty_bounds8(geo, n_host, dev)
    ops.build_bounds8(geo, summaries, torch.arange(n_host, device=dev, dtype=torch.int32), bounds8, scales)
    codes = torch.randint(0, 256, (n_host, hk, b, d // 4), device=dev, dtype=torch.uint8)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
    blk_indptr = i32(list(range(0, n_host + 1, nb)), dev)
    blk_indices = torch.randperm(n_host, device=dev).to(torch.int32)
    return q, summaries, bounds8, scales, codes, blk_indptr, blk_indices


def bench_score_codes(ops, geo, dev, dtype, batch: int, ctx: int, k: int) -> dict:
    """The 2-bit key-code score (issue 12) of every block + top-K at the shapes of
    :func:`bench_score`: it reads each block's 8-bit bound and codes
    (:func:`codes_candidate_bytes` per block and KV head)."""
    hk = geo.num_kv_heads
    q, _, bounds8, scales, codes, blk_indptr, blk_indices = codes_inputs(geo, dev, dtype, batch, ctx)
    n_host = blk_indices.numel()
    scores = torch.empty(n_host, hk, device=dev, dtype=torch.float32)
    top = torch.empty(batch, hk, k, device=dev, dtype=torch.int32)

    def score():
        ops.score_blocks_codes(geo, q, bounds8, scales, codes, blk_indptr, blk_indices, scores)

    def both():
        score()
        ops.topk_blocks(hk, scores, blk_indptr, k, top)

    ms_s, _ = time_both(score)
    ms, eager = time_both(both)
    read = n_host * hk * codes_candidate_bytes(geo)
    return {
        "label": f"codes score+top-{k}, {ctx} ctx, batch {batch}",
        "ms": ms,
        "eager_ms": eager,
        "score_only_ms": ms_s,
        "bound_bytes": bounds8.numel(),
        "code_bytes": codes.numel(),
        "bytes_per_block_head": codes_candidate_bytes(geo),
        "Bps": read / (ms * 1e-3),
        "score_only_Bps": read / (ms_s * 1e-3),
    }


def bench_score_codes_staged(
    ops,
    geo,
    dev,
    dtype,
    batch: int,
    ctx: int,
    k: int,
    factor: float,
    successors: int = 0,
    sticky: bool = False,
    profile: bool = False,
    bound8: bool = False,
    fused: bool = True,
) -> dict:
    """The two-stage codes score (``KvConfig(score_candidates=factor)``) at :func:`bench_score`'s
    shapes: the Quest bound and its top-``m`` (``m = ceil(factor k)``) per KV head, the codes
    score of those candidates, top-``k`` among them and the map back to logical blocks -- the
    engine's ``top_k_blocks``, in one CUDA graph. ``rescore_ms``: the codes score of the
    candidates alone. With ``successors`` or ``sticky`` the chain is the engine's own
    :func:`~oasiskv.engine.two_stage_top_k` with ``KvConfig(successor_blocks=successors)`` and a
    previous prediction of ``k`` random blocks kept among the candidates (``sticky_candidates``),
    and there is no ``rescore_ms`` (its candidates are not kept). ``profile``: each kernel's
    device time per call in ``kernels_us`` (:func:`kernel_breakdown`). ``bound8``: the first
    stage reads the 8-bit bound (``KvConfig.candidate_bound="fp8"``, the engine's chain).
    ``fused=False``: the engine's chain with the candidates' codes score and their top-K as two
    launches (:func:`ops.rescore_blocks_codes`, :func:`ops.topk_candidates`) instead of
    :func:`ops.rescore_topk_codes`' one (the same blocks), labelled ``unfused``."""
    hk = geo.num_kv_heads
    m = min(512, math.ceil(factor * k))
    q, summaries, bounds8, scales, codes, blk_indptr, blk_indices = codes_inputs(geo, dev, dtype, batch, ctx)
    n_host = blk_indices.numel()
    bound = torch.empty(n_host, hk, device=dev, dtype=torch.float32)
    cand = torch.empty(batch, hk, m, device=dev, dtype=torch.int32)
    rescored = torch.empty(batch * m, hk, device=dev, dtype=torch.float32)
    rows = i32(list(range(0, batch * m + 1, m)), dev)
    top = torch.empty(batch, hk, k, device=dev, dtype=torch.int32)

    def rescore():
        ops.rescore_blocks_codes(geo, q, bounds8, scales, codes, blk_indptr, blk_indices, cand, rescored)

    def staged():
        ops.score_blocks(geo, q, summaries, blk_indptr, blk_indices, bound)
        ops.topk_blocks(hk, bound, blk_indptr, m, cand)
        rescore()
        return ops.topk_blocks(hk, rescored, rows, k, top, index_map=cand)

    extra = ""
    if successors or sticky or bound8 or not fused:
        from oasiskv.engine import two_stage_top_k

        n_blocks = ctx // geo.block_size
        keep = None
        if sticky:
            keep = torch.argsort(torch.rand(batch, hk, n_blocks, device=dev), dim=-1)[..., :k].to(torch.int32)
        csr = (blk_indptr, blk_indices)
        counters = torch.zeros(batch * hk, dtype=torch.int32, device=dev)  # the engine's, per layer

        def staged():  # noqa: F811 -- the engine's chain instead
            return two_stage_top_k(
                geo,
                q,
                summaries,
                (bounds8, scales),
                codes,
                csr,
                k,
                m,
                keep=keep,
                successor_blocks=successors,
                bound8_first=bound8,
                fused=fused,
                counters=counters,
            )

        extra = (
            (f" +succ{successors}" if successors else "")
            + (" +sticky" if sticky else "")
            + (" +fp8" if bound8 else "")
            + ("" if fused else " unfused")
        )
    ms, eager = time_both(staged)
    row = {
        "label": f"codes x{factor:g}{extra} staged+top-{k}, {ctx} ctx, b {batch}",
        "candidates": m,
        # What the rescoring reads: m candidates per (sequence, KV head), each its bound and codes.
        "candidate_bytes": codes_candidate_bytes(geo),
        "rescore_bytes": batch * hk * m * codes_candidate_bytes(geo),
        "ms": ms,
        "eager_ms": eager,
    }
    if not extra:  # the engine's chain keeps its candidates to itself: `cand` is the hand chain's
        row["rescore_ms"], _ = time_both(rescore)  # on the candidates the last call chose
    if profile:
        row["kernels_us"] = kernel_breakdown(staged)
    return row


def bench_select(ops, geo, dev, batch: int, budget: int, cap: int) -> dict:
    hk = geo.num_kv_heads
    num_pages = batch * budget
    slot_pages = torch.arange(num_pages, dtype=torch.int32, device=dev).view(batch, budget)
    page_map = torch.randint(0, 4 * budget, (num_pages, hk), dtype=torch.int32, device=dev)
    last = torch.randint(0, 100, (num_pages, hk), dtype=torch.int32, device=dev)
    pred = torch.stack([torch.randperm(4 * budget, device=dev)[:budget] for _ in range(batch * hk)])
    pred = pred.view(batch, hk, budget).to(torch.int32)
    ps = torch.empty(batch, hk, cap, dtype=torch.int32, device=dev)
    pb = torch.empty_like(ps)
    step = [1000]

    def run():
        step[0] += 1
        ops.delta_select(hk, pred, slot_pages, page_map, last, step[0], cap, ps, pb)

    ms, eager = time_both(run)
    return {
        "label": f"delta select {batch} x {hk} heads x {budget} slots, cap {cap}",
        "ms": ms,
        "eager_ms": eager,
        "us": ms * 1e3,
    }


def score_rows(ops, geo, dev, dtype, args, d2d: float) -> list[dict]:
    """The selection kernels' rows of :func:`main`: the Quest score, the codes score over every
    block, the two-stage chains (F, successors, sticky, the 8-bit bound) at 64 x 32K (16 with
    ``--quick``), and the default chain at Fig. 11's shapes (16 and 44 x 16K), each as a ratio
    to the Quest row of its shape."""
    rows: list[dict] = []
    s = bench_score(ops, geo, dev, dtype, 16 if args.quick else 64, 32768, 128)
    s["ratio_to_d2d"], s["target"] = s["Bps"] / d2d, ">= 0.7 x d2d"
    rows.append(s)
    c = bench_score_codes(ops, geo, dev, dtype, 16 if args.quick else 64, 32768, 128)
    c["ratio_to_d2d"] = c["Bps"] / d2d
    c["ratio_to_quest"] = c["ms"] / s["ms"]  # time ratio: issue 12 asks <= 1.5
    c["target"] = "<= 1.5 x the Quest row's time"
    rows.append(c)
    batch = 16 if args.quick else 64
    for factor, succ, sticky, bound8 in (
        (1.25, 0, False, False),
        (1.5, 0, False, False),
        (2, 0, False, False),
        (3, 0, False, False),
        (1.25, 8, False, False),
        (1.25, 0, True, False),
        (1.25, 8, True, False),
        (1.2, 8, True, False),
        (1.25, 8, True, True),
    ):
        st = bench_score_codes_staged(
            ops, geo, dev, dtype, batch, 32768, 128, factor, succ, sticky, args.profile, bound8
        )
        st["ratio_to_quest"] = st["ms"] / s["ms"]
        st["target"] = "<= 1.5 x the Quest row's time"
        rows.append(st)
    # The serving benchmark's shape (bench.fig11: 16 requests of 16K): a small batch, where the
    # candidates' rescoring is latency-bound rather than bandwidth-bound (shorter tiles).
    s16 = bench_score(ops, geo, dev, dtype, 16, 16384, 128)
    s16["ratio_to_d2d"], s16["target"] = s16["Bps"] / d2d, "(the fig11 shape's Quest baseline)"
    rows.append(s16)
    for b8 in (False, True):
        st = bench_score_codes_staged(ops, geo, dev, dtype, 16, 16384, 128, 1.25, 8, True, args.profile, b8)
        st["ratio_to_quest"] = st["ms"] / s16["ms"]
        st["target"] = "<= 1.5 x the row above's time"
        rows.append(st)
    # The fig11 shape at the full host pool (44 x 16K on an H100), Quest and the default chain.
    s44 = bench_score(ops, geo, dev, dtype, 44, 16384, 128)
    s44["ratio_to_d2d"], s44["target"] = s44["Bps"] / d2d, "(44 x 16K Quest baseline)"
    rows.append(s44)
    for b8 in (False, True):
        st = bench_score_codes_staged(ops, geo, dev, dtype, 44, 16384, 128, 1.25, 8, True, args.profile, b8)
        st["ratio_to_quest"] = st["ms"] / s44["ms"]
        st["target"] = "(the default chain at 44 x 16K)"
        rows.append(st)
    # The default chain with the 8-bit bound scored on the tensor cores
    # (ops.set_bound8_score_kernel("mma")) at 44 x 16K and 64 x 32K, against the fma rows above.
    kernel_before = ops.bound8_score_kernel()
    try:
        ops.set_bound8_score_kernel("mma")
        for b, ctx, sq in ((44, 16384, s44), (batch, 32768, s)):
            st = bench_score_codes_staged(
                ops, geo, dev, dtype, b, ctx, 128, 1.25, 8, True, args.profile, True
            )
            st["label"] += " [mma bound8]"
            st["bound8_score_kernel"] = "mma"
            st["ratio_to_quest"] = st["ms"] / sq["ms"]
            st["target"] = "below the same chain's fma row"
            rows.append(st)
    finally:
        ops.set_bound8_score_kernel(kernel_before)
    # Issue 33: the default chain's candidates' codes score and top-K in one launch
    # (ops.rescore_topk_codes) against the two launches, at batch 1 (launch-bound) and at 22 x 32K
    # (Qwen3-8B's serving shape), each against the Quest row of its shape.
    for batch, ctx in ((1, 16384), (22, 32768)):
        sq = bench_score(ops, geo, dev, dtype, batch, ctx, 128)
        sq["ratio_to_d2d"], sq["target"] = sq["Bps"] / d2d, f"({batch} x {ctx // 1024}K Quest baseline)"
        rows.append(sq)
        for fused in (True, False):
            st = bench_score_codes_staged(
                ops, geo, dev, dtype, batch, ctx, 128, 1.25, 8, True, args.profile, True, fused
            )
            st["ratio_to_quest"] = st["ms"] / sq["ms"]
            st["target"] = "fused: <= the unfused row" if fused else "(the two launches)"
            rows.append(st)
    return rows
